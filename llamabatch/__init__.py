"""llamabatch: true batched inference for llama.cpp from Python."""

from importlib.metadata import version

from . import openmp

with openmp.short_spin():
    import llama_cpp  # noqa: F401 - first, so that libgomp loads with the short spin

from .engine import BatchEngine, Event, Result, RunStats, SamplingParams, Timings
from .errors import ConfigError, ConstraintError, DecodeError, EngineBroken, LlamabatchError, ModelError, PromptError, SamplingError

__version__ = version("llamabatch")  # one source: pyproject.toml

__all__ = [
    "BatchEngine", "ConfigError", "ConstraintError", "DecodeError", "EngineBroken", "Event", "LlamabatchError", "ModelError",
    "PromptError", "Result", "RunStats", "SamplingError", "SamplingParams", "Timings",
]
