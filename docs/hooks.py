"""MkDocs hooks: the result pages are made from benchmarks/results/*.json before every build,
so the docs' figures cannot drift from the results files (`python -m benchmarks report`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def on_pre_build(config, **kwargs) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.report import write

    write()
