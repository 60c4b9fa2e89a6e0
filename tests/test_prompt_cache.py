"""The prompt cache: a prompt's memory kept in host RAM and on disk after its slot goes to other
work, and restored into a slot for a later prompt that shares its prefix. Every restored run is
compared with the same prompt run cold on a fresh engine."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llamabatch import BatchEngine
from llamabatch.engine.sizing.planning import plan_for
from llamabatch.engine.memory.prompt_cache import PARTIAL, SUFFIX
from llamabatch.errors import ConfigError

from test_families import GREEDY, alone, assert_same_runs, drain, engine_on

# The tiny vocabulary spells most text a byte a token: about 400 tokens.
SHARED = "Context: the archive holds letters, ledgers and maps from the old harbour office. " * 5
OTHER = "Unrelated: a recipe for bread needs flour, water, salt and patience, then an oven. " * 5


def ask(n: int) -> str:
    return SHARED + f"Question {n}: which ledger lists ship {n * 7}?"


def one_slot(model: Path, **settings) -> BatchEngine:
    """One slot: each new prompt takes the slot the last one left."""
    return engine_on(model, n_parallel=1, n_ctx=2048, **settings)


def run(engine: BatchEngine, prompts: list[str]):
    return drain(engine, engine.submit(prompts, GREEDY))


def test_a_prefix_whose_slot_was_taken_comes_back_from_ram_with_the_cold_runs_tokens(tiny_model):
    cold = alone(tiny_model, [ask(2)])
    with one_slot(tiny_model, cache_ram="256MiB") as engine:
        run(engine, [ask(1)])
        run(engine, [OTHER])  # takes the slot: ask(1)'s memory goes to RAM
        stats = engine.prompt_cache.stats
        assert stats.kept == 1 and stats.ram.entries == 1 and stats.ram.bytes > 0
        engine.reset_stats()
        [again] = run(engine, [ask(2)])
        assert stats.ram.hits == 1
        shared = len(engine.tokenize_prompt(SHARED))
        assert engine.stats.prompt_tokens_reused >= shared  # the shared prefix was not prefilled
        assert engine.stats.prompt_tokens_evaluated <= again.n_prompt - shared + 8
    assert_same_runs([again], cold)


def test_without_the_cache_the_same_prefix_is_prefilled_again(tiny_model):
    with one_slot(tiny_model) as engine:
        assert engine.prompt_cache is None
        run(engine, [ask(1)])
        run(engine, [OTHER])
        engine.reset_stats()
        run(engine, [ask(2)])
        assert engine.stats.prompt_tokens_reused == 0


def test_the_disk_tier_survives_a_restart(tiny_model, tmp_path):
    cold = alone(tiny_model, [ask(3)])
    with one_slot(tiny_model, cache_dir=tmp_path) as engine:
        run(engine, [ask(1)])
    # closed: the slot's prompt was written to the folder named by the model and settings
    [folder] = tmp_path.iterdir()
    assert len(list(folder.glob(f"*{SUFFIX}"))) == 1
    with one_slot(tiny_model, cache_dir=tmp_path) as engine:
        assert engine.prompt_cache.stats.disk.entries == 1
        [again] = run(engine, [ask(3)])
        assert engine.prompt_cache.stats.disk.hits == 1
        assert engine.stats.prompt_tokens_reused >= len(engine.tokenize_prompt(SHARED))
    assert_same_runs([again], cold)


def test_a_corrupt_file_is_removed_with_a_warning_and_the_prompt_runs_cold(tiny_model, tmp_path, caplog):
    cold = alone(tiny_model, [ask(3)])
    with one_slot(tiny_model, cache_dir=tmp_path) as engine:
        run(engine, [ask(1)])
    [path] = tmp_path.glob(f"*/*{SUFFIX}")
    data = bytearray(path.read_bytes())
    data[-100:] = bytes(100)  # the header still reads; the bytes no longer match their checksum
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="llamabatch.prompt_cache"), one_slot(tiny_model, cache_dir=tmp_path) as engine:
        [again] = run(engine, [ask(3)])
        stats = engine.prompt_cache.stats
        assert stats.refused == 1 and stats.disk.hits == 0
        assert engine.stats.prompt_tokens_reused == 0
    assert not path.exists()
    assert "checksum" in caplog.text
    assert_same_runs([again], cold)


def test_foreign_and_unreadable_files_are_removed_when_the_folder_is_read(tiny_model, tmp_path, caplog):
    with one_slot(tiny_model, cache_dir=tmp_path) as engine:
        run(engine, [ask(1)])
        folder = engine.prompt_cache.folder
    [kept] = folder.glob(f"*{SUFFIX}")
    foreign = kept.read_bytes().replace(folder.name.encode(), b"0" * len(folder.name), 1)
    (folder / f"{'1' * 32}{SUFFIX}").write_bytes(foreign)  # another model's fingerprint
    (folder / f"{'2' * 32}{SUFFIX}").write_bytes(b"not a prompt cache file")
    with caplog.at_level(logging.WARNING, logger="llamabatch.prompt_cache"), one_slot(tiny_model, cache_dir=tmp_path) as engine:
        stats = engine.prompt_cache.stats
        assert stats.refused == 2 and stats.disk.entries == 1
    assert sorted(p.name for p in folder.iterdir()) == [kept.name]
    assert "another model" in caplog.text


def test_a_partial_file_is_removed_only_when_its_writer_has_ended(tiny_model, tmp_path):
    """Two processes may share a --cache-dir: one starting leaves the other's write in progress."""
    with one_slot(tiny_model, cache_dir=tmp_path) as engine:
        run(engine, [ask(1)])
        folder = engine.prompt_cache.folder
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as writer:
        try:
            alive = folder / f"{'3' * 32}.{writer.pid}{PARTIAL}"
            dead = folder / f"{'4' * 32}.{ended.stdout.strip()}{PARTIAL}"
            for path in (alive, dead):
                path.write_bytes(b"half a state")
            with one_slot(tiny_model, cache_dir=tmp_path):
                pass
            assert alive.exists() and not dead.exists()
        finally:
            writer.kill()


def test_other_kv_settings_or_another_model_never_see_the_entries(tiny_model, tmp_path):
    """A state is only valid where it was made: other cache types, adapters or model files get
    a folder of their own."""
    with one_slot(tiny_model, cache_dir=tmp_path) as engine:
        run(engine, [ask(1)])
        first = engine.prompt_cache.folder
    with one_slot(tiny_model, cache_dir=tmp_path, cache_type_k="f32") as engine:
        assert engine.prompt_cache.folder != first and engine.prompt_cache.stats.disk.entries == 0
        run(engine, [ask(2)])
        assert engine.stats.prompt_tokens_reused == 0


def test_each_tier_keeps_within_its_budget_least_recently_used_out_first(tiny_model, tmp_path):
    with one_slot(tiny_model, cache_ram="256MiB") as probe:
        run(probe, [ask(1)])
        run(probe, [OTHER])
        entry_bytes = probe.prompt_cache.stats.ram.bytes  # what one of these prompts costs
    budget = entry_bytes * 3 // 2  # room for one
    with one_slot(tiny_model, cache_ram=budget, cache_dir=tmp_path, cache_disk=budget) as engine:
        for prompt in (ask(1), OTHER, ask(1).replace("archive", "library"), OTHER + "!"):
            run(engine, [prompt])
        stats = engine.prompt_cache.stats
        assert stats.kept == 3
        assert stats.ram.entries == 1 and stats.ram.bytes <= budget and stats.ram.evictions == 2
        assert stats.disk.entries == 1 and stats.disk.bytes <= budget and stats.disk.evictions == 2
        engine.reset_stats()
        run(engine, [ask(5)])  # ask(1)'s entry went first
        assert stats.ram.hits == 0 and engine.stats.prompt_tokens_reused == 0
    assert sum(p.stat().st_size for p in tmp_path.glob(f"*/*{SUFFIX}")) <= budget + 4096  # + the headers


def test_a_recurrent_or_hybrid_prefix_comes_back_from_its_checkpoints(family):
    """Their memory cannot be cut: what comes back is the kept state, rewound to its latest
    checkpoint within the shared prefix (taken every 64 prompt tokens)."""
    _, model = family
    cold = alone(model, [ask(2)])
    with engine_on(model, n_parallel=1, cache_ram="256MiB") as engine:
        run(engine, [ask(1)])
        run(engine, [OTHER])
        engine.reset_stats()
        [again] = run(engine, [ask(2)])
        assert engine.prompt_cache.stats.ram.hits == 1
        shared = len(engine.tokenize_prompt(SHARED))
        assert engine.stats.prompt_tokens_reused >= shared - 64
    assert_same_runs([again], cold)


def test_the_cache_needs_shared_prefixes_and_sizes_it_can_read(tiny_model):
    with pytest.raises(ConfigError, match="shared prefixes"):
        one_slot(tiny_model, cache_ram="1GiB", deterministic=True)
    with pytest.raises(ConfigError, match="--cache-ram"):
        one_slot(tiny_model, cache_ram="lots")
    with pytest.raises(ConfigError, match="--cache-disk"):
        one_slot(tiny_model, cache_dir="/tmp", cache_disk="-1GiB")


def test_the_plan_counts_the_ram_tier(tiny_model):
    without, _ = plan_for(tiny_model, ctx_per_seq=1024, memory=4 << 30)
    with_cache, _ = plan_for(tiny_model, ctx_per_seq=1024, memory=4 << 30, cache_ram=1 << 30)
    assert with_cache.prompt_cache_bytes == 1 << 30
    assert (with_cache.total_bytes - with_cache.process_bytes) - (without.total_bytes - without.process_bytes) == 1 << 30


def test_the_server_reports_each_tier_in_metrics(serve):
    base = serve(n_parallel=1, n_ctx=2048, engine_extra={"cache_ram": "256MiB"})
    for prompt in (ask(1), OTHER, ask(2)):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
    metrics = httpx.get(f"{base}/metrics").text
    assert 'llamabatch_prompt_cache_hits_total{model="tiny",tier="ram"} 1.0' in metrics
    assert 'llamabatch_prompt_cache_entries{model="tiny",tier="ram"}' in metrics
    assert 'llamabatch_prompt_cache_budget_bytes{model="tiny",tier="ram"} 2.68435456e+08' in metrics
    assert 'llamabatch_prompt_cache_kept_total{model="tiny"} 2.0' in metrics


def test_concurrent_conversations_never_get_more_of_a_cached_state_than_they_share(serve):
    """Six conversations at once over two slots and the RAM tier, each turn its conversation's
    last prompt and more, all behind one system prefix: a request's cached_tokens never exceeds
    the longest prefix its prompt shares with any prompt sent (the generated tokens cannot extend
    it: every new piece starts with a token the answers are barred from), and the cache is used."""
    from concurrent.futures import ThreadPoolExecutor

    base = serve(n_parallel=2, n_ctx=4096, engine_extra={"cache_ram": "256MiB"})
    barred = 259  # a word piece: each new piece of a prompt starts with it, no answer ever does
    system = [260 + k % 20 for k in range(80)]

    def converse(c: int) -> list[tuple[list[int], int]]:
        prompt, seen = list(system), []
        for turn in range(5):
            prompt += [barred, 262 + c, *[270 + (c * 7 + turn + k) % 19 for k in range(18)]]
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "prompt": prompt, "max_tokens": 4, "temperature": 0.8, "seed": c, "logit_bias": {str(barred): -100}})
            assert r.status_code == 200, r.text
            seen.append((list(prompt), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return seen

    with ThreadPoolExecutor(6) as pool:
        asked = [request for conversation in pool.map(converse, range(6)) for request in conversation]

    def shared(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for i, (prompt, cached) in enumerate(asked):
        bound = max(shared(prompt, other) for j, (other, _) in enumerate(asked) if j != i)
        assert cached <= bound, (i, cached, bound)
    assert sum(cached for _, cached in asked) > len(asked) * len(system) // 2  # prefixes were reused


def test_the_cli_keeps_prompts_on_disk_for_the_next_command(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from llamabatch.cli import app

    args = ["run", "--model", str(tiny_model), "--parallel", "1", "--ctx", "2048", "--temperature", "0", "--max-tokens", "4",
            "--cache-dir", str(tmp_path)]
    first = CliRunner().invoke(app, [*args, "-p", ask(1), "-p", OTHER, "--json"])
    assert first.exit_code == 0, first.output
    assert len(list(tmp_path.glob(f"*/*{SUFFIX}"))) == 2  # ask(1)'s as OTHER took the slot, OTHER's at exit
    second = CliRunner().invoke(app, [*args, "-p", ask(2), "--json"])
    assert second.exit_code == 0, second.output
    assert '"prompt_tokens_reused": ' in second.output and '"prompt_tokens_reused": 0' not in second.output
