"""Prompts for `llamabatch run` (from -p, and from prompt files read as a batch job reads them:
plain lines or JSON Lines with sampling fields, .gz or '-') and items for `llamabatch score`,
all held in memory."""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path

from ..engine import MediaPrompt, SamplingParams
from ..errors import LlamabatchError
from .inputs import BadLine, Format, RequestReader, numbered_lines


def gather_prompts(
    prompts: list[str], prompts_file: Path | None, base: SamplingParams
) -> tuple[list[str | MediaPrompt], list[SamplingParams]]:
    """-p prompts first, then the file's; each with `base` or the file's own sampling fields."""
    params = [base] * len(prompts)
    if prompts_file is not None:
        file_prompts, file_params = read_prompts_file(prompts_file, base)
        prompts, params = prompts + file_prompts, params + file_params
    if not prompts:
        raise LlamabatchError("no prompts: give -p PROMPT (repeatable) or --prompts-file FILE")
    return prompts, params


def read_prompts_file(path: Path, base: SamplingParams) -> tuple[list[str | MediaPrompt], list[SamplingParams]]:
    """Every prompt of the file; a bad line stops `run` before anything is decoded."""
    reader = RequestReader(path, base)
    if reader.format is Format.OPENAI:
        reader.close()
        raise LlamabatchError(f"{path} is an OpenAI batch file: run it with `llamabatch batch {path} -o OUTPUT`")
    prompts, params = [], []
    with closing(reader):
        for request in reader:
            if isinstance(request, BadLine):
                raise LlamabatchError(f"{path}:{request.line}: {request.message}")
            try:
                prompts.append(request.engine_prompt())
            except LlamabatchError as e:
                raise LlamabatchError(f"{path}:{request.line}: {e}") from None
            params.append(request.params)
    return prompts, params


def read_score_items(path: Path) -> list[str | tuple[str, str]]:
    """`llamabatch score` items: JSON Lines of {"context", "continuation"} pairs or {"text"}."""
    items: list[str | tuple[str, str]] = []
    for n, text in numbered_lines(path):
        where = f"{path}:{n}"
        try:
            obj = json.loads(text) if text is not None else None
        except json.JSONDecodeError as e:
            raise LlamabatchError(f"{where}: not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and set(obj) <= {"context", "continuation", "id"} and \
                isinstance(obj.get("context"), str) and isinstance(obj.get("continuation"), str):
            items.append((obj["context"], obj["continuation"]))
        elif isinstance(obj, dict) and set(obj) <= {"text", "id"} and isinstance(obj.get("text"), str):
            items.append(obj["text"])
        else:
            raise LlamabatchError(f'{where}: expected {{"context": ..., "continuation": ...}} or {{"text": ...}}')
    if not items:
        raise LlamabatchError(f"{path} holds no items to score")
    return items
