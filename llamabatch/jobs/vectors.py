"""Embedding jobs' binary outputs. A `.parquet` output is a folder of part files (a Parquet
dataset: pyarrow, pandas, polars and DuckDB read it as one table), each written whole under a
temporary name and then renamed into place, so a killed job leaves only complete parts and a
resumed one reads their ids back. A `.npy` output is assembled from such a folder (OUTPUT.parts)
when the job ends: one row per embedded line in input order, and OUTPUT.ids.txt naming each row."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .. import durable
from ..errors import ConfigError, LlamabatchError

PART_ROWS = 2048  # rows a part holds: what a kill can cost, and the memory a job holds for them


def _arrow():
    """pyarrow and its Parquet module, imported when a Parquet (or .npy) output is written: the
    package is an extra (llamabatch[parquet]), which nothing else needs."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("Parquet and .npy outputs need pyarrow: pip install 'llamabatch[parquet]'") from None
    return pyarrow, pyarrow.parquet


class ParquetParts:
    """The output sink of an embedding job written as Parquet (the same calls as JsonlLog)."""

    def __init__(self, path: Path) -> None:
        _arrow()  # refused before the job starts, not at its first part
        self.path = path
        self._rows: list[dict] = []
        self._next_part = 0

    def _parts(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet")) if self.path.is_dir() else []

    def recorded(self, key: str) -> Iterator[tuple[str, str]]:
        """(id, request digest) of every row already written."""
        if self.path.exists() and not self.path.is_dir():
            raise LlamabatchError(f"{self.path} is a file, not a Parquet output folder: use --overwrite or another output")
        _, pq = _arrow()
        for part in self._parts():
            table = pq.ParquetFile(part).read(columns=[key, "request_digest"])
            yield from zip(table.column(key).to_pylist(), table.column("request_digest").to_pylist())

    def open(self, fresh: bool) -> None:
        if fresh and self.path.is_dir():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob("*.tmp"):  # a part a kill interrupted: its rows are not recorded
            stale.unlink()
        parts = self._parts()
        self._next_part = int(parts[-1].stem.removeprefix("part-")) + 1 if parts else 0

    def write(self, record: dict) -> None:
        self._rows.append(record)
        if len(self._rows) >= PART_ROWS:
            self._flush()

    def close(self) -> None:
        if self._rows:
            self._flush()

    def _flush(self) -> None:
        pa, pq = _arrow()
        rows, self._rows = self._rows, []
        vectors = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
        table = pa.table({
            "id": [r["id"] for r in rows],
            "line": pa.array([r["line"] for r in rows], pa.int64()),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), vectors.shape[1]),
            "prompt_tokens": pa.array([r["usage"]["prompt_tokens"] for r in rows], pa.int32()),
            "request_digest": [r["request_digest"] for r in rows],
        })
        final = self.path / f"part-{self._next_part:06d}.parquet"
        temporary = final.with_suffix(".tmp")
        pq.write_table(table, temporary)
        with temporary.open("rb") as f:
            os.fsync(f.fileno())
        durable.replace(temporary, final)
        self._next_part += 1


def write_npy(parts: Path, output: Path) -> int:
    """Assemble the rows of a Parquet output folder into `output` (float32, rows in input order)
    and OUTPUT.ids.txt, a part at a time: rows go to the file with positioned writes rather than
    through a memory map, so a million rows do not sit in this process's memory. Returns the rows."""
    pa, pq = _arrow()
    files = sorted(parts.glob("part-*.parquet"))
    if not files:
        raise LlamabatchError(f"nothing was embedded: {parts} holds no rows")
    index = pa.concat_tables([pq.ParquetFile(f).read(columns=["id", "line"]) for f in files])
    order = np.argsort(index.column("line").to_numpy(), kind="stable")
    row_of = np.empty(len(order), dtype=np.int64)  # the row each stored vector goes to: its rank by input line
    row_of[order] = np.arange(len(order))
    dim = pq.read_schema(files[0]).field("embedding").type.list_size
    with output.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (len(order), dim)})
        data = f.tell()
        f.truncate(data + len(order) * dim * 4)
        start = 0
        for part in files:
            column = pq.ParquetFile(part).read(columns=["embedding"]).column("embedding").combine_chunks()
            block = column.flatten().to_numpy().reshape(-1, dim).astype("<f4", copy=False)
            rows = row_of[start:start + len(block)]
            # Parts hold rows mostly in input order: one write per run of consecutive rows.
            for run in np.split(np.arange(len(rows)), np.flatnonzero(np.diff(rows) != 1) + 1):
                os.pwrite(f.fileno(), block[run].tobytes(), data + int(rows[run[0]]) * dim * 4)
            start += len(block)
        os.fsync(f.fileno())
    ids = index.column("id").take(pa.array(order))
    with output.with_suffix(".ids.txt").open("w") as f:
        for chunk in range(0, len(ids), PART_ROWS):
            f.writelines(f"{id_}\n" for id_ in ids.slice(chunk, PART_ROWS).to_pylist())
    return len(order)
