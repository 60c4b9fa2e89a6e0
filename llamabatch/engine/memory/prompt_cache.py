"""Prompts' memory kept after their slot goes to other work: in host RAM, and on disk across restarts.

A free slot keeps its last sequence's memory for a later prompt that starts alike (scheduling.slots)
until a prompt that keeps less of it takes the slot. Before that memory is cut, its state
(llama_state_seq_get_data: the sequence's cells in every layer) and the checkpoints that let a
recurrent, hybrid or sliding-window model go back to earlier positions are kept here; a later
prompt sharing its prefix gets them put back into its slot (llama_state_seq_set_data) instead of
prefilling it again. llama-server's --cache-ram keeps evicted prompts in the same way.

Two tiers, least recently used out first:
- RAM (--cache-ram SIZE): the bytes, in this process.
- disk (--cache-dir DIR, --cache-disk SIZE): a file per prompt, written as the prompt is kept (by a
  thread of its own, so the engine does not wait for the disk) and read back on a hit; the folder
  outlives the process.

A state is only valid where it was made, so everything that shapes it is in its key: the files
live in a folder named by a fingerprint of the model file, its LoRA adapters, the KV cache types,
flash attention and the llama.cpp build; each file repeats that fingerprint, names its tokens and
adapter set, and carries a checksum of its bytes. A file that does not read back or names another
fingerprint, and a state llama.cpp refuses, is removed with a warning: it never reaches a slot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp

from ... import durable
from ...catalog import model_fingerprint
from ...errors import ConfigError
from ..adapters import AdapterSet
from ..media import Grid, GridImage
from .streams import Checkpoint
from ..scheduling.prefix_index import PrefixIndex

log = logging.getLogger("llamabatch.prompt_cache")

# Shorter prompts are not kept: they prefill in one short chunk, and each kept prompt costs a
# copy of its state when its slot is taken.
MIN_TOKENS = 64
MAGIC = b"LLAMABATCH-PROMPT-1\n"
SUFFIX = ".prompt"
PARTIAL = ".partial"


@dataclass(eq=False)
class CachedPrompt:
    """One prompt's memory: its tokens (positions 0 .. n - 1), and where its bytes are."""

    tokens: list[int]
    adapters: AdapterSet
    positions: tuple[int, ...]  # its checkpoints' positions, ascending
    nbytes: int
    state: bytes | None = None  # in RAM: the sequence's whole state ...
    checkpoints: tuple[Checkpoint, ...] = ()  # ... and its checkpoints
    path: Path | None = None  # on disk
    written: Future | None = None  # the disk write, until it is done
    grid: Grid = ()  # its M-RoPE images: where its positions run behind its tokens (media.GridImage)

    @classmethod
    def of(cls, tokens: list[int], adapters: AdapterSet, state: bytes, checkpoints: tuple[Checkpoint, ...], grid: Grid) -> CachedPrompt:
        """A stream's snapshot (memory.Memory.snapshot), in RAM."""
        nbytes = len(state) + sum(len(cp.data) for cp in checkpoints)
        return cls(list(tokens), adapters, tuple(cp.n_tokens for cp in checkpoints), nbytes, state, checkpoints, grid=grid)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class TierStats:
    held: OrderedDict[CachedPrompt, None] = field(default_factory=OrderedDict, repr=False)  # the tier's entries, least recently used first (their states: no repr)
    hits: int = 0  # prompts restored from this tier
    evictions: int = 0  # entries pushed out for room
    bytes: int = 0

    @property
    def entries(self) -> int:
        return len(self.held)


@dataclass
class CacheStats:
    ram: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    misses: int = 0  # admitted prompts no entry gave more than their slot did
    kept: int = 0  # prompts whose memory was kept here as their slot was taken
    refused: int = 0  # entries removed as unreadable, foreign, or refused by llama.cpp


def fingerprint(model: Path, adapters: Iterable[Path], cache_type_k: str, cache_type_v: str, flash_attn: str,
                projector: Path | None = None) -> str:
    """What a state's validity depends on beyond its tokens and adapter scales (an image's
    positions are tokens named after its pixels: what the projector made of them counts too)."""
    described = {
        "llama_cpp": llama_cpp.__version__, "model": model_fingerprint(model),
        "adapters": [model_fingerprint(path) for path in adapters],  # in id order: entries name adapters by id
        "cache_type_k": cache_type_k, "cache_type_v": cache_type_v, "flash_attn": flash_attn,
    }
    if projector is not None:
        described["projector"] = model_fingerprint(projector)
    return hashlib.blake2b(json.dumps(described, sort_keys=True).encode(), digest_size=16).hexdigest()


class PromptCache:
    """The RAM and disk tiers of one engine (one model, one set of settings)."""

    def __init__(self, ram_bytes: int, fingerprint: str, disk_dir: Path | None = None, disk_bytes: int = 0) -> None:
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes if disk_dir is not None else 0
        self.fingerprint = fingerprint
        self.stats = CacheStats()
        self._ram, self._disk = self.stats.ram.held, self.stats.disk.held
        self._index: PrefixIndex[CachedPrompt] = PrefixIndex(lambda e: e.tokens, lambda e: e.adapters)
        self._by_key: dict[str, CachedPrompt] = {}
        self.folder = None if disk_dir is None else Path(disk_dir).expanduser() / fingerprint
        self._writer = None
        if self.folder is not None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"--cache-dir {disk_dir}: {e.strerror or e}") from None
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-cache")
            self._scan()

    # -- looking up -------------------------------------------------------------------------

    def candidates(self, tokens: list[int], adapters: AdapterSet) -> Iterator[tuple[int, CachedPrompt]]:
        """(shared length, entry) for the entries sharing the longest prefixes with tokens."""
        return self._index.matches(tokens, adapters)

    def holds(self, tokens: list[int], adapters: AdapterSet) -> bool:
        return _key(tokens, adapters) in self._by_key

    def load(self, entry: CachedPrompt) -> tuple[bytes, tuple[Checkpoint, ...]] | None:
        """The entry's state and checkpoints, from RAM or else from disk (then kept in RAM too,
        where it fits), counted as a hit of the tier they came from; None when its file no
        longer reads back (the entry is removed)."""
        if entry.path is not None:  # a restart reads the files' times as their last use
            self._writer.submit(os.utime, entry.path)
        if entry.state is not None:
            self._ram.move_to_end(entry)
            self.stats.ram.hits += 1
            return entry.state, entry.checkpoints
        try:
            if entry.written is not None:
                entry.written.result()
            state, checkpoints = _read(entry.path, self.fingerprint, entry)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.refuse(entry, f"{entry.path}: {e}")
            return None
        self._disk.move_to_end(entry)
        self.stats.disk.hits += 1
        entry.state, entry.checkpoints = state, checkpoints
        self._into_ram(entry)
        return state, checkpoints

    # -- keeping ----------------------------------------------------------------------------

    def keep(self, entry: CachedPrompt) -> None:
        """A new entry, its bytes in RAM: into the RAM tier, and written to the disk tier."""
        key = _key(entry.tokens, entry.adapters)
        if key in self._by_key:
            self._remove(self._by_key[key])
        self._by_key[key] = entry
        self._index.add(entry)
        self.stats.kept += 1
        if self.folder is not None and entry.nbytes <= self.disk_bytes:
            entry.path = self.folder / (key + SUFFIX)
            entry.written = self._writer.submit(_write, entry.path, self.fingerprint, entry, entry.state, entry.checkpoints)
            self._disk[entry] = None
            self.stats.disk.bytes += entry.nbytes
            self._evict(self._disk, self.stats.disk, self.disk_bytes)
        self._into_ram(entry)

    def refuse(self, entry: CachedPrompt, why: str) -> None:
        """An entry that did not read back or that llama.cpp did not take: removed, with a warning."""
        log.warning("prompt cache: removed an entry of %d tokens: %s", entry.n_tokens, why)
        self.stats.refused += 1
        self._remove(entry)

    def close(self) -> None:
        """Wait for the disk writes (the files are whole once this returns)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    # -- the tiers --------------------------------------------------------------------------

    def _into_ram(self, entry: CachedPrompt) -> None:
        if entry.nbytes > self.ram_bytes:
            self._out_of_ram(entry)
        else:
            if entry not in self._ram:
                self._ram[entry] = None
                self.stats.ram.bytes += entry.nbytes
            self._evict(self._ram, self.stats.ram, self.ram_bytes)
        self._forget_if_nowhere(entry)

    def _evict(self, tier: OrderedDict[CachedPrompt, None], stats: TierStats, budget: int) -> None:
        """The least recently used entries out of the tier until it fits its budget."""
        while stats.bytes > budget and tier:
            victim = next(iter(tier))
            stats.evictions += 1
            (self._out_of_ram if tier is self._ram else self._off_disk)(victim)
            self._forget_if_nowhere(victim)

    def _out_of_ram(self, entry: CachedPrompt) -> None:
        if entry in self._ram:
            del self._ram[entry]
            self.stats.ram.bytes -= entry.nbytes
        entry.state, entry.checkpoints = None, ()

    def _off_disk(self, entry: CachedPrompt) -> None:
        if entry in self._disk:
            del self._disk[entry]
            self.stats.disk.bytes -= entry.nbytes
            self._writer.submit(_unlink, entry.path)  # after its write: one thread does both, in order
        entry.path = entry.written = None

    def _forget_if_nowhere(self, entry: CachedPrompt) -> None:
        if entry in self._ram or entry in self._disk:
            return
        if entry in self._index:
            self._index.remove(entry)
        key = _key(entry.tokens, entry.adapters)
        if self._by_key.get(key) is entry:
            del self._by_key[key]

    def _remove(self, entry: CachedPrompt) -> None:
        self._out_of_ram(entry)
        self._off_disk(entry)
        self._forget_if_nowhere(entry)

    def _scan(self) -> None:
        """The disk tier a previous process left: each file's header is read (its bytes are
        checked when it is restored), oldest used first; what is unreadable or foreign goes."""
        found = []  # (last used, entry)
        for path in self.folder.iterdir():
            if path.suffix != SUFFIX:
                if not _being_written(path):
                    path.unlink(missing_ok=True)  # a write a process that ended did not finish
                continue
            try:
                entry = _read_header(path, self.fingerprint)
            except (OSError, ValueError) as e:
                log.warning("prompt cache: removed %s: %s", path, e)
                self.stats.refused += 1
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, entry))
        for _, entry in sorted(found, key=lambda pair: pair[0]):
            self._by_key[_key(entry.tokens, entry.adapters)] = entry
            self._index.add(entry)
            self._disk[entry] = None
            self.stats.disk.bytes += entry.nbytes
        self._evict(self._disk, self.stats.disk, self.disk_bytes)


def _key(tokens: list[int], adapters: AdapterSet) -> str:
    return hashlib.blake2b(json.dumps([list(adapters), tokens]).encode(), digest_size=16).hexdigest()


# -- the file: MAGIC, a 4-byte header length, a JSON header, the state, the checkpoints ---------

def _write(path: Path, fingerprint: str, entry: CachedPrompt, state: bytes, checkpoints: tuple[Checkpoint, ...]) -> None:
    body = hashlib.blake2b(digest_size=16)
    body.update(state)
    for cp in checkpoints:
        body.update(cp.data)
    header = json.dumps({
        "fingerprint": fingerprint, "tokens": entry.tokens, "adapters": [list(pair) for pair in entry.adapters],
        "state": len(state), "checkpoints": [[cp.n_tokens, len(cp.data)] for cp in checkpoints],
        "grid": [list(image) for image in entry.grid], "blake2b": body.hexdigest(),
    }).encode()
    partial = path.with_name(f"{path.stem}.{os.getpid()}{PARTIAL}")  # the writer's pid: another process sharing the folder leaves it be
    with open(partial, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header)
        f.write(state)
        for cp in checkpoints:
            f.write(cp.data)
    durable.replace(partial, path)  # a reader sees the whole file or none


def _being_written(path: Path) -> bool:
    """Whether `path` is a partial file a running process (this one or another sharing the
    folder) is writing: KEY.PID.partial."""
    pid = path.suffixes[-2][1:] if path.suffix == PARTIAL and len(path.suffixes) >= 2 else ""
    return pid.isdigit() and durable.writer_alive(int(pid))


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _header(f, fingerprint: str) -> dict:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a llamabatch prompt cache file")
    (size,) = struct.unpack("<I", f.read(4))
    header = json.loads(f.read(size))
    if header.get("fingerprint") != fingerprint:
        raise ValueError("made for another model or other settings")
    return header


def _read_header(path: Path, fingerprint: str) -> CachedPrompt:
    with open(path, "rb") as f:
        header = _header(f, fingerprint)
    try:
        tokens = [int(t) for t in header["tokens"]]
        adapters = tuple((int(i), float(s)) for i, s in header["adapters"])
        sizes = [int(header["state"])] + [int(n) for _, n in header["checkpoints"]]
        grid = tuple(GridImage(int(start), int(end), int(n_pos)) for start, end, n_pos in header.get("grid", []))
        entry = CachedPrompt(tokens, adapters, tuple(int(n) for n, _ in header["checkpoints"]),
                             sum(sizes), path=path, grid=grid)
    except (KeyError, TypeError) as e:
        raise ValueError(f"a damaged header ({e!r})") from None
    if path.name != _key(tokens, adapters) + SUFFIX:
        raise ValueError("its name does not match its tokens")
    return entry


def _read(path: Path, fingerprint: str, entry: CachedPrompt) -> tuple[bytes, tuple[Checkpoint, ...]]:
    with open(path, "rb") as f:
        header = _header(f, fingerprint)
        state = f.read(header["state"])
        checkpoints = tuple(Checkpoint(n, f.read(size)) for n, size in header["checkpoints"])
    body = hashlib.blake2b(state, digest_size=16)
    for cp in checkpoints:
        body.update(cp.data)
    if body.hexdigest() != header["blake2b"] or header["tokens"] != entry.tokens:
        raise ValueError("its bytes do not match their checksum")
    return state, checkpoints
