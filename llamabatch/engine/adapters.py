"""LoRA adapters: loaded with the engine (or while it runs), chosen per sequence, applied per step.

llama.cpp applies one adapter set to a whole decode (the context holds it; there is no
per-sequence adapter), so a sequence's adapter set is part of what it is: the scheduler decodes
one set per step, and KV computed under one set is never reused under another. An adapter loaded
while the engine runs gets an id no adapter had before, and one unloaded leaves its id unused, so
a slot's memory made under an adapter is never taken for another's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..catalog import AdapterSpec, check_gguf
from ..errors import ConfigError, ModelError, SamplingError, UnknownModel
from .native.handles import Context, LoraAdapter, Model

# (adapter id, scale) pairs by id, without zero scales: what a sequence decodes under. () is the
# base model. Ids number the engine's adapters as llama-server does: --lora ones first, in order.
AdapterSet = tuple[tuple[int, float], ...]
BASE: AdapterSet = ()


def adapter_set(pairs: Iterable[tuple[int, float]]) -> AdapterSet:
    """Pairs as an AdapterSet; raises SamplingError for a repeated id or a scale that is not a finite number."""
    chosen: dict[int, float] = {}
    for id, scale in pairs:
        if int(id) in chosen:
            raise SamplingError(f"lora: adapter {id} is given twice")
        if not math.isfinite(scale):
            raise SamplingError(f"lora: adapter {id}'s scale must be a finite number, got {scale}")
        chosen[int(id)] = float(scale)
    return tuple(sorted((id, scale) for id, scale in chosen.items() if scale != 0.0))


def parse_lora(text: str) -> tuple[str, float]:
    """--lora's PATH[:SCALE] (or NAME[:SCALE], an adapter the catalog declares for the model)."""
    source, _, scale = text.rpartition(":")
    if source and scale:
        try:
            value = float(scale)
        except ValueError:
            return text, 1.0  # a colon in the path itself
        if not math.isfinite(value):
            raise ConfigError(f"--lora {text}: the scale must be a finite number")
        return source, value
    return text, 1.0


@dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter, as /v1/models and llama-server's /lora-adapters list it."""

    id: int
    name: str
    path: Path
    scale: float  # what a request that names it (as its model) gets; --lora ones: the default set's


def chosen_adapters(declared: Iterable[AdapterSpec], lora: Iterable[str]) -> list[tuple[AdapterSpec, bool]]:
    """The adapters an engine loads, in id order, each with whether it is applied by default:
    the --lora ones (a catalog name or a path, at the scale given) first, then the catalog's."""
    by_name = {spec.name: spec for spec in declared}
    chosen: list[tuple[AdapterSpec, bool]] = []
    for text in lora:
        source, scale = parse_lora(text)
        spec = by_name.pop(source, None) or AdapterSpec(Path(source).stem, Path(source).expanduser())
        chosen.append((AdapterSpec(spec.name, spec.path, scale), True))
    chosen += [(spec, False) for spec in by_name.values()]
    names = [spec.name for spec, _ in chosen]
    if len(set(names)) < len(names):
        raise ConfigError(f"two LoRA adapters share a name: {sorted(n for n in names if names.count(n) > 1)}")
    return chosen


class Adapters:
    """The LoRA adapters an engine holds (the --lora ones, then the catalog's for its model, then
    any loaded while it runs), owned and freed together, before the model. `default` is what a
    sequence decodes under when it asks for nothing: the --lora adapters at their scales. `info`
    is replaced whole on each change, so other threads read one version of it."""

    def __init__(self, model: Model, declared: Iterable[AdapterSpec], lora: Iterable[str]) -> None:
        self.model = model
        self.chosen = chosen = chosen_adapters(declared, lora)  # (spec, applied by default), in id order
        self.info: tuple[AdapterInfo, ...] = ()
        self._loaded: dict[int, LoraAdapter] = {}
        self._next_id = 0
        try:
            for spec, _ in chosen:
                self.load(spec.name, spec.path, spec.scale)
        except Exception:
            self.close()
            raise
        self.n_fixed = len(chosen)  # ids below this are the engine's from the start (the prompt cache's files name them)
        self.default: AdapterSet = adapter_set((id, spec.scale) for id, (spec, applied) in enumerate(chosen) if applied)
        self._applied: AdapterSet = BASE  # what the context holds now: a new context has no adapters

    def load(self, name: str, path: Path, scale: float = 1.0) -> AdapterInfo:
        """Load an adapter under a new id; ModelError for a file that is not one of this model's adapters."""
        if any(a.name == name for a in self.info):
            raise ConfigError(f"a LoRA adapter named {name!r} is loaded already")
        try:
            adapter = LoraAdapter(self.model, check_gguf(path))
        except ModelError as e:
            raise ModelError(f"LoRA adapter {name!r}: {e}") from None
        id, self._next_id = self._next_id, self._next_id + 1  # never an id another adapter had
        self._loaded[id] = adapter
        info = AdapterInfo(id, name, Path(path), scale)
        self.info = (*self.info, info)
        return info

    def unload(self, ctx: Context, name: str) -> AdapterInfo:
        """Free an adapter (the caller has made sure no sequence uses it); ConfigError for one of
        the default set, UnknownModel for none of that name."""
        adapter = self.named(name)
        if any(id == adapter.id for id, _ in self.default):
            raise ConfigError(f"LoRA adapter {name!r} is one of --lora's, applied to every request that names none: it stays")
        if any(id == adapter.id for id, _ in self._applied):
            ctx.set_adapters([], [])  # (llama.cpp must not hold an adapter it frees)
            self._applied = BASE
        self.info = tuple(a for a in self.info if a.id != adapter.id)
        self._loaded.pop(adapter.id).close()
        return adapter

    def named(self, name: str) -> AdapterInfo:
        adapter = next((a for a in self.info if a.name == name), None)
        if adapter is None:
            raise UnknownModel(f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(a.name for a in self.info) or 'none'})")
        return adapter

    def by_model(self, model: str | None, served: set[str]) -> AdapterSet | None:
        """The set a request's `model` asks for: None for the served model (or none named), an
        adapter's own set for its name (it alone, at its scale, as vLLM lists adapters as models).
        Raises UnknownModel for a model that is neither."""
        if model is None or model in served:
            return None
        adapter = next((a for a in self.info if a.name == model), None)
        if adapter is None:
            known = sorted(served | {a.name for a in self.info})
            raise UnknownModel(f"the model {model!r} does not exist here (served: {', '.join(known)})")
        return ((adapter.id, adapter.scale),)

    def choose(self, model: str | None, lora: Iterable[tuple[int, float]] | None, served: set[str]) -> AdapterSet | None:
        """A request's adapter set from its `model` (by_model) and llama-server's `lora` field
        (ids not listed get scale 0); None: the engine's default. Raises UnknownModel for an
        unknown model, SamplingError for an unknown adapter id or a request that names an
        adapter both ways."""
        named = self.by_model(model, served)
        if lora is None:
            return named
        if named is not None:
            raise SamplingError(f"model {model!r} is a LoRA adapter: choose adapters with it or with the lora field, not both")
        return adapter_set(lora)  # ids are checked where the engine takes the sequence (BatchEngine.add)

    def check(self, pairs: AdapterSet) -> None:
        for id, _ in pairs:
            if id not in self._loaded:
                have = f"ids {', '.join(str(a.id) for a in self.info)}" if self.info else "none loaded"
                raise SamplingError(f"lora: no adapter with id {id} (this engine has {have})")

    def apply(self, ctx: Context, pairs: AdapterSet) -> bool:
        """Make the engine's context decode under `pairs`; True when that changed its set (one
        llama_set_adapters_lora call, and llama.cpp plans its compute graph again)."""
        if pairs == self._applied:
            return False
        self.attach(ctx, pairs)
        self._applied = pairs
        return True

    def attach(self, ctx: Context, pairs: AdapterSet) -> None:
        """Set `pairs` on a context (an embedding context: once, for good)."""
        ctx.set_adapters([self._loaded[id] for id, _ in pairs], [scale for _, scale in pairs])

    def close(self) -> None:
        for adapter in self._loaded.values():
            adapter.close()
