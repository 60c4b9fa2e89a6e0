"""The model catalog (models.toml): names to GGUF files, with per-model engine defaults."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import ModelError

GGUF_MAGIC = b"GGUF"
FINGERPRINT_BYTES = 4 << 20  # read at each end of a model file: its header, and its last tensors
# The catalog every command and BatchEngine reads when not given one (--config, catalog=).
CATALOG_ENV = "LLAMABATCH_CATALOG"


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter for a model: --lora names it, a request chooses it by name."""

    name: str
    path: Path
    scale: float = 1.0


@dataclass(frozen=True)
class ModelSpec:
    """One catalog entry: where the GGUF comes from, and the engine defaults for it."""

    name: str
    path: Path | None = None  # a local GGUF file...
    package: str | None = None  # ...or an installed package whose assemble() writes one
    description: str = ""
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    parallel: int = 4
    threads: int = 0  # 0 = all cores
    gpu_layers: int = -1  # -1 = all; CPU builds ignore it
    chat: bool = False
    chat_template: str | None = None  # a llama.cpp built-in template name, for GGUFs without one
    adapters: tuple[AdapterSpec, ...] = ()  # LoRA adapters made for this model
    rpc: tuple[str, ...] | str = ()  # rpc-server endpoints (HOST:PORT) holding layers of it
    tensor_split: tuple[float, ...] | str = ()  # each device's share of the offloaded layers
    mmproj: Path | None = None  # its multimodal projector GGUF (images in prompts)

    @property
    def source(self) -> str:
        return str(self.path) if self.path else f"package {self.package}"

    def is_available(self) -> bool:
        if self.path is not None:
            return self.path.is_file()
        return importlib.util.find_spec(self._package) is not None

    def gguf_path(self) -> Path:
        """The GGUF file, checked to exist and to start with the GGUF magic."""
        path = self.path if self.path is not None else _assemble(self._package)
        return check_gguf(path)

    @property
    def _package(self) -> str:
        assert self.package is not None, "a model names a path or a package (the catalog checks)"
        return self.package


def check_gguf(path: Path) -> Path:
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelError(f"not a GGUF file (bad magic bytes): {path}")
    return path


def _assemble(package: str) -> Path:
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError:
        raise ModelError(f"model package {package!r} is not installed (pip install {package.replace('_', '-')})") from None
    return Path(module.assemble())


@dataclass(frozen=True)
class Catalog:
    default: str
    models: dict[str, ModelSpec]
    source: Path | None = None

    @classmethod
    def load(cls, path: Path | str | None = None) -> Catalog:
        """Read a models.toml; without a path, the one $LLAMABATCH_CATALOG names, else the one
        packaged with llamabatch."""
        path = path or os.environ.get(CATALOG_ENV) or None
        if path is None:
            text = resources.files("llamabatch").joinpath("models.toml").read_text()
            base, source = None, None
        else:
            source = Path(path).expanduser()
            if not source.is_file():
                raise ModelError(f"catalog file not found: {source}")
            text, base = source.read_text(), source.parent
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ModelError(f"cannot parse catalog {source or 'models.toml'}: {e}") from None
        models = {name: _spec(name, entry, base) for name, entry in data.get("models", {}).items()}
        default = data.get("default", next(iter(models), ""))
        return cls(default=default, models=models, source=source)

    def resolve(self, model: str | Path | None = None) -> ModelSpec:
        """A catalog name, or a path to a .gguf file (which gets the generic defaults)."""
        model = self.default if model is None else model
        if isinstance(model, str) and model in self.models:
            return self.models[model]
        path = Path(model).expanduser()
        if isinstance(model, Path) or path.suffix == ".gguf" or path.exists():
            return ModelSpec(name=path.stem, path=path)
        known = ", ".join(sorted(self.models)) or "none"
        raise ModelError(f"unknown model {model!r} (catalog has: {known}; or pass a path to a .gguf file)")


_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)} - {"name"}


def _spec(name: str, entry: dict, base: Path | None) -> ModelSpec:
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ModelError(f"model {name!r} in catalog: unknown keys {sorted(unknown)}")
    if ("path" in entry) == ("package" in entry):
        raise ModelError(f"model {name!r} in catalog: give exactly one of 'path' or 'package'")
    for key in ("path", "mmproj"):
        if key in entry:
            entry = {**entry, key: _relative_to(base, entry[key])}
    if "adapters" in entry:
        entry = {**entry, "adapters": _adapters(name, entry["adapters"], base)}
    return ModelSpec(name=name, **entry)


def _relative_to(base: Path | None, text: str) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() or base is None else base / path


def _adapters(model: str, table: object, base: Path | None) -> tuple[AdapterSpec, ...]:
    """[models.NAME.adapters]: `name = "path.gguf"` or `name = { path = "...", scale = 0.5 }`."""
    if not isinstance(table, dict):
        raise ModelError(f"model {model!r} in catalog: adapters must be a table of name = path")
    specs = []
    for name, value in table.items():
        entry = {"path": value} if isinstance(value, str) else value
        if not isinstance(entry, dict) or set(entry) - {"path", "scale"} or not isinstance(entry.get("path"), str):
            raise ModelError(f"model {model!r} in catalog: adapter {name!r} must be a path, or {{ path = ..., scale = ... }}")
        scale = entry.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise ModelError(f"model {model!r} in catalog: adapter {name!r} has a scale that is not a number")
        specs.append(AdapterSpec(name, _relative_to(base, entry["path"]), float(scale)))
    return tuple(specs)


def model_fingerprint(path: Path) -> str:
    """A model file's identity, cheap for a file of many gigabytes: its size, and a digest of
    its first and last 4 MiB (the GGUF header with its metadata and vocabulary, and tensor data)."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        h.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        h.update(f.read(FINGERPRINT_BYTES))
    return f"{size}:{h.hexdigest()}"
