"""Scheduler logic, without a model: admission into slots, decode-first batches, chunked prefill."""

import pytest

from llamabatch.sampling import SamplingParams
from llamabatch.scheduler import Scheduler
from llamabatch.sequence import Sequence, Status


def seq(index: int, n_prompt: int) -> Sequence:
    return Sequence(index, f"p{index}", SamplingParams(), list(range(n_prompt)), n_prompt)


def run_chunks(scheduled: list[Sequence]) -> None:
    """Pretend the batch was decoded and one token sampled for each sequence that was due one."""
    for s in scheduled:
        done = s.n_chunk == s.n_pending
        s.n_past += s.n_chunk
        if done:
            s.tokens.append(999)


def test_more_sequences_than_slots_wait_in_order():
    sched = Scheduler(n_slots=2, n_batch=64)
    seqs = [seq(i, 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    scheduled = sched.schedule()
    assert [s.index for s in scheduled] == [0, 1]
    assert [s.seq_id for s in scheduled] == [0, 1]
    assert [s.index for s in sched.waiting] == [2, 3, 4]
    assert all(s.status is Status.RUNNING for s in scheduled)


def test_released_slot_goes_to_the_next_waiting_sequence():
    sched = Scheduler(n_slots=2, n_batch=64)
    seqs = [seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_chunks(sched.schedule())
    sched.release(seqs[0])
    assert seqs[0].status is Status.FINISHED and seqs[0].seq_id == -1
    scheduled = sched.schedule()
    assert seqs[2] in scheduled and seqs[2].seq_id == 0  # the freed id


def test_generating_sequences_come_first_and_prefill_fills_the_budget_in_chunks():
    sched = Scheduler(n_slots=3, n_batch=10)
    a, b = seq(0, 4), seq(1, 30)
    sched.add(a)
    first = sched.schedule()
    assert [(s.index, s.n_chunk) for s in first] == [(0, 4)]
    run_chunks(first)
    sched.add(b)
    second = sched.schedule()
    # a decodes its one new token; b's prompt takes the remaining 9 of 10 batch tokens
    assert [(s.index, s.n_chunk) for s in second] == [(0, 1), (1, 9)]
    run_chunks(second)
    third = sched.schedule()
    assert [(s.index, s.n_chunk) for s in third] == [(0, 1), (1, 9)]
    assert sum(s.n_chunk for s in third) <= 10


def test_preempted_sequence_returns_to_the_front_and_reprefills_everything():
    sched = Scheduler(n_slots=1, n_batch=64)
    a, b = seq(0, 5), seq(1, 5)
    sched.add(a)
    sched.add(b)
    run_chunks(sched.schedule())
    sched.preempt(a)
    assert list(sched.waiting) == [a, b]
    assert a.n_past == 0 and a.status is Status.WAITING
    again = sched.schedule()
    assert again == [a] and a.n_chunk == 6  # prompt + the token it had generated


def test_batch_must_hold_one_token_per_slot():
    with pytest.raises(ValueError, match="n_batch"):
        Scheduler(n_slots=8, n_batch=4)


def test_after_kv_full_nothing_is_admitted_until_a_sequence_finishes():
    sched = Scheduler(n_slots=3, n_batch=64)
    a, b, c = seq(0, 4), seq(1, 4), seq(2, 4)
    for s in (a, b, c):
        sched.add(s)
    run_chunks(sched.schedule())
    sched.preempt(c)  # the cache ran full
    assert sched.schedule() == [a, b]  # c's slot is free, but c must wait
    sched.release(a)
    assert c in sched.schedule()
