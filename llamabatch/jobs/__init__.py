"""The jobs wing: offline work from files (prompt files, batch jobs that stream and resume).
It imports the engine wing, openai_format and the top-level errors/catalog; never serve, measure or cli."""

from .batch_job import BatchJob, JobSummary, stop_on_signals
from .inputs import Format

__all__ = ["BatchJob", "Format", "JobSummary", "stop_on_signals"]
