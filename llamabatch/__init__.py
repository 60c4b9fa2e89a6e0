"""llamabatch: true batched inference for llama.cpp from Python."""

from .engine import BatchEngine
from .errors import ConfigError, DecodeError, LlamabatchError, ModelError, PromptError, SamplingError
from .results import Event, Result, RunStats, Timings
from .sampling import SamplingParams

__all__ = [
    "BatchEngine", "ConfigError", "DecodeError", "Event", "LlamabatchError", "ModelError",
    "PromptError", "Result", "RunStats", "SamplingError", "SamplingParams", "Timings",
]
