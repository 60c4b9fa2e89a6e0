"""One engine-options builder for every command: --ctx means the whole cache everywhere,
--ctx-per-seq a sequence's share, and an option the chosen path would ignore is an error."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llamabatch import ConfigError
from llamabatch.cli import app
from llamabatch.engine.sizing.options import EngineOptions
from llamabatch.engine.sizing.planning import current_rss


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_ctx_per_seq_is_the_cache_divided_by_the_slots(tiny_model):
    assert EngineOptions(model=tiny_model, parallel="3", ctx_per_seq=512).engine_kwargs()["n_ctx"] == 1536
    assert EngineOptions(model=tiny_model, ctx=1000).engine_kwargs()["n_ctx"] == 1000  # --ctx: in all, as given
    # without --parallel, the catalog's slots (a bare GGUF path gets the generic 4)
    assert EngineOptions(model=tiny_model, ctx_per_seq=256).engine_kwargs()["n_ctx"] == 4 * 256


@pytest.mark.parametrize("options, message", [
    (dict(memory="1GiB"), "--memory is the budget --parallel auto plans for"),
    (dict(parallel="2", memory="1GiB"), "--memory is the budget --parallel auto plans for"),
    (dict(ctx=512, ctx_per_seq=256), "not both"),
    (dict(parallel="auto", ctx=512), "give each sequence's context with --ctx-per-seq"),
    (dict(parallel="0"), "--parallel must be a number >= 1 or 'auto', got '0'"),
])
def test_options_that_would_be_ignored_or_read_two_ways_are_refused(tiny_model, options, message):
    with pytest.raises(ConfigError, match=message):
        EngineOptions(model=tiny_model, **options).engine_kwargs()


def test_parallel_auto_plans_each_sequences_context_within_the_budget(tiny_model):
    budget = str(current_rss() + 2**30)  # the budget covers this process too, which has run much of the suite
    options = EngineOptions(model=tiny_model, parallel="auto", ctx_per_seq=256, memory=budget, threads=2)
    kwargs = options.engine_kwargs(n_sequences=5)
    measured = options.stored_tuning().choose().batch_size  # engine_kwargs measured it, or found it stored
    # the measured batch size, never more slots than sequences
    assert kwargs["n_parallel"] == min(measured, 5) and kwargs["n_ctx"] == kwargs["n_parallel"] * 256


@pytest.mark.parametrize("command", [
    ["run", "-p", "hello", "--max-tokens", 2],
    ["score", "--text", "{text}"],
    ["batch", "{prompts}", "-o", "{out}", "--max-tokens", 2],
])
def test_every_command_takes_parallel_auto_and_refuses_memory_without_it(tiny_model, tmp_path, command):
    text, prompts = tmp_path / "text.txt", tmp_path / "prompts.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    prompts.write_text("hello\nworld\n")
    args = [str(a).format(text=text, prompts=prompts, out=tmp_path / "out.jsonl") for a in command]
    refused = invoke(*args, "-m", tiny_model, "--memory", "1GiB")
    assert refused.exit_code == 1 and "add --parallel auto" in refused.output
    planned = invoke(*args, "-m", tiny_model, "--parallel", "auto", "--memory", "1GiB", "--ctx-per-seq", 512)
    assert planned.exit_code == 0, planned.output


def test_ray_and_replicas_need_each_other(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    batch = invoke("batch", prompts, "-o", tmp_path / "out.jsonl", "-m", tiny_model, "--replicas", 2)
    assert batch.exit_code == 1 and "add --ray" in batch.output
    serve = invoke("serve", "-m", tiny_model, "--ray", "local")
    assert serve.exit_code == 1 and "add --replicas" in serve.output
    bad = invoke("serve", "-m", tiny_model, "--replicas", "some")
    assert bad.exit_code == 1 and "--replicas must be a number >= 1 or 'auto'" in bad.output


def test_sweep_measures_the_engines_default_kv_layout(tiny_model):
    """sweep used to default to per-sequence KV while every other command's engine is unified."""
    result = invoke("sweep", "-m", tiny_model, "--batch-sizes", 2, "--prompt-tokens", 8, "--gen-tokens", 4,
                    "--shared-prompt", "--json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.splitlines()[-1])
    assert row["n_kv"] == 8 + 2 * 4  # unified: the shared prompt is held once (llama-batched-bench -pps -kvu)
