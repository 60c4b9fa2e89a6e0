"""Checkpoints' bookkeeping, without a model: which checkpoint a cut goes back to, what a budget
keeps, what a copied prefix shares. (What memory does with them, on real contexts of every
family, is tests/test_families.py's.)"""

from __future__ import annotations

from llamabatch.engine.memory.streams import Checkpoint, Checkpoints


def checkpoint(n: int, size: int = 10) -> Checkpoint:
    return Checkpoint(n, bytes(size))


def positions(store: Checkpoints, seq_id: int) -> list[int]:
    return [cp.n_tokens for cp in store.kept.get(seq_id, [])]


def test_a_cut_goes_back_to_the_latest_checkpoint_before_it():
    store = Checkpoints(budget=1000)
    for n in (128, 64, 192):
        store.add(0, checkpoint(n))
    assert positions(store, 0) == [64, 128, 192]
    assert store.best(0, 191).n_tokens == 128 and store.best(0, 192).n_tokens == 192
    assert store.best(0, 63) is None and store.best(1, 500) is None
    store.drop_after(0, 130)  # the stream changed from position 130 on
    assert positions(store, 0) == [64, 128] and store.kept_bytes == 20


def test_a_transient_checkpoint_is_outside_the_budget_and_replaced_by_the_next():
    store = Checkpoints(budget=10)
    store.add(0, checkpoint(64))
    store.add(0, checkpoint(70, size=50), transient=True)
    store.add(0, checkpoint(75, size=50), transient=True)
    assert store.best(0, 80).n_tokens == 75 and store.kept_bytes == 10 and store.bytes == 60
    store.drop_after(0, 72)
    assert store.best(0, 80).n_tokens == 64


def test_over_budget_the_checkpoint_leaving_the_smallest_gap_goes_never_a_streams_newest():
    store = Checkpoints(budget=35)
    for n in (64, 128, 150, 256):
        store.add(0, checkpoint(n))
    # dropping 128 leaves a gap 64..150 (86), dropping 150 leaves 128..256 (128), 64 leaves 0..128
    assert positions(store, 0) == [64, 150, 256] and store.kept_bytes == 30
    store.add(1, checkpoint(500))
    store.add(1, checkpoint(600))
    assert positions(store, 0) == [256] and positions(store, 1) == [500, 600] and store.kept_bytes == 30


def test_with_one_checkpoint_a_stream_the_least_recently_used_streams_goes():
    store = Checkpoints(budget=20)
    store.add(0, checkpoint(64))
    store.add(1, checkpoint(64))
    store.best(0, 100)  # stream 0 was just used
    store.add(2, checkpoint(64))
    assert store.kept_bytes == 20 and positions(store, 1) == [] and positions(store, 0) == positions(store, 2) == [64]


def test_a_copied_prefix_shares_its_sources_checkpoints_counted_once():
    store = Checkpoints(budget=1000)
    for n in (64, 128, 192):
        store.add(0, checkpoint(n))
    store.inherit(0, 3, 150)
    assert positions(store, 3) == [64, 128]
    assert store.kept_bytes == 30 and store.count == 5
    store.drop(0)
    assert store.kept_bytes == 20  # stream 3 still keeps two of them
    store.drop(3)
    assert store.kept_bytes == 0 and store.count == 0


def test_a_checkpoint_larger_than_the_budget_is_not_kept():
    store = Checkpoints(budget=5)
    store.add(0, checkpoint(64, size=6))
    assert store.count == 0 and store.kept_bytes == 0
