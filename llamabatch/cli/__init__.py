"""The `llamabatch` command line: wiring only. Each command lives in the module of its kind; the
work happens in the engine, jobs, serve and measure wings, display in display."""

from __future__ import annotations

from typing import Annotated

import typer

from . import generate, jobs, measure, serving

app = typer.Typer(
    no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
    help="True batched inference for llama.cpp: many sequences, one llama_decode per step.",
)


def _print_versions(asked: bool) -> None:
    if asked:
        print(versions())
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_versions, is_eager=True,
        help="Print llamabatch's and llama-cpp-python's versions, and the devices llama.cpp sees.")] = False,
) -> None:
    """True batched inference for llama.cpp: many sequences, one llama_decode per step."""


def versions() -> str:
    """llamabatch's version, the binding's, and the llama.cpp build and backends it loads."""
    import llama_cpp

    from .. import __version__
    from ..engine.native.backend import init_backend
    from ..engine.rpc import devices

    init_backend()
    rpc = "with" if llama_cpp.llama_supports_rpc() else "without"
    return (f"llamabatch {__version__}\nllama-cpp-python {llama_cpp.__version__} (llama.cpp {rpc} RPC)\n"
            f"devices: {'; '.join(devices())}")


for command in (
    generate.run, jobs.batch, jobs.embed, generate.score, measure.models, measure.plan, measure.sweep, measure.tune,
    serving.serve, serving.rpc_server, measure.verify_determinism,
):
    app.command()(command)


def main() -> None:
    app()

