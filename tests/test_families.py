"""Recurrent and hybrid models (Mamba2; LFM2, Granite 4 hybrid and Qwen3.5 beside attention) through
every path that reuses or cuts part of a sequence. Their memory cannot drop a suffix, so the engine
goes back to a checkpoint of the state (or llama.cpp's rollback snapshots) instead, and every
output is the one the same request gets run alone on a fresh engine.

These families' arithmetic moves slightly with a batch's make-up (llama.cpp splits a prefilling
sequence's chunk by what decodes beside it), and random weights give near-flat logits: outside
deterministic mode a run may part from the run alone only at a near-tie (assert_same_run), as a
plain model's batched run may; in deterministic mode the tokens are equal exactly."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import llama_cpp
import pytest

from llamabatch import BatchEngine, SamplingParams
from llamabatch.engine import Sequence
from llamabatch.engine.memory.streams import Family
from llamabatch.engine.scheduling.budget import MIN_TOKENS
from llamabatch.engine.sizing.planning import KvShape, plan_for
from llamabatch.openai_format import chat_logprobs

from conftest import native_built, wait_for_lines
from tiny_model import FAMILIES, write_tiny_family, write_tiny_model

# A token may flip where the run alone had its two best tokens this close (log-probabilities):
# differences seen between batch make-ups on these models stay below 0.004.
TIE = 0.02
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
ROLLBACK = {"mamba2": False, "lfm2": True, "granitehybrid": False, "qwen35": True}  # llama.cpp's snapshots
# The tiny vocabulary spells most text a byte a token: this is 1,022 tokens.
SYSTEM = "You are a careful assistant. Answer briefly, cite the page, and never guess the capital. " * 12


def engine_on(model: Path, **settings) -> BatchEngine:
    return BatchEngine(model, **{"n_parallel": 4, "n_ctx": 8192, "n_threads": 2, **settings})


def drain(engine: BatchEngine, sequences: list[Sequence]) -> list[Sequence]:
    while engine.has_work:
        engine.step()
    for seq in sequences:
        assert seq.error is None, seq.error
    return sequences


def alone(model: Path, prompts: list[str], params: SamplingParams = GREEDY, **settings) -> list[Sequence]:
    """Each prompt run by itself on a fresh engine of one slot (nothing cached, nothing beside it)."""
    runs = []
    for prompt in prompts:
        with engine_on(model, n_parallel=1, n_ctx=4096, **settings) as engine:
            runs += drain(engine, engine.submit([prompt], params))
    return runs


def generated(seq: Sequence) -> list[int]:
    return seq.tokens[seq.n_prompt:]


def assert_same_run(got: list[int], expected: list[int], tops: list[dict], where: str = "") -> None:
    """Equal tokens, or equal up to a position where the expected run's two best tokens were a
    near-tie and `got` took the other one (tops: the expected run's alternatives per position)."""
    if got == expected:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    assert i < min(len(got), len(expected)), f"{where}: lengths differ, {len(got)} vs {len(expected)}"
    top = tops[i]
    assert got[i] in top and abs(top[expected[i]] - top[got[i]]) < TIE, (
        f"{where}: token {i} is {got[i]}, alone {expected[i]} (alternatives {top}): not a near-tie"
    )


def assert_same_runs(got: list[Sequence], expected: list[Sequence]) -> None:
    for k, (g, e) in enumerate(zip(got, expected)):
        assert_same_run(generated(g), generated(e), [dict(lp.top) for lp in e.logprobs], f"sequence {k}")


# -- what memory can do ------------------------------------------------------------------------


def test_the_engine_knows_what_each_familys_memory_can_do(family, tiny_model):
    name, model = family
    with engine_on(model, speculative="ngram") as engine:
        caps = engine.memory.caps
        assert caps.family is (Family.RECURRENT if name == "mamba2" else Family.HYBRID) and not caps.can_cut
        assert (caps.rollback > 0) is ROLLBACK[name]  # llama.cpp's snapshots where the architecture keeps them
        assert engine.scheduler.checkpoint_every == 64
    with engine_on(tiny_model) as plain:
        assert plain.memory.caps.family is Family.ATTENTION and plain.memory.caps.can_cut
        assert plain.scheduler.checkpoint_every is None  # nothing to checkpoint: any suffix can go


def test_a_refused_cut_is_never_ignored(family):
    """llama.cpp refuses to cut recurrent memory mid-sequence; the engine's truncate goes back to
    the latest checkpoint before the cut instead (or to nothing), and memory then holds exactly
    what it says, so the next decode continues from a consistent position."""
    _, model = family
    with engine_on(model, n_parallel=1) as engine:
        [seq] = drain(engine, engine.submit(["hello world " * 12], GREEDY))  # 146 tokens: checkpoints at 64, 128, 146
        slot = 0  # the one slot, which keeps the finished sequence's memory
        assert engine.memory.held(slot) == seq.n_prompt + GREEDY.max_tokens - 1  # the last token is never decoded
        assert not engine.ctx.seq_rm(slot, 100)  # llama.cpp's own answer
        assert engine.memory.truncate(slot, 100) == 64
        assert engine.memory.held(slot) == 64
        assert engine.memory.truncate(slot, 30) == 0  # no checkpoint before 30: all of it goes
        assert engine.memory.held(slot) == 0


@pytest.mark.parametrize("n_parallel, kv_unified", [(1, True), (4, True), (4, False)])
def test_the_plan_counts_states_and_checkpoints(family, n_parallel, kv_unified):
    """A state per sequence beside the attention layers' KV cache, within 5% of what llama.cpp
    allocates, and the checkpoints' budget in the total."""
    _, model = family
    n_ctx = 1024 * n_parallel
    with engine_on(model, n_parallel=n_parallel, n_ctx=n_ctx, kv_unified=kv_unified) as engine:
        shape = KvShape.of(engine.model)
        allocated = engine.ctx.kv_bytes
    assert shape.state_bytes > 0
    assert abs(shape.kv_bytes(n_ctx, n_parallel, kv_unified, 512) - allocated) <= 0.05 * allocated
    planned, _ = plan_for(model, ctx_per_seq=1024, memory=4 << 30, checkpoint_memory=256 << 20)
    assert planned.checkpoint_bytes == 256 << 20
    assert planned.total_bytes == planned.model_bytes + planned.kv_bytes + planned.compute_bytes + planned.output_bytes \
        + planned.process_bytes + (256 << 20)


# -- prefixes reused from a slot's cache ----------------------------------------------------------


def test_samples_at_one_slot_share_their_prompt_through_a_checkpoint(family):
    _, model = family
    prompt = "the capital of France is Paris, and the capital of Italy is"
    with engine_on(model, n_parallel=1) as engine:
        samples = drain(engine, engine.add(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, n=3)))
        n_prompt = samples[0].n_prompt
        # The first sample decodes the prompt and checkpoints it before its last token; the others
        # take it from there and decode that token alone.
        assert [s.n_cached for s in samples] == [0, n_prompt - 1, n_prompt - 1]
        assert engine.stats.prompt_tokens_evaluated == n_prompt + 2
    [expected] = alone(model, [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))
    assert_same_runs(samples, [expected] * 3)


@pytest.mark.parametrize("parallel", [1, 2])
def test_prompts_sharing_a_long_prefix_reuse_it_after_their_slot_is_taken(family, tiny_model, parallel):
    """Five prompts behind a 1,000-token system prompt: each one after the first takes the prefix
    from a checkpoint at most 64 tokens short of it (a plain model keeps all of it), or from
    a prompt prefilling it beside it; the outputs are the ones each gets alone."""
    _, model = family
    prompts = [f"{SYSTEM}Question {i}: which page?" for i in range(5)]
    with engine_on(model, n_parallel=parallel, n_ctx=4096 * parallel) as engine:
        got = drain(engine, engine.submit(prompts, GREEDY))
        evaluated = engine.stats.prompt_tokens_evaluated
    with engine_on(tiny_model, n_parallel=parallel, n_ctx=4096 * parallel) as plain:
        shared = plain.submit(prompts, GREEDY)
        drain(plain, shared)
    for hybrid, attention in zip(got[1:], shared[1:]):
        assert attention.n_cached >= 1000
        assert attention.n_cached - 64 <= hybrid.n_cached <= attention.n_cached
    assert evaluated <= sum(s.n_prompt for s in got) - 4 * (1000 - 64)
    assert_same_runs(got, alone(model, prompts))


def test_long_prompts_read_in_small_pieces_beside_decoders_answer_as_alone(family):
    """A step budget far below a decode step: two long prompts are read a few tokens a step,
    sharing it, beside two decoding sequences; memory that cannot be cut is checkpointed where
    chunks end, as without a budget. Each output is the one it gets alone."""
    _, model = family
    prompts = ["Once upon a time", "def fib(n):", f"{SYSTEM}Question 1: which page?", f"Notes. {SYSTEM}Question 2: which one?"]
    params = [replace(GREEDY, max_tokens=200)] * 2 + [GREEDY] * 2  # the decoders outlast the reading
    with engine_on(model, step_target=1e-6) as engine:
        decoding = engine.submit(prompts[:2], params[:2])
        for _ in range(4):
            engine.step()
        long_prompts = engine.submit(prompts[2:], params[2:])
        steps_before = engine.stats.decode_calls
        got = drain(engine, decoding + long_prompts)
        assert engine.stats.decode_calls - steps_before >= sum(s.n_prompt for s in long_prompts) // MIN_TOKENS  # a few tokens a step
        assert engine.memory.checkpoints.count > 0 or not engine.memory.checkpointing
    expected = [run for prompt, p in zip(prompts, params) for run in alone(model, [prompt], p)]
    assert_same_runs(got, expected)


def test_a_conversation_continues_from_where_its_last_turn_ended(family):
    """Turn two is turn one's prompt, its answer and more: the slot holds all of it, nothing is cut."""
    _, model = family
    with engine_on(model, n_parallel=1) as engine:
        [first] = drain(engine, engine.submit(["User: hello there\nAssistant:"], GREEDY))
        # as token ids: random weights write bytes that would not tokenize back to themselves
        turn = first.tokens + engine.vocab.tokenize("\nUser: and then?\nAssistant:", add_special=False)
        [second] = drain(engine, engine.submit([turn], GREEDY))
        assert second.n_cached == first.n_past == len(first.tokens) - 1  # every token the slot holds
    assert_same_runs([second], alone(model, [turn]))


# -- the server --------------------------------------------------------------------------------


def chat(base: str, prompt: str, max_tokens: int = 16) -> dict:
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
    })
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat_tokens(logprobs: dict) -> tuple[list[tuple], list[dict]]:
    """A chat answer's tokens, each named by its bytes (random weights write many a token that
    renders as U+FFFD), and each position's alternatives."""
    content = logprobs["content"]
    return ([tuple(t["bytes"]) for t in content],
            [{tuple(a["bytes"]): a["logprob"] for a in t["top_logprobs"]} for t in content])


def test_the_server_reuses_a_prefix_across_requests_and_in_a_burst(family, serve):
    """A second request behind the first one's system prompt: 200, and its usage says how much of
    the prompt came from the cache. Then eight at once behind the same prefix, taking it from the
    slots' caches and from each other while they prefill: every one answers, as it would alone."""
    _, model = family
    base = serve(n_parallel=4, n_ctx=4 * 2048, model=model)
    prompts = [f"{SYSTEM}Question {i}: which page?" for i in range(10)]
    first, second = chat(base, prompts[0]), chat(base, prompts[1])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000 - 64
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(lambda p: chat(base, p), prompts[2:]))
    assert any(reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1000 - 64 for reply in burst)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    for k, (reply, expected) in enumerate(zip([first, second, *burst], alone(model, prompts, params, chat=True))):
        with engine_on(model, n_parallel=1) as reference:  # spells the run alone as the server does
            theirs, tops = chat_tokens(chat_logprobs(expected.logprobs, expected, reference.vocab))
        ours, _ = chat_tokens(reply["choices"][0]["logprobs"])
        assert_same_run(ours, theirs, tops, f"request {k}")
    metrics = httpx.get(f"{base}/metrics").text
    restores = next(line for line in metrics.splitlines() if line.startswith("llamabatch_checkpoint_restores_total{"))
    assert float(restores.split()[1]) >= 1
    assert 'memory="' in metrics


# -- KV cache full, preemption ------------------------------------------------------------------


def test_a_full_kv_cache_is_recovered_from_without_cutting_anyone_short(family):
    """Eight prompts behind a shared prefix, 100 tokens each, in a cache that holds about three of
    them at once: sequences are preempted and come back, and every one gets its 100 tokens."""
    name, model = family
    if name == "mamba2":
        pytest.skip("Mamba2 has no KV cache to fill: a state per sequence, allocated up front")
    prompts = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=2)
    with engine_on(model, n_parallel=4, n_ctx=512) as engine:
        got = drain(engine, engine.submit(prompts, params))
        assert engine.stats.preemptions > 0
    assert [s.n_generated for s in got] == [100] * 8
    assert_same_runs(got, alone(model, prompts, params))


def test_a_preempted_sequence_gets_its_state_back(family):
    _, model = family
    prompts = ["hello world " * (i + 2) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    with engine_on(model, n_parallel=2) as engine:
        low = engine.submit(prompts[:2], params, priority=5)
        for _ in range(6):
            engine.step()
        high = engine.submit(prompts[2:], params, priority=0)
        drain(engine, low + high)
        assert engine.stats.priority_preemptions == 2
    assert_same_runs(low + high, alone(model, prompts, params))


# -- speculative decoding ------------------------------------------------------------------------

COPY = "the quick brown fox jumps over the lazy dog while the small cat sleeps "
SPECULATED = [f"Copy the text.\nText: {COPY * 3}\nCopy: {COPY[: 12 + 9 * i]}" for i in range(4)]


def with_and_without_drafts(model: Path, params: SamplingParams, draft_len: int, **speculation) -> tuple:
    """SPECULATED's runs without speculation, then with it (draft_len tokens a step wherever there
    are drafts, paying or not: this is about verifying them), and the speculating engine (closed,
    its counters kept)."""
    with engine_on(model, n_parallel=2) as engine:
        expected = drain(engine, engine.submit(SPECULATED, params))
    with engine_on(model, n_parallel=2, **speculation) as engine:
        engine.speculator.planner.plan = lambda n_rows, states: [draft_len] * len(states)
        got = drain(engine, engine.submit(SPECULATED, params))
    return expected, got, engine


def test_ngram_drafts_are_rolled_back_through_snapshots_or_checkpoints(family):
    """Prompt-lookup drafts, verified in the step's one decode; rejected ones are undone through
    llama.cpp's rollback snapshots (LFM2, Qwen3.5) or the checkpoint taken before the drafts
    (Mamba2, Granite), whose kept tokens are decoded again: the output is speculation's absence's."""
    name, model = family
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=2)
    expected, got, engine = with_and_without_drafts(model, params, 6, speculative="ngram")
    stats, memory = engine.stats, engine.memory
    assert stats.draft_tokens > stats.draft_accepted  # drafts rejected
    assert memory.rolled_back > 0 if ROLLBACK[name] else memory.restored > len(SPECULATED)  # beyond the prompts' reuse
    assert_same_runs(got, expected)


def test_drafts_of_a_near_copy_are_partly_accepted_and_the_rest_undone(family, tmp_path):
    """A draft model of the same family that agrees with the target often but not always: runs of
    drafts kept, then the rest rejected, in the target and in the draft context alike."""
    name, model = family
    draft = write_tiny_family(tmp_path / "draft.gguf", name, perturb=0.3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    expected, got, engine = with_and_without_drafts(model, params, 5, draft_model=draft)
    stats, memory, drafter = engine.stats, engine.memory, engine.speculator.drafter
    assert stats.draft_tokens > stats.draft_accepted > 0
    assert drafter.memory.restored > 0  # the draft context back at its checkpoint before its rejected drafts
    assert memory.rolled_back > 0 if ROLLBACK[name] else memory.restored > len(SPECULATED)
    assert_same_runs(got, expected)


@pytest.mark.parametrize("target_is_plain", [True, False])
def test_a_draft_model_of_another_family(family, tiny_model, target_is_plain):
    """A plain target drafted for by a recurrent or hybrid model, and the other way round: the draft
    context goes back to its checkpoint for every rejected draft; the output is the target's own."""
    _, model = family
    target, draft = (tiny_model, model) if target_is_plain else (model, tiny_model)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    expected, got, engine = with_and_without_drafts(target, params, 5, draft_model=draft)
    assert engine.stats.draft_tokens > 0
    if not target_is_plain:
        assert engine.speculator.drafter.memory.restored == 0  # the plain draft model cuts its cache
    else:
        assert engine.speculator.drafter.memory.restored > 0
    if target_is_plain:  # F32 llama: a row's arithmetic does not depend on its batch
        assert [generated(s) for s in got] == [generated(s) for s in expected]
    else:
        assert_same_runs(got, expected)


# -- scoring -----------------------------------------------------------------------------------


def test_scores_at_one_slot_and_in_chunks_match_scores_alone(family):
    """Items whose contexts share a prefix, at one slot (each takes the last one's checkpoint), and
    a long text in 128-token windows: the same log-likelihoods as each item scored by itself."""
    _, model = family
    items = [SYSTEM, (SYSTEM, " the first page"), (SYSTEM, " the last page")]
    with engine_on(model, n_parallel=1) as engine:
        at_one_slot = engine.score(items)
        chunked = engine.score([SYSTEM], chunk=128)
        assert engine.memory.restored > 0
    for got, item in zip(at_one_slot, items):
        with engine_on(model, n_parallel=1) as fresh:
            [expected] = fresh.score([item])
        assert got.error is None and got.n_tokens == expected.n_tokens
        assert got.logprob == pytest.approx(expected.logprob, rel=1e-4)
    with engine_on(model, n_parallel=1) as fresh:
        [expected] = fresh.score([SYSTEM], chunk=128)
    assert chunked[0].n_tokens == expected.n_tokens and chunked[0].logprob == pytest.approx(expected.logprob, rel=1e-4)


# -- deterministic mode, and one sequence's failure --------------------------------------------


@pytest.mark.fresh_process
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_deterministic_mode_with_a_prompt_prefilled_in_chunks_beside_a_decoder(family, temperature):
    """A short prompt decodes while a long one prefills in 64-token chunks: every lone decode row
    gets a filler token in a neighbouring stream, the long prompt's; the filler is taken out again
    through a checkpoint (the long prompt's state cannot lose a token), and both outputs are the
    ones they get alone, bit for bit, greedy and sampled (top-p, no top-k, a seed)."""
    _, model = family
    params = SamplingParams(temperature=temperature, top_k=0, top_p=0.95, min_p=0, seed=5, max_tokens=40, ignore_eos=True,
                            logprobs=1)
    prompts = ["hello world", "the capital of France is Paris and the quick brown fox " * 8]
    solo = alone(model, prompts, params, deterministic=True, n_batch=64)
    with engine_on(model, n_parallel=2, n_ctx=2048, deterministic=True, n_batch=64) as engine:
        short = engine.submit(prompts[:1], params)
        for _ in range(3):
            engine.step()
        both = drain(engine, short + engine.submit(prompts[1:], params))
    for got, expected in zip(both, solo):
        assert generated(got) == generated(expected)
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in expected.logprobs]


@pytest.mark.fresh_process
@pytest.mark.parametrize("name", ["llama", *FAMILIES])
@pytest.mark.parametrize("breakage", ["memory", "token"])
def test_a_sequence_that_breaks_a_decode_fails_alone(name, breakage, tmp_path):
    """llama.cpp refuses a whole batch because of one sequence: its memory made inconsistent behind
    the engine's back (another's copied over it: llama.cpp names the sequence, which fails at
    once), or a token id outside the vocabulary in its row (llama.cpp names no sequence: the
    batch is tried again in halves until it stands alone). That sequence fails with llama.cpp's
    reason; the three beside it go on exactly as they would have."""
    path = tmp_path / f"{name}.gguf"
    model = write_tiny_model(path) if name == "llama" else write_tiny_family(path, name)
    prompts = ["hello world " * (i + 1) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    solo = alone(model, prompts, params, deterministic=True)
    with engine_on(model, deterministic=True) as engine:
        sequences = engine.submit(prompts, params)
        for _ in range(8):
            engine.step()
        victim = sequences[1]
        if breakage == "memory":
            memory = llama_cpp.llama_get_memory(engine.ctx.handle)
            llama_cpp.llama_memory_seq_cp(memory, sequences[3].seq_id, victim.seq_id, -1, -1)
        else:
            victim.tokens[-1] = engine.vocab.n_vocab + 7
        while engine.has_work:
            engine.step()
        assert engine.stats.failed_decodes == (1 if breakage == "memory" else 3)  # all four, then [0, 1], then [1]
        assert engine.stats.failed_steps == 0 and engine.broken is None
    reason = "inconsistent sequence positions" if breakage == "memory" else "invalid token"
    assert victim.finish_reason == "error" and reason in victim.error, victim.error
    for seq, expected in zip(sequences, solo):
        if seq is not victim:
            assert seq.finish_reason == "length" and generated(seq) == generated(expected)


# -- batch jobs ---------------------------------------------------------------------------------


def test_a_batch_job_killed_and_resumed(family, tmp_path):
    """A job behind a shared prefix on a family model, killed mid-way (kill -9), then resumed: every
    line once, each the line the uninterrupted job wrote (deterministic mode, fresh processes)."""
    _, model = family
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"req-{i}", "prompt": f"{SYSTEM[:200]} number {i}"}) + "\n" for i in range(120)))

    def args(output: Path) -> list[str]:
        return [sys.executable, "-m", "llamabatch.cli", "batch", str(source), "-o", str(output), "-m", str(model), "--max-tokens", "6",
                "--temperature", "0", "--ignore-eos", "--parallel", "4", "--ctx", "4096", "--deterministic"]

    whole = subprocess.run(args(tmp_path / "whole.jsonl"), capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    output = tmp_path / "out.jsonl"
    proc = subprocess.Popen(args(output), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_lines(output, 30, proc, timeout=120)
    finally:
        proc.kill()
        proc.wait()
    killed_at = output.read_bytes().count(b"\n")
    assert killed_at < 120
    resumed = subprocess.run(args(output), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    lines = [json.loads(line) for line in output.read_text().splitlines() if line.strip()]
    assert sorted(line["id"] for line in lines) == sorted(f"req-{i}" for i in range(120))
    whole_lines = {line["id"]: line for line in map(json.loads, (tmp_path / "whole.jsonl").read_text().splitlines())}
    assert all("error" not in line for line in lines)
    assert all(line["choices"] == whole_lines[line["id"]]["choices"] for line in lines)


# -- llama-server, on a hybrid model -------------------------------------------------------------


@pytest.mark.skipif(not native_built("llama-server"), reason="llama-server not built (scripts/build_native.sh; CI builds it)")
def test_llama_server_and_we_agree_on_a_hybrid_model(tmp_path, serve):
    """The same two chat requests, the second behind the first one's 1,000-token prefix, to
    llama-server and to llamabatch serve on a tiny LFM2: the same greedy tokens (near-ties allowed),
    and both reuse the prefix, we from nearer (checkpoints every 64 tokens; llama-server keeps
    its own near a prompt's end)."""
    from benchmarks.servers import llama_server

    model = write_tiny_family(tmp_path / "lfm2.gguf", "lfm2")
    ours_base = serve(n_parallel=1, n_ctx=4096, model=model)
    with llama_server(model, "-np", 1, "-c", 4096, "-t", 2) as native, engine_on(model, n_parallel=1) as reference:
        for i in range(2):
            prompt = f"{SYSTEM}Question {i}: which page?"
            # llama-server renders templates its own way (Jinja drops the template's last newline): send it ours
            rendered = reference.chat_prompt([{"role": "user", "content": prompt}]).text
            theirs = httpx.post(f"{native.base}/completion", timeout=60, json={
                "prompt": rendered, "n_predict": 16, "temperature": 0, "ignore_eos": True, "return_tokens": True,
                "cache_prompt": True,
            }).json()
            ours = chat(ours_base, prompt)
            # their token ids, spelt as our chat logprobs spell tokens (bytes); a near-tie judged by our alternatives
            our_tokens, our_tops = chat_tokens(ours["choices"][0]["logprobs"])
            assert_same_run([tuple(reference.vocab.piece(t)) for t in theirs["tokens"]], our_tokens, our_tops, f"request {i}")
            assert ours["usage"]["prompt_tokens"] == theirs["tokens_evaluated"]
    cached = ours["usage"]["prompt_tokens_details"]["cached_tokens"], theirs["tokens_evaluated"] - theirs["timings"]["prompt_n"]
    assert cached[0] >= 1000 - 64 and cached[1] > 0 and cached[0] >= cached[1], cached


@pytest.mark.parametrize("kind", ["diffusion", "encoder-decoder"])
def test_a_model_llamabatch_cannot_run_is_refused_with_the_reason_on_every_path(kind, tmp_path, tiny_model):
    """A diffusion model decodes without a cache (each token alone: garbage reported as a
    success), and T5 aborts the process in llama_decode ("llama_encode must be called first"):
    both are refused where they are loaded, naming what they are (the server's /health says it:
    test_server.py)."""
    from typer.testing import CliRunner

    from llamabatch.cli import app
    from llamabatch.errors import ModelError
    from tiny_model import write_tiny_t5

    if kind == "diffusion":
        model, reason = write_tiny_model(tmp_path / "dream.gguf", diffusion=True), "dream.gguf is a diffusion model (dream)"
    else:
        model, reason = write_tiny_t5(tmp_path / "t5.gguf"), "t5.gguf has an encoder (t5)"
    with pytest.raises(ModelError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        BatchEngine(model, n_parallel=2, n_ctx=512)
    with pytest.raises(ModelError, match="has an encoder|is a diffusion model"):  # as a draft model beside a plain one
        BatchEngine(tiny_model, n_parallel=2, n_ctx=512, speculative="draft", draft_model=str(model))
    for command in (["run", "-m", str(model), "-p", "hi"], ["plan", "-m", str(model), "--memory", "1GiB"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 1 and reason in result.output, (command, result.output)


def test_sampled_decoding_on_several_threads_draws_what_one_thread_draws(family):
    """Seeded sampling (top-p, penalties, min-p) on each family: a step's rows drawn on three
    threads give the tokens one thread gives, and every sequence runs to its length."""
    from llamabatch.engine.sampling.picker import Picker

    _, model = family
    kinds = [SamplingParams(temperature=0.9, top_p=0.9, top_k=0), SamplingParams(temperature=1.1, repeat_penalty=1.2),
             SamplingParams(temperature=0.8, min_p=0.1)]
    params = [replace(kinds[i % 3], seed=i, max_tokens=12, ignore_eos=True) for i in range(8)]
    runs = []
    for n_threads in (1, 3):
        with engine_on(model, n_parallel=8) as engine:
            engine.picker.close()
            engine.picker = engine.stepper.picker = Picker(engine.grammars, engine.runtime.scratch, n_threads)
            sequences = drain(engine, engine.submit([f"{SYSTEM[:60]} {i}" for i in range(8)], params))
            runs.append([(s.tokens[s.n_prompt:], s.finish_reason) for s in sequences])
    assert runs[0] == runs[1]
    assert all(len(tokens) == 12 and reason == "length" for tokens, reason in runs[0])
