"""The engine wing: llama.cpp handles, sequences, scheduling, sampling and the step loop.
It imports nothing of serve, jobs, measure or cli; only the top-level errors and catalog."""

from .batch_engine import BatchEngine
from .config import EngineConfig
from .infill import ExtraFile, Infill
from .intake import MediaPrompt
from .native.projector import MEDIA_MARKER
from .results import Event, Result, RunStats, Ticket, Timings, TokenLogprob
from .sampling.params import SamplingParams
from .sequence import Sequence, Status

__all__ = [
    "BatchEngine", "EngineConfig", "Event", "ExtraFile", "MEDIA_MARKER", "MediaPrompt", "Infill", "Result", "RunStats", "SamplingParams", "Sequence", "Status",
    "Ticket", "Timings", "TokenLogprob",
]
