"""Files that appear whole or not at all, and stay after a power cut: written under a temporary
name, then renamed over the final one. The rename is an entry in the folder, so the folder is
synced too: without it a crash can leave the old name, or none, though the file's bytes were synced."""

from __future__ import annotations

import os
from pathlib import Path


def replace(temporary: Path, final: Path) -> None:
    """Rename `temporary` to `final` and sync the folder that records the rename."""
    os.replace(temporary, final)
    folder = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def writer_alive(pid: int) -> bool:
    """Whether a process with this id runs (one of ours writing a temporary file, or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True
