"""Audio through a multimodal projector (libmtmd): a tiny random-weight projector of Qwen2-Audio's
kind beside the tiny text model; clips made here. A clip is read in 30-second pieces, so the
clips are 25 seconds long: a short one would be mostly the piece's silence, and the tiny model
would hardly tell two apart. Greedy tokens are checked against llama.cpp's own llama-mtmd-cli."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from llamabatch.engine import BatchEngine, MediaPrompt, SamplingParams
from conftest import native_built
from test_images import CHATML_QUOTED, MARKER, RED, mtmd_cli_reply, run_json
from tiny_model import wav, write_tiny_audio_projector, write_tiny_model, write_tiny_projector

RATE = 16_000
SECONDS = 25
NOISE = wav(np.random.default_rng(0).standard_normal(RATE * SECONDS) * 0.3)
TONE = wav(np.sin(2 * np.pi * 440 * np.arange(RATE * SECONDS) / RATE) * 0.5)


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n)


@pytest.fixture(scope="module")
def audio_projector(tmp_path_factory) -> Path:
    return write_tiny_audio_projector(tmp_path_factory.mktemp("audio") / "tiny-audio-mmproj.gguf")


@pytest.fixture(scope="module")
def image_projector(tmp_path_factory) -> Path:
    return write_tiny_projector(tmp_path_factory.mktemp("audio") / "tiny-image-mmproj.gguf")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    # seed 4: a model whose replies to the two clips differ from their first tokens
    return write_tiny_model(tmp_path_factory.mktemp("audio") / "tiny.gguf", chat_template=CHATML_QUOTED, seed=4)


@pytest.mark.skipif(not native_built("llama-mtmd-cli"), reason="llama-mtmd-cli not built (scripts/build_native.sh; CI builds it)")
def test_greedy_tokens_equal_llama_mtmd_cli(chat_model, audio_projector, tmp_path):
    """`run --chat --audio` and the engine underneath give llama-mtmd-cli's reply, byte for byte,
    for two clips and two questions decoded together."""
    cases = [("what is it", NOISE), ("and what is this", TONE)]
    files = []
    for k, (_, clip) in enumerate(cases):
        files.append(tmp_path / f"{k}.wav")
        files[-1].write_bytes(clip)
    expected = [mtmd_cli_reply(chat_model, audio_projector, path, prompt, 10, "--audio", n_ctx=4096) for (prompt, _), path in zip(cases, files)]
    with BatchEngine(chat_model, mmproj=audio_projector, n_parallel=2, n_ctx=4096, chat=True) as engine:
        seqs = engine.submit([MediaPrompt(p, (clip,)) for p, clip in cases], greedy(10))
        for _ in engine.run():
            pass
        got = [b"".join(engine.vocab.piece(t) for t in s.tokens[s.n_prompt:] if not engine.vocab.is_eog(t)) for s in seqs]
        assert engine.media_encoded == 2
    assert got == expected and expected[0] != expected[1]
    lines = run_json(chat_model, audio_projector, [p for p, _ in cases], "--audio", files, n_ctx=4096, max_tokens=10)
    assert [line["text"] for line in lines[:2]] == [e.decode(errors="replace") for e in expected]


def test_a_clip_asked_about_three_times_is_encoded_once(chat_model, audio_projector):
    with BatchEngine(chat_model, mmproj=audio_projector, n_parallel=3, n_ctx=4096, chat=True) as engine:
        counted = engine.prompt_length(MediaPrompt("what", (TONE,)))  # (from the clip's length: nothing encoded)
        assert engine.media_encoded == 0
        results = engine.generate([MediaPrompt(q, (TONE,)) for q in ("what", "why", "who")], greedy(4))
        assert engine.media_encoded == 1
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert results[0].prompt_tokens == counted
    assert all(r.prompt_tokens > 750 for r in results)  # a 30-second piece is 750 positions


def test_a_bad_clip_fails_alone_and_each_projector_refuses_what_it_cannot_read(chat_model, audio_projector, image_projector):
    """A WAV header over nothing fails its own prompt, naming the clip, beside a good clip; an
    audio projector refuses images, an image projector audio, each saying so."""
    broken = b"RIFF\x24\x00\x00\x00WAVEfmt " + b"\x00" * 16
    with BatchEngine(chat_model, mmproj=audio_projector, n_parallel=2, n_ctx=4096, chat=True) as engine:
        bad, good, image = engine.generate([MediaPrompt("what", (broken,)), MediaPrompt("what", (TONE,)), MediaPrompt("what", (RED,))], greedy(4))
    assert bad.finish_reason == "error" and "audio clip 1: not audio libmtmd can decode" in bad.error
    assert good.finish_reason == "length"
    assert image.finish_reason == "error" and "reads no images" in image.error
    with BatchEngine(chat_model, mmproj=image_projector, n_parallel=1, n_ctx=2048, chat=True) as engine:
        (clip,) = engine.generate([MediaPrompt("what", (TONE,))], greedy(4))
    assert clip.finish_reason == "error" and "reads no audio" in clip.error


@pytest.fixture(scope="module")
def audio_server(serve, chat_model, audio_projector) -> str:
    return serve(n_parallel=2, n_ctx=4096, model=chat_model, engine_extra={"mmproj": audio_projector})


def test_a_chat_with_an_input_audio_part_answers_as_the_engine_does(audio_server, chat_model, audio_projector):
    """The official client sends a text part and an input_audio part (base64 WAV): the answer is
    the engine's own for the same rendered prompt, and usage counts the clip's positions; a clip
    that is not audio is a 400 naming it."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=f"{audio_server}/v1", api_key="none")
    content = [{"type": "text", "text": "what is it"},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(TONE).decode(), "format": "wav"}}]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
    with BatchEngine(chat_model, mmproj=audio_projector, n_parallel=1, n_ctx=4096, chat=True) as engine:
        (expected,) = engine.generate([MediaPrompt("what is it\n" + MARKER, (TONE,))], greedy(8))
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    bad = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF1234WAVEnothing").decode(), "format": "wav"}}]
    answer = httpx.post(f"{audio_server}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": bad}], "max_tokens": 4})
    assert answer.status_code == 400 and "not audio libmtmd can decode" in answer.text


def test_a_responses_input_audio_part_is_read_as_the_chat_s(audio_server, chat_model, audio_projector):
    """The official client's `responses.create` with an input_audio part (OpenAI's Responses
    shape, as its chat's): the answer is the engine's own, and usage counts the clip's positions."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{audio_server}/v1", api_key="none")
    content = [{"type": "input_text", "text": "what is it"},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(TONE).decode(), "format": "wav"}}]
    reply = client.responses.create(model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=8, temperature=0)
    with BatchEngine(chat_model, mmproj=audio_projector, n_parallel=1, n_ctx=4096, chat=True) as engine:
        (expected,) = engine.generate([MediaPrompt("what is it\n" + MARKER, (TONE,))], greedy(8))
    assert reply.output_text == expected.text
    assert reply.usage.input_tokens == expected.prompt_tokens


def test_a_jsonl_job_names_its_audio_by_path(chat_model, audio_projector, tmp_path):
    """llamabatch JSON Lines with an "audio" path (relative to the file): the line answers as the
    engine does; a missing file fails its line alone, naming it."""
    from typer.testing import CliRunner

    from llamabatch.cli import app

    (tmp_path / "tone.wav").write_bytes(TONE)
    lines = [{"id": "tone", "prompt": "what is it", "audio": "tone.wav"}, {"id": "gone", "prompt": "what is it", "audio": "missing.wav"}]
    source = tmp_path / "job.jsonl"
    source.write_text("".join(json.dumps({**line, "max_tokens": 6, "temperature": 0}) + "\n" for line in lines))
    done = CliRunner().invoke(app, ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(chat_model), "--mmproj",
                                    str(audio_projector), "--chat", "--ctx", "4096", "--parallel", "2"])
    assert done.exit_code == 1, done.output  # a line failed
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    with BatchEngine(chat_model, mmproj=audio_projector, n_parallel=1, n_ctx=4096, chat=True) as engine:
        (expected,) = engine.generate([MediaPrompt("what is it", (TONE,))], greedy(6))
    assert [line["id"] for line in out] == ["tone"] and out[0]["choices"][0]["text"] == expected.text
    assert [line["id"] for line in errors] == ["gone"] and "audio file not found" in errors[0]["error"]["message"]
