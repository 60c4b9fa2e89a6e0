"""Constrained output through every door: the server's request shapes (OpenAI, llama-server,
vLLM) with the official client, streams, batch files, and the CLI flags. Tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from llamabatch.cli import app
from llamabatch.jobs import BatchJob

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    score: int = Field(ge=0, le=9)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=30)


def test_openai_response_formats_with_the_official_client(client):
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    schema = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMA)
    parsed = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=40, response_format=Verdict)
    verdict = parsed.choices[0].message.parsed
    assert isinstance(verdict, Verdict) and 0 <= verdict.score <= 9
    anything = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0,
                                              response_format={"type": "json_object"})
    assert anything.choices[0].message.content.startswith("{")


def test_llama_server_and_vllm_fields(base):
    prompt = {"prompt": "Question: yes or no? Answer:", "max_tokens": 40}
    assert re.fullmatch("(yes|no)", post(base, "/v1/completions", {**prompt, "grammar": 'root ::= "yes" | "no"'}).json()["choices"][0]["text"])
    jsonschema.validate(json.loads(post(base, "/v1/completions", {**prompt, "json_schema": SCHEMA}).json()["choices"][0]["text"]), SCHEMA)
    vllm = {"json": SCHEMA, "regex": "[0-9]{4}", "choice": ["left", "right"], "grammar": 'root ::= "a" [bc]'}
    checks = {"json": lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None, "regex": re.compile("[0-9]{4}").fullmatch,
              "choice": lambda t: t in ("left", "right"), "grammar": re.compile("a[bc]").fullmatch}
    for kind, value in vllm.items():
        text = post(base, "/v1/completions", {**prompt, "structured_outputs": {kind: value}}).json()["choices"][0]["text"]
        assert checks[kind](text), (kind, text)
    chat = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 10,
                                               "structured_outputs": {"choice": ["left", "right"]}}).json()
    assert chat["choices"][0]["message"]["content"] in ("left", "right")


def test_streams_keep_the_constraint(client):
    chunks = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert "".join(c.choices[0].text for c in chunks) in ("alpha", "beta", "gamma")


@pytest.mark.parametrize("body, message", [
    ({"structured_outputs": {"regex": "a(b"}}, "invalid regex"),
    ({"json_schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}, "Unimplemented keys"),
    ({"grammar": 'root ::= "unterminated'}, "invalid grammar"),
    ({"response_format": {"type": "json_schema"}}, "needs a json_schema"),
    ({"grammar": 'root ::= "a"', "structured_outputs": {"regex": "a"}}, "give one constraint"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
])
def test_constraints_that_cannot_work_answer_400(base, body, message):
    reply = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


def test_openai_batch_bodies_carry_constraints(make_engine, tmp_path):
    lines = [
        {"custom_id": "s", "method": "POST", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": "Verdict?"}], "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {
            "prompt": "Left or right:", "max_tokens": 10, "structured_outputs": {"choice": ["left", "right"]}}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "structured_outputs": {"regex": "a(b"}}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = BatchJob(make_engine(n_parallel=4), tmp_path / "in.jsonl", tmp_path / "out.jsonl").run()
    assert (summary.done, summary.failed) == (2, 1)
    out = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    jsonschema.validate(json.loads(out["s"]["choices"][0]["message"]["content"]), SCHEMA)
    assert out["c"]["choices"][0]["text"] in ("left", "right")
    [error] = map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())
    assert error["response"]["status_code"] == 400 and "invalid regex" in error["error"]["message"]


def test_cli_flags_and_jsonl_fields(tiny_model, tmp_path):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "grammar.gbnf").write_text('root ::= "(" [a-z] ")"')
    common = ["run", "-m", str(tiny_model), "--ctx", "1024", "--max-tokens", "40", "--json"]
    runner = CliRunner()
    flags = {"--json-schema": [str(tmp_path / "schema.json")], "--grammar": [str(tmp_path / "grammar.gbnf")],
             "--regex": ["[xyz]{3}"], "--choice": ["up", "--choice", "down"]}
    checks = {"--json-schema": lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
              "--grammar": re.compile(r"\([a-z]\)").fullmatch, "--regex": re.compile("[xyz]{3}").fullmatch,
              "--choice": lambda t: t in ("up", "down")}
    for flag, value in flags.items():
        result = runner.invoke(app, [*common, "-p", "hello", "-p", "world", flag, *value])
        assert result.exit_code == 0, result.output
        texts = [json.loads(line)["text"] for line in result.stdout.splitlines()[:-1]]
        assert len(texts) == 2 and all(checks[flag](t) for t in texts), (flag, texts)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "choice": ["one", "two"]}) + "\n"
                                      + json.dumps({"prompt": "b", "json_schema": SCHEMA}) + "\n")
    result = runner.invoke(app, ["run", "-m", str(tiny_model), "--ctx", "1024", "--max-tokens", "40", "--json",
                                 "--prompts-file", str(tmp_path / "p.jsonl")])
    first, second = [json.loads(line)["text"] for line in result.stdout.splitlines()[:-1]]
    assert first in ("one", "two") and jsonschema.validate(json.loads(second), SCHEMA) is None
    refused = runner.invoke(app, [*common, "-p", "x", "--regex", "a(b"])
    assert refused.exit_code == 1 and "invalid regex" in refused.output


def test_the_fuzzers_schema_is_followed_at_a_temperature_past_float32(base):
    """Found by schemathesis: a schema llguidance compiles, a temperature of 8e59 and a repeat
    penalty of 4e16. It was a 200 "stop" with an empty answer, then a 400 "the constraint cannot
    be followed": the temperature overflowed float32, every weight became NaN, and the draw took a
    token the constraint had banned, which llguidance then refused. Drawn right, it is a token the
    mask allows (the row is flat at such a temperature), as greedy decoding finds one."""
    body = json.loads((Path(__file__).parent / "data" / "fuzzed_schema_overflowing_temperature.json").read_text())
    for temperature in (body["temperature"], 0):
        answer = httpx.post(f"{base}/v1/completions", json={**body, "temperature": temperature}, timeout=60)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"], choice  # max_tokens 1
