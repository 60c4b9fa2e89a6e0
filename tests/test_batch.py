"""`llamabatch batch` on the tiny model: every input format, bodies equal to the server's answers,
resume after kill -9 and SIGINT, bad lines of every kind, and the bounded queue."""

from __future__ import annotations

import gzip
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from llamabatch import LlamabatchError, SamplingParams
from llamabatch.cli import app
from llamabatch.jobs import BatchJob

from conftest import wait_for_lines

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["hello world", "the capital of France is", "Once upon a time", "def fib(n):", "a", "the"]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(path: Path, key: str = "id") -> dict[str, dict]:
    return {line[key]: line for line in lines(path)}


def write_lines(path: Path, objects: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects))
    return path


def openai_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def differences(a, b, where: str = "") -> list[str]:
    """Where two JSON values differ; floats (log-probabilities, whose last bits change with the
    batch's composition) count as equal within 2e-3."""
    if isinstance(a, float) or isinstance(b, float):
        return [] if a == pytest.approx(b, abs=2e-3) else [f"{where}: {a} != {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llamabatch.cli", *map(str, args)], capture_output=True, text=True)


# -- formats ---------------------------------------------------------------------------


def test_plain_text_lines_get_stable_ids_and_the_engines_completions(make_engine, tmp_path):
    source = tmp_path / "prompts.txt"
    source.write_text("hello world\n\nthe capital of France is\nOnce upon a time\n")
    engine = make_engine()
    summary = BatchJob(engine, source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert (summary.total, summary.done, summary.failed, summary.skipped) == (3, 3, 0, 0)
    out = by_id(tmp_path / "out.jsonl")
    assert sorted(out) == ["line-1", "line-3", "line-4"]  # line numbers, blank lines counted
    expected = make_engine().generate(["hello world", "the capital of France is", "Once upon a time"], GREEDY)
    for id_, result in zip(["line-1", "line-3", "line-4"], expected):
        line = out[id_]
        assert line["prompt"] == result.prompt
        assert line["choices"] == [{"index": 0, "text": result.text, "finish_reason": "length", "completion_tokens": 6}]
        assert line["usage"] == {"prompt_tokens": result.prompt_tokens, "completion_tokens": 6, "total_tokens": result.prompt_tokens + 6,
                                 "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
    assert summary.completion_tokens == 18 and summary.decode_calls >= 6


def test_jsonl_ids_per_line_sampling_samples_and_stop_strings(make_engine, tmp_path):
    engine = make_engine()
    free = engine.generate(["hello world"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    stop = free[4:7]  # a stop string the greedy text is known to reach
    source = write_lines(tmp_path / "in.jsonl", [
        {"id": "short", "prompt": "hello world", "max_tokens": 2},
        {"id": "stopped", "prompt": "hello world", "max_tokens": 12, "stop": [stop]},
        {"prompt": "Once upon a time", "n": 3, "seed": 5, "temperature": 0.9},
    ])
    summary = BatchJob(engine, source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert summary.done == 3
    out = by_id(tmp_path / "out.jsonl")
    assert out["short"]["choices"][0]["completion_tokens"] == 2
    stopped = out["stopped"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == free[: free.index(stop)]
    samples = out["line-3"]["choices"]
    assert [c["index"] for c in samples] == [0, 1, 2]
    assert out["line-3"]["usage"]["completion_tokens"] == sum(c["completion_tokens"] for c in samples)


@pytest.mark.fresh_process
def test_openai_bodies_equal_the_servers_answers(make_engine, serve, tmp_path):
    """Mixed completion and chat requests, n > 1, stop strings, sampling fields, logprobs: each
    output body is what `llamabatch serve` answers for the same body (greedy, so exactly)."""
    requests = [
        openai_line("c-1", "/v1/completions", {"model": "tiny", "prompt": "hello world", "max_tokens": 7, "temperature": 0}),
        openai_line("c-2", "/v1/completions", {"prompt": ["the capital", "def fib(n):"], "n": 2, "max_tokens": 4,
                                               "temperature": 0, "ignore_eos": True}),
        openai_line("chat-1", "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": "Once upon a time"}],
                                                       "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
        openai_line("c-3", "/v1/completions", {"prompt": "a b c", "max_tokens": 9, "temperature": 0, "stop": ["e", "t"],
                                               "logprobs": 1}),
    ]
    source = write_lines(tmp_path / "in.jsonl", requests)
    # deterministic on both sides, so greedy tokens do not depend on how requests were batched
    summary = BatchJob(make_engine(n_ctx=2048, n_parallel=4, deterministic=True), source, tmp_path / "out.jsonl").run()
    assert (summary.done, summary.failed) == (4, 0)
    base = serve(engine_extra={"deterministic": True})
    out = by_id(tmp_path / "out.jsonl", key="custom_id")
    for request in requests:
        line = out[request["custom_id"]]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        served = httpx.post(base + request["url"], json=request["body"], timeout=30).json()
        ours = line["response"]["body"]
        for key in ("object", "choices", "usage"):
            assert not differences(ours[key], served[key], f"{request['custom_id']}.{key}")
        assert ours["id"].startswith("chatcmpl-" if "chat" in request["url"] else "cmpl-")


def test_gzip_input_and_standard_input(tiny_model, tmp_path):
    with gzip.open(tmp_path / "in.txt.gz", "wt") as f:
        f.write("hello world\nOnce upon a time\n")
    common = ["-m", tiny_model, "--max-tokens", "3", "--temperature", "0", "--ctx", "1024", "--json"]
    runner = CliRunner()
    zipped = runner.invoke(app, ["batch", str(tmp_path / "in.txt.gz"), "-o", str(tmp_path / "gz.jsonl"), *map(str, common)])
    assert zipped.exit_code == 0, zipped.output
    piped = runner.invoke(app, ["batch", "-", "-o", str(tmp_path / "stdin.jsonl"), *map(str, common)],
                          input="hello world\nOnce upon a time\n")
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.stdout.splitlines()[-1])["summary"]["total"] is None  # stdin is not counted first
    assert by_id(tmp_path / "gz.jsonl") == by_id(tmp_path / "stdin.jsonl")
    assert len(lines(tmp_path / "gz.jsonl")) == 2


# -- bad input -------------------------------------------------------------------------


def test_bad_lines_go_to_the_error_file_and_good_ones_complete(make_engine, tmp_path):
    good = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    source = write_lines(tmp_path / "in.jsonl", [
        openai_line("ok-1", "/v1/completions", good),
        "{not json",
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},
        openai_line("responses", "/v1/responses", {"input": "x"}),
        {**openai_line("extra", "/v1/completions", good), "priority": 1},
        openai_line("hot", "/v1/completions", {**good, "temperature": -1}),
        openai_line("typed", "/v1/completions", {**good, "max_tokens": "many"}),
        openai_line("long", "/v1/completions", {**good, "prompt": "hello " * 400}),
        openai_line("empty", "/v1/completions", {**good, "prompt": ""}),
        openai_line("streamed", "/v1/completions", {**good, "stream": True}),
        openai_line("ok-2", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ])
    (tmp_path / "in.jsonl").write_bytes(source.read_bytes() + b"\xff\xfe\x00garbage\n")
    summary = BatchJob(make_engine(n_ctx=1024, n_parallel=4), source, tmp_path / "out.jsonl").run()
    assert (summary.done, summary.failed) == (2, 10)
    assert sorted(by_id(tmp_path / "out.jsonl", "custom_id")) == ["ok-1", "ok-2"]
    errors = by_id(tmp_path / "out.jsonl.errors.jsonl", "custom_id")
    assert sorted(errors) == sorted(["line-2", "no-body", "responses", "extra", "hot", "typed", "long", "empty", "streamed", "line-12"])
    messages = {id_: e["error"]["message"] for id_, e in errors.items()}
    assert "not valid JSON" in messages["line-2"] and "not UTF-8" in messages["line-12"]
    assert "body must be a JSON object" in messages["no-body"]
    assert "unsupported url '/v1/responses'" in messages["responses"]
    assert "unknown fields ['priority']" in messages["extra"]
    assert "temperature: Input should be greater than or equal to 0" in messages["hot"]
    assert messages["typed"].startswith("max_tokens:")
    assert "longer than the 1024-token context" in messages["long"]
    assert "prompt: String should have at least 1 character" in messages["empty"] and "stream" in messages["streamed"]
    # A request the server would answer 400 carries that answer; a line that is no request does not.
    assert errors["hot"]["response"]["status_code"] == 400
    assert errors["hot"]["response"]["body"]["error"]["message"] == messages["hot"]
    assert errors["line-2"]["response"] is None and errors["line-2"]["error"]["line"] == 2


def test_jsonl_bad_fields_fail_their_line_only(make_engine, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "hello", "max_tokens": 2},
        {"id": "b", "prompt": "hello", "colour": "red"},
        {"id": "c", "prompt": "hello", "top_p": 7},
        {"id": "d", "text": "no prompt field"},
        {"id": "e", "prompt": "world", "max_tokens": 2},
    ])
    summary = BatchJob(make_engine(), source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert (summary.done, summary.failed) == (2, 3)
    errors = {e["id"]: e["error"]["message"] for e in lines(tmp_path / "out.jsonl.errors.jsonl")}
    assert "unknown field 'colour'" in errors["b"] and "top_p must be in (0, 1]" in errors["c"]
    assert "string 'prompt'" in errors["d"]


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"\n\n  \n", "is empty"),
    (b"\xff\xd8\xff\xe0 binary\n", "not text"),
    (b'{"id": "x", "prompt": "a"}\n{"id": "y", "prompt": "b"}\n{"id": "x", "prompt": "c"}\n', "duplicate id 'x' on lines 1 and 3"),
    (b'{"custom_id": "r", "body": {}}\n{"custom_id": "r", "body": {}}\n', "duplicate id 'r' on lines 1 and 2"),
    (b'{"prompt": "first"\n', "looks like JSON but is not"),
])
def test_inputs_that_stop_the_job_before_any_work(make_engine, tmp_path, content, message):
    source = tmp_path / "in.jsonl"
    source.write_bytes(content)
    with pytest.raises(LlamabatchError, match=message):
        BatchJob(make_engine(), source, tmp_path / "out.jsonl").run()
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_sampling_flags_are_refused_for_openai_bodies_and_output_must_not_be_the_input(make_engine, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [openai_line("a", "/v1/completions", {"prompt": "x"})])
    with pytest.raises(LlamabatchError, match="carry their own"):
        BatchJob(make_engine(), source, tmp_path / "out.jsonl", base=GREEDY)
    with pytest.raises(LlamabatchError, match="would overwrite the input"):
        BatchJob(make_engine(), source, source)


# -- resume ------------------------------------------------------------------------------


@pytest.mark.fresh_process
def test_a_rerun_skips_what_is_done_and_cuts_a_torn_last_line(make_engine, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{p} {i}\n" for i, p in enumerate(PROMPTS * 5)))
    engine = make_engine(deterministic=True)  # the resumed run's batches differ: greedy text is equal only here
    BatchJob(engine, source, tmp_path / "full.jsonl", base=GREEDY).run()
    full = by_id(tmp_path / "full.jsonl")
    # A killed writer: ten whole lines, then half of the eleventh.
    written = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_text("".join(written[:10]) + written[10][:25])
    (tmp_path / "out.jsonl.manifest.json").write_text((tmp_path / "full.jsonl.manifest.json").read_text())
    summary = BatchJob(engine, source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert (summary.skipped, summary.done) == (10, 20)
    assert Counter(line["id"] for line in lines(tmp_path / "out.jsonl")) == Counter(list(full))  # each id once
    assert by_id(tmp_path / "out.jsonl") == full  # greedy: the same text as the uninterrupted run
    again = BatchJob(engine, source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert (again.skipped, again.done, again.decode_calls) == (30, 0, 0)


def test_resume_refuses_another_jobs_output_and_overwrite_starts_afresh(make_engine, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("hello\nworld\n")
    engine = make_engine()
    BatchJob(engine, source, tmp_path / "out.jsonl", base=GREEDY).run()
    with pytest.raises(LlamabatchError, match=r"different job \(max_tokens 6 -> 9\)"):
        BatchJob(engine, source, tmp_path / "out.jsonl", base=SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)).run()
    (tmp_path / "out.jsonl").write_text('{"id": "line-1"}\nthis is not a line llamabatch wrote\n{"id": "line-2"}\n')
    with pytest.raises(LlamabatchError, match="out.jsonl:2 is not a JSON line"):
        BatchJob(engine, source, tmp_path / "out.jsonl", base=GREEDY).run()
    summary = BatchJob(engine, source, tmp_path / "out.jsonl", base=SamplingParams(max_tokens=9), overwrite=True).run()
    assert summary.done == 2 and all(line["usage"]["completion_tokens"] <= 9 for line in lines(tmp_path / "out.jsonl"))


def test_resume_is_keyed_on_the_requests_not_the_file_name(tiny_model, tmp_path):
    """`batch a.txt -o out` then `batch b.txt -o out` used to skip every line-N of b and exit 0."""
    a, b, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out.jsonl"
    a.write_text("hello\nworld\nthe capital of France is\n")
    b.write_text("one\ntwo\nthree\n")
    args = ["-m", tiny_model, "--max-tokens", 3, "--temperature", 0, "--ctx", 1024]
    assert CliRunner().invoke(app, ["batch", str(a), "-o", str(out), *map(str, args)]).exit_code == 0
    before = out.read_text()
    refused = CliRunner().invoke(app, ["batch", str(b), "-o", str(out), *map(str, args)])
    assert refused.exit_code == 1 and "line 1 of" in refused.output and "is not the request" in refused.output
    assert out.read_text() == before  # nothing written, nothing cut
    a.write_text("hello\nworld\nthe capital of Italy is\n")  # line 3 edited since it was answered
    edited = CliRunner().invoke(app, ["batch", str(a), "-o", str(out), *map(str, args)])
    assert edited.exit_code == 1 and "line 3 of" in edited.output
    a.write_text("hello\nworld\n")  # line 3 gone: its answer would be another job's
    shorter = CliRunner().invoke(app, ["batch", str(a), "-o", str(out), *map(str, args)])
    assert shorter.exit_code == 1 and "answers 1 requests that" in shorter.output and "line-3" in shorter.output
    a.write_text("hello\nworld\nthe capital of France is\nand a fourth\n")  # the same requests, and one more
    grown = CliRunner().invoke(app, ["batch", str(a), "-o", str(out), *map(str, args), "--json"])
    assert grown.exit_code == 0 and json.loads(grown.stdout)["summary"]["skipped"] == 3
    chat = CliRunner().invoke(app, ["batch", str(a), "-o", str(out), *map(str, args), "--chat"])
    assert chat.exit_code == 1 and "chat False -> True" in chat.output  # templated and raw answers never mix
    fresh = CliRunner().invoke(app, ["batch", str(b), "-o", str(out), *map(str, args), "--overwrite"])
    assert fresh.exit_code == 0 and sorted(by_id(out)) == ["line-1", "line-2", "line-3"]


def test_every_line_records_its_requests_digest_and_stdin_is_checked_as_read(make_engine, tmp_path, monkeypatch):
    from llamabatch.jobs.inputs import request_digest

    source = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hello"}, {"id": "b", "prompt": ""}])
    BatchJob(make_engine(), source, tmp_path / "out.jsonl", base=GREEDY).run()
    wrote = {**by_id(tmp_path / "out.jsonl"), **by_id(tmp_path / "out.jsonl.errors.jsonl")}
    texts = source.read_text().splitlines()
    assert {k: v["request_digest"] for k, v in wrote.items()} == {"a": request_digest(texts[0]), "b": request_digest(texts[1])}
    changed = write_lines(tmp_path / "changed.jsonl", [{"id": "a", "prompt": "hello there"}])
    with changed.open() as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        with pytest.raises(LlamabatchError, match=r"line 1 of - \('a'\) is not the request"):
            BatchJob(make_engine(), "-", tmp_path / "out.jsonl", base=GREEDY).run()


def test_an_output_written_without_request_digests_is_not_resumed(make_engine, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("hello\nworld\n")
    BatchJob(make_engine(), source, tmp_path / "out.jsonl", base=GREEDY).run()
    old = [{k: v for k, v in line.items() if k != "request_digest"} for line in lines(tmp_path / "out.jsonl")]
    write_lines(tmp_path / "out.jsonl", old[:1])  # as an earlier llamabatch wrote it
    with pytest.raises(LlamabatchError, match="records no request"):
        BatchJob(make_engine(), source, tmp_path / "out.jsonl", base=GREEDY).run()


def test_failed_ids_are_skipped_unless_retried(make_engine, tmp_path):
    source = write_lines(tmp_path / "in.jsonl", [{"id": "fits", "prompt": "hello"}, {"id": "long", "prompt": "hello " * 300}])
    small = make_engine(n_ctx=1024, n_parallel=4)  # 256 tokens a sequence
    first = BatchJob(small, source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert (first.done, first.failed) == (1, 1)
    second = BatchJob(small, source, tmp_path / "out.jsonl", base=GREEDY).run()
    assert (second.skipped, second.done, second.failed) == (2, 0, 0)
    large = make_engine(n_ctx=8192, n_parallel=4)
    retried = BatchJob(large, source, tmp_path / "out.jsonl", base=GREEDY, retry_errors=True).run()
    assert (retried.skipped, retried.done, retried.failed) == (1, 1, 0)
    assert sorted(by_id(tmp_path / "out.jsonl")) == ["fits", "long"]
    assert (tmp_path / "out.jsonl.errors.jsonl").read_text() == ""  # the retried failure is gone


def test_only_a_window_of_requests_is_queued_at_a_time(make_engine, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("".join(f"prompt number {i}\n" for i in range(300)))
    engine = make_engine(n_parallel=4)
    job = BatchJob(engine, source, tmp_path / "out.jsonl", base=SamplingParams(temperature=0, max_tokens=3), window=8)
    most, step = 0, engine.step

    def watched_step():
        nonlocal most
        most = max(most, len(engine.scheduler.waiting) + len(engine.scheduler.running))
        return step()

    engine.step = watched_step
    summary = job.run()
    assert summary.done == 300 and most == 8
    assert summary.mean_active_sequences > 3  # yet the slots stay busy


# -- interruption (real processes) ---------------------------------------------------------


@pytest.fixture
def job_input(tmp_path) -> Path:
    source = tmp_path / "in.jsonl"
    write_lines(source, [{"id": f"req-{i}", "prompt": f"{random.Random(i).choice(PROMPTS)} {i}"} for i in range(3000)])
    return source


def batch_args(tiny_model, source: Path, output: Path, *extra) -> list:
    # deterministic mode (each run a fresh process, as it must be): a sequence's greedy tokens then do
    # not depend on its batch, so a resumed job's outputs can be compared with an uninterrupted one's exactly
    return ["batch", source, "-o", output, "-m", tiny_model, "--max-tokens", 8, "--temperature", 0, "--ignore-eos",
            "--parallel", 16, "--ctx", 4096, "--deterministic", *extra]


def test_kill_9_at_a_random_point_then_resume_gives_every_id_once(tiny_model, job_input, tmp_path):
    whole = cli(*batch_args(tiny_model, job_input, tmp_path / "whole.jsonl"))
    assert whole.returncode == 0, whole.stderr
    output = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "llamabatch.cli", *map(str, batch_args(tiny_model, job_input, output))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seed = int(os.environ.get("LLAMABATCH_KILL_SEED", random.randrange(2**32)))
    kill_after = random.Random(seed).randint(100, 2000)
    print(f"kill -9 after {kill_after} lines (LLAMABATCH_KILL_SEED={seed} repeats it)")
    wait_for_lines(output, kill_after, proc)
    proc.kill()
    proc.wait()
    killed_at = output.read_bytes().count(b"\n")
    assert killed_at < 3000, f"the job ended before the kill (seed {seed})"
    resumed = cli(*batch_args(tiny_model, job_input, output, "--json"))
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout.splitlines()[-1])["summary"]
    assert summary["skipped"] == killed_at and summary["done"] == 3000 - killed_at
    ids = Counter(line["id"] for line in lines(output))
    assert len(ids) == 3000 and set(ids.values()) == {1}
    assert by_id(output) == by_id(tmp_path / "whole.jsonl")


def test_sigint_drains_and_prints_the_resume_command_and_a_second_one_stops_at_once(tiny_model, job_input, tmp_path):
    output = tmp_path / "out.jsonl"
    args = batch_args(tiny_model, job_input, output, "--overwrite")
    proc = subprocess.Popen([sys.executable, "-m", "llamabatch.cli", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_lines(output, 200, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    hint = stderr.split("resume with: ", 1)[1].strip()
    assert "--overwrite" not in hint and "--max-tokens 8" in hint
    done_at_stop = len(lines(output))
    assert 200 <= done_at_stop < 3000  # the running sequences finished, the queue was left
    assert all(line["usage"]["completion_tokens"] == 8 for line in lines(output))  # none cut short
    resumed = subprocess.run([sys.executable, "-m", "llamabatch.cli", *shlex.split(hint)[1:], "--json"],
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert Counter(line["id"] for line in lines(output)) == Counter(f"req-{i}" for i in range(3000))

    # Two signals: running sequences are dropped; what was written stays whole.
    slow = batch_args(tiny_model, job_input, tmp_path / "slow.jsonl", "--max-tokens", 1500, "--ctx", 32768)
    proc = subprocess.Popen([sys.executable, "-m", "llamabatch.cli", *map(str, slow)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "slow.jsonl", 16, proc, timeout=120)  # the first 16 are done, the next 16 just began
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - started < 5
    written = lines(tmp_path / "slow.jsonl")
    assert len(written) < 32 and all(line["usage"]["completion_tokens"] == 1500 for line in written)


def test_an_output_no_job_wrote_is_refused_not_appended_to(tiny_model, tmp_path):
    """`run --json` wrote out.jsonl: a batch job refuses to append its lines to it (there is no
    manifest beside it), and writes it afresh with --overwrite."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nOnce upon a time\n")
    output = tmp_path / "out.jsonl"
    output.write_text('{"index": 0, "text": "from run --json"}\n')
    args = ["-m", str(tiny_model), "--max-tokens", "4", "--threads", "2"]
    refused = CliRunner().invoke(app, ["batch", str(prompts), "-o", str(output), *args])
    assert refused.exit_code != 0 and "no llamabatch job wrote it" in " ".join(refused.output.split())
    assert output.read_text() == '{"index": 0, "text": "from run --json"}\n'
    done = CliRunner().invoke(app, ["batch", str(prompts), "-o", str(output), *args, "--overwrite"])
    assert done.exit_code == 0, done.output
    assert "from run --json" not in output.read_text() and len(output.read_text().splitlines()) == 2
