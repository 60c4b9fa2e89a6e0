"""The `llamabatch` command line: wiring only. Each command lives in the module of its kind; the
work happens in the engine, jobs, serve and measure wings, display in display."""

from __future__ import annotations

import typer

from . import generate, jobs, measure, serving

app = typer.Typer(
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="True batched inference for llama.cpp: many sequences, one llama_decode per step.",
)
for command in (
    generate.run, jobs.batch, jobs.embed, generate.score, measure.models, measure.plan, measure.sweep, measure.tune,
    serving.serve, serving.rpc_server, measure.verify_determinism,
):
    app.command()(command)


def main() -> None:
    app()

