"""Scheduler logic, without a model: admission into slots, decode-first batches, chunked prefill,
prefix reuse from a slot's cache and prefix sharing between sequences."""

import pytest

from llamabatch import SamplingParams
from llamabatch.engine.scheduling.budget import AUTO_TARGET, MIN_TOKENS, PROBE_TOKENS, StepBudget, shares
from llamabatch.engine.scheduling.scheduler import Scheduler
from llamabatch.engine.sequence import Sequence, Status
from llamabatch.engine.step import Step


def seq(index: int, n_prompt: int, prefix: list[int] = ()) -> Sequence:
    """A sequence whose tokens are unique to it, after an optional shared prefix."""
    tokens = [*prefix, *range(1000 * (index + 1), 1000 * (index + 1) + n_prompt - len(prefix))]
    return Sequence(index, f"p{index}", SamplingParams(), tokens, n_prompt)


def schedule(sched: Scheduler) -> Step:
    sched.admit()
    return sched.schedule()


def chunks(step: Step) -> list[tuple[int, int]]:
    """Each row's (index, tokens it brings)."""
    return [(s.index, n) for s, n in zip(step.rows, step.chunks)]


def run_chunks(step: Step) -> None:
    """Pretend the batch was decoded and one token sampled for each sequence that was due one,
    and hand prefixes to the followers that wait for them, as the engine does."""
    for s, n in zip(step.rows, step.chunks):
        done = n == s.n_pending
        s.advance(n)
        for f in [f for f in s.followers if f.n_shared == s.n_past]:
            f.unfollow()
            f.hold(f.n_shared)
        if done:
            s.tokens.append(999)


def test_more_sequences_than_slots_wait_in_order():
    sched = Scheduler(n_slots=2, n_batch=64)
    seqs = [seq(i, 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    scheduled = schedule(sched).rows
    assert [s.index for s in scheduled] == [0, 1]
    assert [s.seq_id for s in scheduled] == [0, 1]
    assert [s.index for s in sched.waiting] == [2, 3, 4]
    assert all(s.status is Status.RUNNING for s in scheduled)


def test_released_slot_goes_to_the_next_waiting_sequence():
    sched = Scheduler(n_slots=2, n_batch=64)
    seqs = [seq(i, 3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_chunks(schedule(sched))
    sched.release(seqs[0])
    assert seqs[0].status is Status.FINISHED and seqs[0].seq_id == -1
    scheduled = schedule(sched).rows
    assert seqs[2] in scheduled and seqs[2].seq_id == 0  # the freed id


def test_generating_sequences_come_first_and_prefill_fills_the_budget_in_chunks():
    sched = Scheduler(n_slots=3, n_batch=10)
    a, b = seq(0, 4), seq(1, 30)
    sched.add(a)
    first = schedule(sched)
    assert chunks(first) == [(0, 4)]
    run_chunks(first)
    sched.add(b)
    second = schedule(sched)
    # a decodes its one new token; b's prompt takes the remaining 9 of 10 batch tokens
    assert chunks(second) == [(0, 1), (1, 9)]
    run_chunks(second)
    third = schedule(sched)
    assert chunks(third) == [(0, 1), (1, 9)]
    assert sum(third.chunks) <= 10


def test_preempted_sequence_returns_to_the_front_and_reprefills_everything():
    sched = Scheduler(n_slots=1, n_batch=64)
    a, b = seq(0, 5), seq(1, 5)
    sched.add(a)
    sched.add(b)
    run_chunks(schedule(sched))
    sched.preempt(a)
    assert list(sched.waiting) == [a, b]
    assert a.n_past == 0 and a.status is Status.WAITING
    again = schedule(sched)
    assert again.rows == [a] and again.chunks == [6]  # prompt + the token it had generated


def test_batch_must_hold_one_token_per_slot():
    with pytest.raises(ValueError, match="n_batch"):
        Scheduler(n_slots=8, n_batch=4)


def test_after_kv_full_nothing_is_admitted_until_a_sequence_finishes():
    sched = Scheduler(n_slots=3, n_batch=64)
    a, b, c = seq(0, 4), seq(1, 4), seq(2, 4)
    for s in (a, b, c):
        sched.add(s)
    run_chunks(schedule(sched))
    sched.preempt(c)  # the cache ran full
    assert schedule(sched).rows == [a, b]  # c's slot is free, but c must wait
    sched.release(a)
    assert c in schedule(sched).rows


def test_a_free_slot_keeps_its_prompt_for_a_later_one_that_starts_alike():
    sched = Scheduler(n_slots=2, n_batch=64)
    system = list(range(500, 520))
    a = seq(0, 30, prefix=system)
    sched.add(a)
    run_chunks(schedule(sched))
    sched.release(a)  # a's slot 0 now caches its 31 tokens; slot 1 is empty
    b, c = seq(1, 25, prefix=system), seq(2, 25)
    sched.add(b)
    sched.add(c)
    admitted = sched.admit()
    assert admitted == [b, c]
    assert (b.seq_id, b.n_past) == (0, 20)  # a's slot: the system prompt is reused
    assert (c.seq_id, c.n_past) == (1, 0)


def test_identical_prompt_never_reuses_its_newest_token():
    sched = Scheduler(n_slots=1, n_batch=64)
    a = seq(0, 10)
    sched.add(a)
    run_chunks(schedule(sched))
    a.hold(10)  # as if its first generated token was not decoded
    sched.release(a)
    again = Sequence(1, "p0", SamplingParams(), a.tokens[:10], 10)
    sched.add(again)
    sched.admit()
    assert again.n_past == 9  # the last prompt token is decoded again, for its logits


def test_without_a_matching_prefix_the_lowest_free_seq_id_is_taken_and_rows_follow_seq_ids():
    sched = Scheduler(n_slots=3, n_batch=64)
    a, b, c = seq(0, 12), seq(1, 12), seq(2, 12)
    for s in (a, b, c):
        sched.add(s)
    run_chunks(schedule(sched))
    sched.release(b)
    sched.release(a)  # ids 1 then 0 come free; c keeps id 2
    d = seq(3, 12)
    sched.add(d)
    batch = schedule(sched)
    assert (d.seq_id, d.n_past) == (0, 0)  # a's cache is overwritten: llama.cpp wants dense ids
    assert [s.seq_id for s in batch.rows] == [0, 2]  # rows in seq_id order, whatever the admission order


def test_sequences_sharing_a_prefix_follow_the_first_and_its_prefill_pauses_there():
    sched = Scheduler(n_slots=4, n_batch=64)
    system = list(range(500, 540))
    lead, mid, twin = seq(0, 50, prefix=system), seq(1, 45, prefix=system), None
    twin = Sequence(2, "p0", SamplingParams(), list(lead.tokens), 50)
    for s in (lead, mid, twin):
        sched.add(s)
    first = schedule(sched)
    assert first.rows == [lead] and first.chunks == [40]  # paused at the shared system prompt
    assert (mid.leader, mid.n_shared) == (lead, 40)
    assert (twin.leader, twin.n_shared) == (lead, 50)  # whole prompt: samples from lead's logits
    run_chunks(first)
    assert mid.leader is None and mid.n_past == 40 and twin.leader is lead
    second = schedule(sched)
    assert chunks(second) == [(0, 10), (1, 5)]


def test_short_common_prefixes_are_not_shared():
    sched = Scheduler(n_slots=2, n_batch=64)
    a, b = seq(0, 30, prefix=[1, 2, 3]), seq(1, 30, prefix=[1, 2, 3])
    for s in (a, b):
        sched.add(s)
    assert schedule(sched).rows == [a, b] and b.leader is None


def test_followers_of_a_preempted_leader_prefill_on_their_own():
    sched = Scheduler(n_slots=2, n_batch=64)
    a = seq(0, 20)
    b = Sequence(1, "p0", SamplingParams(), list(a.tokens) + [7, 8], 22)
    for s in (a, b):
        sched.add(s)
    sched.admit()
    assert b.leader is a
    sched.preempt(a)
    assert b.leader is None and a.followers == []
    step = schedule(sched)
    assert step.rows == [b] and step.chunks == [22]


def test_evicting_cached_prefixes_empties_every_free_slot():
    sched = Scheduler(n_slots=3, n_batch=64)
    a, b = seq(0, 8), seq(1, 8)
    for s in (a, b):
        sched.add(s)
    run_chunks(schedule(sched))
    sched.release(a)
    sched.release(b)
    assert sorted(sched.slots.evict_cached()) == [0, 1]
    assert sched.slots.evict_cached() == []


def test_the_prompt_budget_is_shared_so_that_every_prompt_progresses():
    """Half the budget equally (never more than a prompt wants, the spare passed on), the rest
    to the oldest prompt first."""
    assert shares([3000], 100) == [100]
    assert shares([3000, 3000], 100) == [75, 25]  # both progress; the older one faster
    assert shares([10, 3000, 3000], 100) == [10, 70, 20]  # a short prompt takes what it needs, its spare goes on
    assert shares([5, 5], 100) == [5, 5]
    assert shares([], 100) == []
    for wants in ([7, 300, 1, 52], [1000] * 9, [0, 40, 2]):
        given = shares(wants, 64)
        assert sum(given) <= 64 and all(0 <= g <= w for g, w in zip(given, wants))
        assert sum(given) == min(64, sum(wants)) or sum(given) >= 64 - len(wants)  # integer halves lose at most a token a prompt


def test_the_step_budget_comes_from_measured_step_costs():
    budget = StepBudget()
    assert budget.prompt_tokens(7, 505) == 505  # nothing measured: n_batch, as without a budget
    for _ in range(20):
        budget.observe(7, 0, 0.060)  # decode steps of 7 rows
    assert budget.prompt_tokens(7, 505) == PROBE_TOKENS  # a prompt token's cost unknown: a probe
    budget.observe(7, PROBE_TOKENS, 0.060 + PROBE_TOKENS * 0.0025)
    assert budget.prompt_tokens(7, 505) == 2 * PROBE_TOKENS  # growing from the last step's, at most twice
    for _ in range(40):
        budget.observe(7, 100, 0.060 + 100 * 0.0025)
    assert abs(budget.prompt_tokens(7, 505) - (AUTO_TARGET * 0.060 - 0.060) / 0.0025) <= 1  # auto: a few decode steps
    assert budget.prompt_tokens(0, 505) == 505  # no stream to keep flowing
    assert StepBudget(0.0).prompt_tokens(7, 505) == 505  # off
    fixed = StepBudget(0.070)
    fixed.decode_s, fixed.token_s = 0.060, 0.0025
    assert fixed.prompt_tokens(7, 505) == MIN_TOKENS  # the floor: a prompt always progresses
    noisy = StepBudget()
    for seconds in (0.060,) * 20 + (0.100,):  # a slow decode step, then a probe that looks cheap beside it
        noisy.observe(7, 0, seconds)
    noisy.observe(7, PROBE_TOKENS, 0.100)
    assert noisy.prompt_tokens(7, 505) <= 2 * PROBE_TOKENS  # one measurement moves the budget little


def test_two_long_prompts_are_read_together_beside_decoders_within_the_budget():
    sched = Scheduler(n_slots=4, n_batch=512, step_target=None)
    sched.budget.decode_s, sched.budget.token_s = 0.060, 0.0025  # as measured
    budget = (AUTO_TARGET * 0.060 - 0.060) / 0.0025
    a, b = seq(0, 3), seq(1, 3)
    for s in (a, b):
        sched.add(s)
    run_chunks(schedule(sched))  # both decoding
    long1, long2 = seq(2, 3000), seq(3, 3000)
    sched.add(long1)
    sched.add(long2)
    for _ in range(5):
        step = schedule(sched)
        sizes = dict(zip(step.rows, step.chunks))
        assert sizes[a] == sizes[b] == 1
        assert sizes[long1] > 0 and sizes[long2] > 0 and sizes[long1] + sizes[long2] <= budget
        assert (step.n_decoding, step.n_prompt) == (2, sizes[long1] + sizes[long2])
        run_chunks(step)
