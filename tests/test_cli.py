"""The `llamabatch` CLI, run in-process on the tiny model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llamabatch.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def json_lines(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.strip()]


def test_run_json_has_one_line_per_prompt_then_a_summary(tiny_model):
    result = invoke("run", "-m", tiny_model, "-p", "hello", "-p", "the capital of France is", "-p", "a",
                    "--max-tokens", 6, "--temperature", 0, "--ignore-eos", "--parallel", 4, "--ctx", 1024, "--json")
    assert result.exit_code == 0, result.output
    lines = json_lines(result.stdout)
    completions, summary = lines[:-1], lines[-1]["summary"]
    assert [c["index"] for c in completions] == [0, 1, 2]
    assert [c["prompt"] for c in completions] == ["hello", "the capital of France is", "a"]
    for c in completions:
        assert c["finish_reason"] == "length" and c["completion_tokens"] == 6
        assert c["prompt_tokens"] > 0 and isinstance(c["text"], str)
    assert summary["completion_tokens"] == 18
    assert summary["decode_calls"] == 6  # all three prompts share every step
    assert summary["prompt_tokens_evaluated"] == sum(c["prompt_tokens"] for c in completions)
    assert summary["wall_s"] > 0 and summary["tokens_per_s"] > 0


def test_run_with_a_draft_model_reports_its_drafts_and_keeps_the_output(tiny_model):
    """The tiny model drafting for itself: same completions as without, drafts counted in the summary."""
    args = ["run", "-m", tiny_model, "-p", "hello", "-p", "the capital of France is", "--max-tokens", 40,
            "--temperature", 0, "--ignore-eos", "--parallel", 2, "--ctx", 1024, "--json"]
    plain, drafted = invoke(*args), invoke(*args, "--draft-model", tiny_model, "--draft-max", 4)
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    texts = [[c["text"] for c in json_lines(r.stdout)[:-1]] for r in (plain, drafted)]
    assert texts[0] == texts[1]
    summary = json_lines(drafted.stdout)[-1]["summary"]
    assert summary["draft_tokens"] >= 8 and summary["draft_acceptance_rate"] > 0.9
    assert summary["tokens_per_decode"] > json_lines(plain.stdout)[-1]["summary"]["tokens_per_decode"]


def test_a_draft_model_that_does_not_exist_is_named(tiny_model, tmp_path):
    result = invoke("run", "-m", tiny_model, "-p", "hello", "--draft-model", tmp_path / "nope.gguf")
    assert result.exit_code != 0 and "GGUF file not found" in result.output and "nope.gguf" in result.output


@pytest.mark.fresh_process
def test_deterministic_run_gives_the_same_completions_at_any_parallel(tiny_model):
    prompts = ["-p", "hello", "-p", "word " * 60, "-p", "a", "-p", "the capital of France is"]
    texts = []
    for parallel in (1, 3):
        result = invoke("run", "-m", tiny_model, *prompts, "--max-tokens", 12, "--temperature", 0.8, "--seed", 3,
                        "--ignore-eos", "--parallel", parallel, "--ctx", 512 * parallel, "--deterministic", "--json")
        assert result.exit_code == 0, result.output
        texts.append([c["text"] for c in json_lines(result.stdout)[:-1]])
    assert texts[0] == texts[1]


def test_prompts_file_plain_lines(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\nthird\n")
    result = invoke("run", "-m", tiny_model, "--prompts-file", prompts, "--max-tokens", 3, "--json", "--ctx", 1024)
    assert result.exit_code == 0, result.output
    assert [c["prompt"] for c in json_lines(result.stdout)[:-1]] == ["first prompt", "second prompt", "third"]


def test_prompts_file_jsonl_with_per_prompt_sampling(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "hello", "max_tokens": 2}\n'
        '{"prompt": "world", "max_tokens": 5, "temperature": 0, "stop": ["zzz"]}\n'
    )
    result = invoke("run", "-m", tiny_model, "--prompts-file", prompts, "--ignore-eos", "--json", "--ctx", 1024)
    assert result.exit_code == 0, result.output
    assert [c["completion_tokens"] for c in json_lines(result.stdout)[:-1]] == [2, 5]


def test_plain_output_and_stream_show_each_completion(tiny_model):
    plain = invoke("run", "-m", tiny_model, "-p", "hello", "-p", "world", "--max-tokens", 4, "--ctx", 1024)
    streamed = invoke("run", "-m", tiny_model, "-p", "hello", "-p", "world", "--max-tokens", 4, "--ctx", 1024, "--stream")
    for result in (plain, streamed):
        assert result.exit_code == 0, result.output
        assert "[0] hello" in result.stdout and "[1] world" in result.stdout
        assert "decode calls" in result.stdout


def test_llama_cpp_log_shows_only_with_verbose(tiny_model):
    quiet = invoke("run", "-m", tiny_model, "-p", "hi", "--max-tokens", 2, "--ctx", 1024)
    loud = invoke("run", "-m", tiny_model, "-p", "hi", "--max-tokens", 2, "--ctx", 1024, "--verbose")
    assert quiet.exit_code == loud.exit_code == 0
    assert "llama_" not in quiet.stderr
    assert "llama_context" in loud.stderr  # llama.cpp describing the context it made


def test_a_bad_prompt_in_a_list_fails_alone_and_exits_non_zero(tiny_model):
    result = invoke("run", "-m", tiny_model, "-p", "hello", "-p", "", "-p", "world", "--max-tokens", 3,
                    "--ignore-eos", "--seed", 1, "--json", "--ctx", 1024)
    assert result.exit_code == 1
    lines = json_lines(result.stdout)
    assert [c.get("error") for c in lines[:-1]] == [None, "empty prompt", None]
    assert [c["completion_tokens"] for c in lines[:-1]] == [3, 0, 3]


def test_stream_reports_a_rejected_prompt(tiny_model):
    result = invoke("run", "-m", tiny_model, "-p", "hello", "-p", "", "--max-tokens", 3, "--ctx", 1024, "--stream")
    assert result.exit_code == 1
    assert "error: prompt 1: empty prompt" in result.stderr
    assert "[0] hello" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "no-such-model"], "unknown model 'no-such-model'"),
        (["-m", "/nonexistent/model.gguf"], "GGUF file not found"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--max-tokens", "-1"], "max_tokens must be >= 0"),
        (["--parallel", "16", "--ctx", "1024", "--no-kv-unified"], "--parallel 16 leaves 64 KV cells per sequence"),
        (["--parallel", "512", "--ctx", "1048576"], "exceeds llama.cpp's limit of 256"),
    ],
)
def test_errors_are_one_line_with_a_non_zero_exit(tiny_model, args, message):
    args = ["-m", tiny_model, *args] if "-m" not in args else args
    result = invoke("run", "-p", "hello", *args)
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and message in line
    assert "Traceback" not in result.output


def test_corrupt_gguf_and_empty_prompt_and_too_long_prompt(tiny_model, tmp_path):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(100))
    result = invoke("run", "-m", corrupt, "-p", "hi")
    assert result.exit_code == 1 and "could not load" in result.stderr
    result = invoke("run", "-m", tiny_model, "-p", "")
    assert result.exit_code == 1 and "error: prompt 0: empty prompt" in result.stderr
    result = invoke("run", "-m", tiny_model, "-p", "word " * 400, "--ctx", 512, "--parallel", 2)
    assert result.exit_code == 1 and "longer than the 512-token context of one sequence (raise --ctx)" in result.stderr
    result = invoke("run", "-m", tiny_model, "-p", "word " * 400, "--ctx", 512, "--parallel", 2, "--no-kv-unified")
    assert result.exit_code == 1 and "longer than the 256-token context of one sequence (raise --ctx or lower --parallel)" in result.stderr


def test_no_prompts_and_bad_jsonl_are_errors(tiny_model, tmp_path):
    assert "no prompts" in invoke("run", "-m", tiny_model).stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "temprature": 1}\n')
    result = invoke("run", "-m", tiny_model, "--prompts-file", bad)
    assert result.exit_code == 1 and "bad.jsonl:2: unknown field 'temprature'" in result.stderr
    bad.write_text('{"prompt": "a", "top_p": 7}\n')
    assert "bad.jsonl:1: invalid sampling parameter: top_p" in invoke("run", "-m", tiny_model, "--prompts-file", bad).stderr


def test_models_lists_the_catalog_with_metadata(tiny_model, tmp_path):
    config = tmp_path / "models.toml"
    config.write_text(f'[models.tiny]\npath = "{tiny_model}"\n[models.gone]\npath = "/nonexistent.gguf"\n')
    result = invoke("models", "--config", config, "--json")
    assert result.exit_code == 0, result.output
    tiny, gone = json_lines(result.stdout)
    assert tiny["available"] and tiny["architecture"] == "llama" and tiny["trained_ctx"] == 2048
    assert tiny["quantization"] == "all F32" and tiny["file_bytes"] == tiny_model.stat().st_size
    assert tiny["parameters"] > 0
    assert gone == {"name": "gone", "source": "/nonexistent.gguf", "available": False, "description": ""}


def test_a_long_command_prints_plain_progress_lines_outside_a_terminal(capsys):
    from llamabatch.display import Steps

    with Steps("measuring", every_s=0) as steps:
        steps.update(1, 3, "B=1")
        steps.update(3, 3, "B=4")
    with Steps("quick") as steps:  # done within every_s: silent
        steps.update(1, 1)
    assert capsys.readouterr().err.splitlines() == ["measuring: 1/3 · B=1", "measuring: 3/3 · B=4"]


def test_score_shows_each_item_then_the_summary(tiny_model, tmp_path):
    items = tmp_path / "items.jsonl"
    items.write_text('{"context": "The sky is", "continuation": " blue"}\n{"text": "one two three four five"}\n'
                     '{"context": "", "continuation": ""}\n')
    result = invoke("score", items, "-m", tiny_model)
    assert result.exit_code == 1  # the third item cannot be scored
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2"] and rows[2][-1] == "failed"
    assert all(row[-1] in ("yes", "no") and float(row[3]) > 0 for row in rows[:2])  # perplexity
    assert "perplexity" in result.stdout and "error: item 2:" in result.stderr


@pytest.mark.parametrize("command", ["run", "batch", "serve", "tune"])
def test_help_shows_flags_as_flags_and_reads_at_80_columns(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    verbose = next(line for line in lines if "--verbose" in line)
    assert "<" not in verbose  # a flag takes no value
    assert any("--kv-unified / --no-kv-unified" in line for line in lines)


def test_serve_refuses_sleep_and_pool_options_that_cannot_apply(tiny_model):
    for args, message in (
        (["--sleep-idle", "0"], "--sleep-idle must be > 0 seconds, got 0.0"),
        (["--max-loaded", "2"], "--max-loaded applies to several models"),
        (["--sleep-idle", "60", "--replicas", "2"], "--sleep-idle frees one server's model"),
    ):
        result = runner.invoke(app, ["serve", "-m", str(tiny_model), *args])
        assert result.exit_code == 1 and message in result.output, (args, result.output)
