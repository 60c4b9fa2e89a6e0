"""MkDocs hooks: the pages made from the code and the results, before every build.

- docs/reference/cli.md from the Typer app (Typer's own `utils docs`), so the reference lists
  every command and option as `--help` does;
- docs/results/*.md from benchmarks/results/*.json (as `python -m benchmarks report` makes them),
  so the performance page's figures cannot drift from the results files. Both are ignored by
  git: building the site changes no tracked file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = """# Command line reference

Generated from the Typer app (`llamabatch.cli`) when the docs are built: every command, argument
and option, with the help `llamabatch COMMAND --help` prints.

"""


def on_pre_build(config, **kwargs) -> None:
    cli_reference(ROOT / "docs" / "reference" / "cli.md")
    sys.path.insert(0, str(ROOT))
    from benchmarks.report import write

    write(readme=False)  # the tracked README is `python -m benchmarks report`'s to change (a test checks it is current)


def cli_reference(path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "typer", "llamabatch.cli", "utils", "docs", "--name", "llamabatch",
                           "--output", str(path)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"typer utils docs failed: {done.stderr[-2000:]}")
    text = path.read_text().replace("\n## ", "\n### ").replace("# `llamabatch`", "## `llamabatch`", 1)
    path.write_text(HEADER + text)
