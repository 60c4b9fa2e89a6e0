"""Prompts from the command line and from prompt files (plain lines, or JSON Lines with sampling fields)."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

from ..errors import LlamabatchError
from ..engine import SamplingParams

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


def gather_prompts(
    prompts: list[str], prompts_file: Path | None, base: SamplingParams
) -> tuple[list[str], list[SamplingParams]]:
    """-p prompts first, then the file's; each with `base` or the file's own sampling fields."""
    params = [base] * len(prompts)
    if prompts_file is not None:
        file_prompts, file_params = read_prompts_file(prompts_file, base)
        prompts, params = prompts + file_prompts, params + file_params
    if not prompts:
        raise LlamabatchError("no prompts: give -p PROMPT (repeatable) or --prompts-file FILE")
    return prompts, params


def read_prompts_file(path: Path, base: SamplingParams) -> tuple[list[str], list[SamplingParams]]:
    """Plain text (one prompt per non-blank line) or JSON Lines ({"prompt": ..., sampling fields})."""
    if not path.is_file():
        raise LlamabatchError(f"prompts file not found: {path}")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines or not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines], [base] * len(lines)
    prompts, params = [], []
    for n, line in lines:
        prompt, sampling = _parse_jsonl_entry(line, f"{path}:{n}")
        try:
            params.append(replace(base, **sampling))
        except LlamabatchError as e:
            raise LlamabatchError(f"{path}:{n}: {e}") from None
        prompts.append(prompt)
    return prompts, params


def _parse_jsonl_entry(line: str, where: str) -> tuple[str, dict]:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise LlamabatchError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
        raise LlamabatchError(f"{where}: expected an object with a string 'prompt'")
    unknown = set(entry) - _SAMPLING_FIELDS - {"prompt"}
    if unknown:
        raise LlamabatchError(f"{where}: unknown fields {sorted(unknown)}")
    prompt = entry.pop("prompt")
    return prompt, entry
