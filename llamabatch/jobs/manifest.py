"""A job's manifest beside its output (OUTPUT.manifest.json): the model, the input format and the
default sampling settings that made the output. Resuming into an output made by a different
job is refused instead of mixing two jobs' results in one file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine import SamplingParams
from ..errors import LlamabatchError
from .inputs import Format


@dataclass(frozen=True)
class Manifest:
    output: Path
    settings: dict  # what must match for a resumed run to continue the same job

    @property
    def path(self) -> Path:
        return self.output.with_name(self.output.name + ".manifest.json")

    @classmethod
    def for_job(cls, model_name: str, model_path: Path, fmt: Format, base: SamplingParams, output: Path) -> Manifest:
        settings = {
            "model": model_name,
            "model_bytes": model_path.stat().st_size,
            "format": fmt.value,
            # OpenAI bodies carry their own sampling fields; the other formats start from these.
            "defaults": None if fmt is Format.OPENAI else json.loads(json.dumps(asdict(base))),
        }
        return cls(output, settings)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.settings, indent=1) + "\n")

    def check_or_write(self) -> None:
        """Refuse to continue another job's output; start this job's manifest if there is none."""
        if not self.path.exists():
            self.write()
            return
        try:
            recorded = json.loads(self.path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LlamabatchError(f"{self.path} is not a llamabatch manifest: use --overwrite or another output") from None
        changed = _differences(recorded, self.settings)
        if changed:
            raise LlamabatchError(
                f"{self.output} holds the results of a different job ({', '.join(changed)}): "
                "resume with the same model, input format and sampling options, or use --overwrite"
            )


def _differences(recorded: dict, current: dict) -> list[str]:
    """'key old -> new' for each setting that changed, sampling defaults one by one."""
    changed = []
    for key, value in current.items():
        old = recorded.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            changed += [f"{k} {old.get(k)!r} -> {v!r}" for k, v in value.items() if old.get(k) != v]
        elif old != value:
            changed.append(f"{key} {old!r} -> {value!r}")
    return changed
