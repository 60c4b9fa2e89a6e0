"""Priority scheduling: admission by aged priority, preemption of worse-ranked sequences, and a
preempted sequence resuming with exactly the output it would have had."""

import time

import pytest

from llamabatch import SamplingParams
from llamabatch.engine.memory import streams
from llamabatch.engine.scheduling import queue
from llamabatch.engine.scheduling.queue import AGING_S
from llamabatch.engine.scheduling.scheduler import Scheduler
from llamabatch.engine.sequence import Sequence, Status
from llamabatch.engine.step import Step


def seq(index: int, priority: int = 0, t: float = 0.0) -> Sequence:
    s = Sequence(index, f"p{index}", SamplingParams(), list(range(100 * index + 1, 100 * index + 5)), 4, uid=index)
    s.priority, s.t_submitted = priority, t
    return s


def test_admission_takes_the_best_priority_first_then_submission_order():
    sched = Scheduler(n_slots=2, n_batch=64)
    for s in (seq(0, priority=5, t=0.0), seq(1, priority=0, t=1.0), seq(2, priority=0, t=2.0), seq(3, priority=5, t=0.5)):
        sched.add(s)
    assert [s.index for s in sched.admit()] == [1, 2]
    assert [s.index for s in sched.waiting] == [0, 3]


def test_aging_lets_a_long_waiting_low_priority_sequence_go_before_fresh_high_priority_ones():
    sched = Scheduler(n_slots=1, n_batch=64)
    old = seq(0, priority=2, t=0.0)
    fresh = seq(1, priority=0, t=2 * AGING_S + 1.0)  # arrived after old had waited two levels' worth
    sched.add(fresh)
    sched.add(old)
    assert sched.admit() == [old]


def test_fcfs_ignores_priorities():
    sched = Scheduler(n_slots=1, n_batch=64, policy="fcfs")
    sched.add(seq(0, priority=9, t=0.0))
    sched.add(seq(1, priority=0, t=1.0))
    assert [s.index for s in sched.admit()] == [0]
    assert sched.victims() == []


def test_a_better_priority_displaces_the_worst_ranked_running_sequence():
    sched = Scheduler(n_slots=2, n_batch=64)
    low_old, low_new = seq(0, priority=3, t=0.0), seq(1, priority=3, t=1.0)
    sched.add(low_old)
    sched.add(low_new)
    sched.admit()
    urgent = seq(2, priority=0, t=2.0)
    sched.add(urgent)
    assert sched.victims() == [low_new]  # the newest of the lowest priority
    sched.preempt(low_new, kv_full=False)
    assert sched.admit() == [urgent]  # at once: a priority preemption is not a full cache
    assert low_new.status is Status.WAITING


def test_equal_priorities_never_preempt_each_other():
    sched = Scheduler(n_slots=1, n_batch=64)
    first = seq(0, t=5.0)
    sched.add(first)
    sched.admit()
    sched.add(seq(1, t=0.0))  # ranks better (older), but has the same priority
    assert sched.victims() == []


def test_an_aged_low_priority_sequence_is_not_preempted_by_a_fresh_high_one():
    sched = Scheduler(n_slots=1, n_batch=64)
    old = seq(0, priority=1, t=0.0)
    sched.add(old)
    sched.admit()
    sched.add(seq(1, priority=0, t=AGING_S + 1.0))
    assert sched.victims() == []


def _run_alone(make_engine, prompt, params, **settings):
    engine = make_engine(**settings)
    [result] = engine.generate([prompt], params)
    return result


@pytest.mark.parametrize("swap", [True, False], ids=["kv-swapped", "kv-recomputed"])
def test_a_preempted_greedy_sequence_resumes_with_the_tokens_it_gets_unpreempted(make_engine, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(streams, "SWAP_BUDGET_BYTES", 0)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = _run_alone(make_engine, "a low priority request that runs long", params, n_parallel=1)
    engine = make_engine(n_parallel=1)
    [low] = engine.add("a low priority request that runs long", params, priority=5)
    for _ in range(8):
        engine.step()
    assert low.n_generated >= 4
    [high] = engine.add("urgent", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), priority=0)
    events = list(engine.step())
    assert low.status is Status.WAITING and (low.swapped is not None) == swap
    assert high.status is Status.RUNNING and not any(e.uid == low.uid for e in events)
    for _ in engine.run():
        pass
    assert engine.stats.priority_preemptions == 1
    assert high.finish_reason == "length" and high.t_finished < low.t_finished
    if swap:  # the KV went back as it was: the very same tokens
        assert low.tokens[low.n_prompt :] == alone.token_ids
    else:  # recomputed by a multi-row prefill: the same tokens where the tiny model's near-ties hold
        assert low.finish_reason == "length" and low.n_generated == params.max_tokens
    assert engine.memory.swapped_bytes == 0


@pytest.mark.fresh_process
def test_recomputed_after_preemption_in_deterministic_mode_gives_the_same_tokens(make_engine, monkeypatch):
    """Recomputed KV (a prefill of prompt and generated tokens) equals what decoding built only
    where kernels do not depend on a batch's rows: deterministic mode."""
    monkeypatch.setattr(streams, "SWAP_BUDGET_BYTES", 0)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = _run_alone(make_engine, "a low priority request that runs long", params, n_parallel=1, deterministic=True)
    engine = make_engine(n_parallel=1, deterministic=True)
    [low] = engine.add("a low priority request that runs long", params, priority=5)
    for _ in range(8):
        engine.step()
    engine.add("urgent", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), priority=0)
    for _ in engine.run():
        pass
    assert engine.stats.priority_preemptions == 1
    assert low.tokens[low.n_prompt :] == alone.token_ids


def test_a_cancelled_swapped_sequence_gives_its_host_memory_back(make_engine):
    engine = make_engine(n_parallel=1)
    [low] = engine.add("something long enough to hold a few cells", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), priority=5)
    for _ in range(4):
        engine.step()
    engine.add("urgent", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), priority=0)
    engine.step()
    assert low.swapped is not None and engine.memory.swapped_bytes == len(low.swapped)
    engine.cancel(low)
    assert low.finish_reason == "cancelled" and engine.memory.swapped_bytes == 0


def test_a_low_priority_request_under_a_stream_of_high_priority_ones_is_served(make_engine, monkeypatch):
    """One slot, and a new priority-0 request always waiting: without aging the priority-1
    request would wait for as long as the stream lasts. Aged, it runs once it has waited AGING_S."""
    monkeypatch.setattr(queue, "AGING_S", 0.2)
    engine = make_engine(n_parallel=1)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    [low] = engine.add("low", short, priority=1)
    high = engine.add("high", short, priority=0)
    started = time.perf_counter()
    while low.finish_reason is None and time.perf_counter() - started < 30:
        if high[0].status is not Status.WAITING:  # keep one high-priority request waiting
            high = engine.add("high", short, priority=0)
        engine.step()
    assert low.finish_reason == "length"
    assert high[0].status is Status.WAITING  # the stream had not run dry: aging let low in
    assert low.t_admitted - low.t_submitted >= 0.2  # from its own submission: `started` comes after it


def test_a_better_prioritys_prompt_is_prefilled_without_worse_decoders_beside_it():
    sched = Scheduler(n_slots=3, n_batch=64)
    batch_a, batch_b = seq(0, priority=120, t=0.0), seq(1, priority=120, t=0.1)
    for s in (batch_a, batch_b):
        sched.add(s)
    decode_once(schedule_once(sched))  # both decoding now
    urgent = seq(2, priority=0, t=1.0)
    sched.add(urgent)
    step = schedule_once(sched)
    assert step.rows == [urgent]  # its prompt alone: the batch decoders wait a step
    decode_once(step)
    assert schedule_once(sched).rows == [batch_a, batch_b, urgent]  # then everyone decodes together


def schedule_once(sched: Scheduler) -> Step:
    sched.admit()
    return sched.schedule()


def decode_once(step: Step) -> None:
    """As if the step was decoded and each row sampled a token."""
    for s, n in zip(step.rows, step.chunks):
        s.advance(n)
        s.tokens.append(7)
