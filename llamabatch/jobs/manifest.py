"""A job's manifest beside its output (OUTPUT.manifest.json): what made the output what it is,
apart from the requests themselves (each output line records its own request's digest). A
resumed run with a different model file, input format, sampling defaults or output-changing
engine setting is refused, naming what changed, instead of mixing two jobs in one file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..catalog import AdapterSpec, model_fingerprint
from ..embeddings_format import EmbedSettings
from ..engine import EngineConfig, SamplingParams
from ..errors import LlamabatchError
from .inputs import Format

# Settings recorded since a later version: what an older manifest's job ran with.
_RECORDED_SINCE = {"cache_types": ["f16", "f16"], "adapters": []}




def job_settings(
    model_name: str, model_path: Path, config: EngineConfig, fmt: Format, base: SamplingParams,
    embed: EmbedSettings | None = None, adapters: Iterable[tuple[AdapterSpec, bool]] = (),
) -> dict:
    """What must match for a resumed run to continue the same job (an embedding job's pooling
    and normalisation among them; the LoRA adapters loaded, in id order, each with its scale and
    whether it applies by default)."""
    return {
        "model": model_name,
        "model_fingerprint": model_fingerprint(model_path),
        "format": fmt.value,
        # OpenAI bodies carry their own sampling fields; the other formats start from these.
        "defaults": None if fmt is Format.OPENAI else json.loads(json.dumps(asdict(base))),
        # Engine settings that change what an answer is. Not the context size (a larger one, to
        # retry prompts that were too long, leaves every earlier answer as valid), nor slots,
        # threads, batch sizes or speculation.
        "chat": config.chat,
        "deterministic": config.deterministic,
        "cache_types": [config.cache_type_k, config.cache_type_v],
        "adapters": [[spec.name, model_fingerprint(spec.path), spec.scale, applied] for spec, applied in adapters],
        **({"embedding": embed.manifest()} if embed is not None else {}),
    }


@dataclass(frozen=True)
class Manifest:
    output: Path
    settings: dict

    @property
    def path(self) -> Path:
        return self.output.with_name(self.output.name + ".manifest.json")

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.settings, indent=1) + "\n")

    def check(self) -> None:
        """Refuse to continue an output whose manifest records other settings, or one that holds
        something no job wrote (no manifest beside it: `run --json` output, say); a new output is fine."""
        if not self.path.exists():
            if _holds_something(self.output):
                raise LlamabatchError(
                    f"{self.output} is not empty and no llamabatch job wrote it (it has no {self.path.name} beside it): "
                    "use --overwrite or another output"
                )
            return
        try:
            recorded = json.loads(self.path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LlamabatchError(f"{self.path} is not a llamabatch manifest: use --overwrite or another output") from None
        changed = _differences(recorded, self.settings)
        if changed:
            raise LlamabatchError(
                f"{self.output} holds the results of a different job ({', '.join(changed)}): "
                "resume with the same model, input format and options, or use --overwrite"
            )


def _holds_something(output: Path) -> bool:
    """A non-empty file, or a folder (a Parquet output) with anything in it."""
    if output.is_dir():
        return any(output.iterdir())
    return output.exists() and output.stat().st_size > 0


def _differences(recorded: dict, current: dict) -> list[str]:
    """'key old -> new' for each setting that changed, sampling defaults one by one."""
    changed = []
    for key, value in current.items():
        old = recorded.get(key, _RECORDED_SINCE.get(key))
        if isinstance(old, dict) and isinstance(value, dict):
            changed += [f"{k} {old.get(k)!r} -> {v!r}" for k, v in value.items() if old.get(k) != v]
        elif old != value:
            changed.append(f"{key} {old!r} -> {value!r}")
    return changed
