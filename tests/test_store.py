"""The server's store keeps a layout version and refuses one it cannot read; files renamed into
place are followed by a sync of their folder."""

from __future__ import annotations

import os
import sqlite3

import pytest

from llamabatch import durable
from llamabatch.errors import LlamabatchError
from llamabatch.serve.store import MIGRATIONS, SCHEMA_VERSION, Store


def user_version(folder) -> int:
    with sqlite3.connect(folder / "llamabatch.sqlite3") as db:
        return db.execute("PRAGMA user_version").fetchone()[0]


def test_a_store_written_before_versions_keeps_its_rows_and_gets_the_current_version(tmp_path):
    upload = tmp_path / "files" / "file-old.jsonl"
    upload.parent.mkdir()
    upload.write_text("{}\n")
    with sqlite3.connect(tmp_path / "llamabatch.sqlite3") as db:  # the tables as the first releases made them
        db.executescript(MIGRATIONS[0])
        db.execute("INSERT INTO files VALUES ('file-old', 'old.jsonl', 'batch', 3, 0, ?)", (str(upload),))
    store = Store(tmp_path)
    try:
        assert store.file("file-old").filename == "old.jsonl"
    finally:
        store.close()
    assert user_version(tmp_path) == SCHEMA_VERSION


def test_a_store_from_a_newer_llamabatch_is_refused_and_left_as_it_is(tmp_path):
    Store(tmp_path).close()
    with sqlite3.connect(tmp_path / "llamabatch.sqlite3") as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(LlamabatchError, match="written by a newer llamabatch"):
        Store(tmp_path)
    assert user_version(tmp_path) == SCHEMA_VERSION + 1
    # the refusal released the folder: once the version reads, a store opens it
    with sqlite3.connect(tmp_path / "llamabatch.sqlite3") as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    Store(tmp_path).close()


def test_a_rename_into_place_syncs_the_folder(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync

    def watched(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    (tmp_path / "part.tmp").write_text("rows")
    durable.replace(tmp_path / "part.tmp", tmp_path / "part")
    assert (tmp_path / "part").read_text() == "rows"
    assert synced == [tmp_path.stat().st_ino]
