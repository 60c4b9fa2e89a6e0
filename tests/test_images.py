"""Images through a multimodal projector (libmtmd): a tiny random-weight projector of LLaVA's kind
beside the tiny text model; small images made here. Greedy tokens are checked against
llama.cpp's own llama-mtmd-cli on the same files."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from llamabatch.engine import BatchEngine, MediaPrompt, SamplingParams, Status
from llamabatch.errors import ModelError, PromptError
from llamabatch.measure.sweep import native_tool
from conftest import native_built
from tiny_model import FAMILIES, write_tiny_family, write_tiny_model, write_tiny_projector

MARKER = "<__media__>"
MTMD_CLI_ATTEMPTS = 50


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


RED, GREEN = png((200, 10, 10)), png((10, 200, 10))


@pytest.fixture(scope="module")
def projector(tmp_path_factory) -> Path:
    return write_tiny_projector(tmp_path_factory.mktemp("mmproj") / "mmproj.gguf")


@pytest.fixture(scope="module")
def engine(tiny_model, projector):
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=8, n_ctx=2048, chat=True) as engine:
        yield engine


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_an_image_is_read_into_its_positions_and_changes_what_follows(engine):
    """The same question about two images: the image's positions count as prompt tokens, and
    the first token's log-probability differs (each image reached the text model)."""
    seqs = engine.submit([MediaPrompt("what is it", (RED,)), MediaPrompt("what is it", (GREEN,)), "what is it"],
                         greedy(2, logprobs=1))
    for _ in engine.run():
        pass
    red, green, text = seqs
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert [span.end - span.start for span in red.media] == [4]  # (28 / 14)² positions per image
    assert red.n_prompt == green.n_prompt >= text.n_prompt + 4  # the text around it may tokenize apart
    assert red.logprobs[0].logprob != green.logprobs[0].logprob


def test_a_shared_image_is_encoded_once_and_read_once(engine):
    """Eight questions about one photo: encoded once (by its pixels' hash), decoded into one
    sequence's memory once, and the rest copy that prefix as they would text."""
    photo = png((1, 2, 3))
    encoded, read = engine.media_encoded, engine.stats.media_read
    results = engine.generate([MediaPrompt(f"question {k}", (photo,)) for k in range(8)], greedy(4))
    assert all(r.error is None and r.completion_tokens == 4 for r in results)
    assert engine.media_encoded - encoded == 1
    assert engine.stats.media_read - read == 1
    assert all(r.cached_tokens > 4 for r in results[1:])  # the image's 4 positions among what each copied


def test_a_prompt_s_length_counts_its_image_without_encoding_it(engine):
    """prompt_length (a job's estimate, Anthropic's count_tokens) cuts the image as the projector
    will, and encodes nothing: the positions equal those the prompt then fills."""
    photo, prompt = png((7, 8, 9), (64, 48)), "how many positions"
    encoded = engine.media_encoded
    counted = engine.prompt_length(MediaPrompt(prompt, (photo,)))
    assert engine.media_encoded == encoded
    seq, = engine.submit([MediaPrompt(prompt, (photo,))], greedy(1))
    assert engine.media_encoded == encoded + 1
    for _ in engine.run():
        pass
    assert counted == seq.n_prompt > 4
    with pytest.raises(PromptError, match="image 1: not an image"):
        engine.prompt_length(MediaPrompt(prompt, (b"not an image",)))


def test_a_bad_image_fails_alone(engine):
    good = MediaPrompt("what is it", (RED,))
    results = engine.generate([good, MediaPrompt("and this", (b"not an image at all",)), "plain text"], greedy(4))
    assert results[0].error is None and results[2].error is None
    assert results[1].finish_reason == "error" and "image 1: not an image" in results[1].error


@pytest.mark.parametrize("prompt, images, why", [
    ("two markers " + MARKER + MARKER, (RED,), "2 media markers for 1 images and clips"),
    ("one marker " + MARKER, (RED, GREEN), "1 media markers for 2 images and clips"),
])
def test_markers_and_images_must_agree(engine, prompt, images, why):
    (result,) = engine.generate([MediaPrompt(prompt, images)], greedy())
    assert result.finish_reason == "error" and why in result.error


def test_a_prompt_that_ends_with_an_image_is_refused(tiny_model, projector):
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=1, n_ctx=512) as engine:
        (result,) = engine.generate([MediaPrompt("describe: " + MARKER, (RED,))], greedy())
    assert result.finish_reason == "error" and "ends with an image" in result.error


def test_a_model_without_a_projector_refuses_images(make_engine):
    engine = make_engine(n_parallel=1)
    (result,) = engine.generate([MediaPrompt("what is it", (RED,))], greedy())
    assert result.finish_reason == "error" and "--mmproj" in result.error


def test_a_projector_that_is_not_one_is_refused_at_load(tiny_model, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelError, match="cannot load the projector"):
        BatchEngine(tiny_model, mmproj=bad, n_parallel=1, n_ctx=512)
    with pytest.raises(ModelError, match="not found"):
        BatchEngine(tiny_model, mmproj=tmp_path / "missing.gguf", n_parallel=1, n_ctx=512)


@pytest.mark.parametrize("arch", FAMILIES)
def test_images_on_every_family(arch, tmp_path, projector):
    """Recurrent and hybrid memory take an image's embeddings as a prompt's tokens: three
    sequences, two showing the same image, beside a text one. Qwen3.5 places images with
    M-RoPE, which llamabatch reads into attention memory only: refused at load, saying so."""
    model = write_tiny_family(tmp_path / f"{arch}.gguf", arch)
    if arch == "qwen35":
        with pytest.raises(ModelError, match="M-RoPE .* only into attention memory, not hybrid memory"):
            BatchEngine(model, mmproj=projector, n_parallel=1, n_ctx=512)
        return
    with BatchEngine(model, mmproj=projector, n_parallel=3, n_ctx=1536) as engine:
        results = engine.generate([MediaPrompt("what is it", (RED,)), MediaPrompt("and this", (RED,)), "text"], greedy(6))
    assert [r.error for r in results] == [None] * 3
    assert all(r.completion_tokens == 6 or r.finish_reason == "stop" for r in results)


def mtmd_cli_reply(model: Path, projector: Path, media: Path, prompt: str, n: int, flag: str = "--image", n_ctx: int = 1024) -> bytes:
    """llama-mtmd-cli's greedy reply (`flag`: --image or --audio). Its log thread is not flushed
    at exit, so a run may lose the end of its output (here, about one run in two): a whole one
    ends with the reply's closing line and the CLI's. A run takes a tenth of a second."""
    marker = b"@@@REPLY@@@"
    for _ in range(MTMD_CLI_ATTEMPTS):
        done = subprocess.run(
            [str(native_tool("llama-mtmd-cli")), "-m", str(model), "--mmproj", str(projector), flag, str(media),
             "-p", prompt, "-n", str(n), "--temp", "0", "-c", str(n_ctx), "-t", "2", "--no-warmup"],
            capture_output=True, timeout=300, env={**os.environ, "MTMD_TEST_RESPONSE_MARKER": marker.decode()},
        )
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
        _, shown, printed = done.stdout.partition(marker + b"\n")
        if shown and printed.endswith(b"\n\n"):  # the line the prompt's evaluation ends with, the reply, its end
            return printed.removeprefix(b"\n").rstrip(b"\n")
    raise AssertionError(f"llama-mtmd-cli lost its output {MTMD_CLI_ATTEMPTS} times")


def run_json(model: Path, projector: Path, prompts: list[str], flag: str, files: list[Path], n_ctx: int, max_tokens: int) -> list[dict]:
    """`llamabatch run --chat --json` of greedy prompts, each with its file (`flag`: --image or
    --audio), in a process of its own: its JSON lines (the results, then the summary)."""
    done = subprocess.run(
        [sys.executable, "-m", "llamabatch", "run", "-m", str(model), "--mmproj", str(projector), "--chat",
         "--parallel", str(len(prompts)), "--ctx", str(n_ctx), "--max-tokens", str(max_tokens), "--temperature", "0", "--json",
         *[a for p in prompts for a in ("-p", p)], *[a for f in files for a in (flag, str(f))]],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


# ChatML whose generation prompt ends inside an expression: a template's own last newline is
# kept by llama.cpp's renderer and dropped by Jinja2's (and transformers'), which the tests'
# CHATML ends with.
CHATML_QUOTED = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\\n' }}"


@pytest.mark.skipif(not native_built("llama-mtmd-cli"), reason="llama-mtmd-cli not built (scripts/build_native.sh; CI builds it)")
def test_greedy_tokens_equal_llama_mtmd_cli(projector, tmp_path):
    """`run --chat --image` and the engine underneath give llama-mtmd-cli's reply, byte for byte,
    for two images and two questions decoded together."""
    # seed 4: a model whose replies to the two differ from their second token
    tiny_model = write_tiny_model(tmp_path / "tiny.gguf", chat_template=CHATML_QUOTED, seed=4)
    cases = [("what is it", (200, 10, 10)), ("and what is this", (10, 200, 10))]
    files = []
    for k, (_, color) in enumerate(cases):
        files.append(tmp_path / f"{k}.png")
        files[-1].write_bytes(png(color))
    expected = [mtmd_cli_reply(tiny_model, projector, path, prompt, 12) for (prompt, _), path in zip(cases, files)]
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=2, n_ctx=2048, chat=True) as engine:
        seqs = engine.submit([MediaPrompt(p, (f.read_bytes(),)) for (p, _), f in zip(cases, files)], greedy(12))
        for _ in engine.run():
            pass
        got = [b"".join(engine.vocab.piece(t) for t in s.tokens[s.n_prompt:] if not engine.vocab.is_eog(t)) for s in seqs]
    assert got == expected and expected[0] != expected[1]
    lines = run_json(tiny_model, projector, [p for p, _ in cases], "--image", files, n_ctx=2048, max_tokens=12)
    assert [line["text"] for line in lines[:2]] == [e.decode(errors="replace") for e in expected]
    assert lines[2]["summary"]["media_encoded"] == 2 and lines[2]["summary"]["media_read"] == 2


# -- the server: OpenAI's image_url parts, through the official client ------------------------


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def image_server(serve, projector) -> str:
    return serve(n_parallel=4, engine_extra={"mmproj": projector})


def test_a_chat_with_an_image_answers_as_the_engine_does(image_server, tiny_model, projector):
    """The official client sends a text part and an image_url part (a data: URL): the answer is
    the engine's own for the same rendered prompt, and usage counts the image's positions."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{image_server}/v1", api_key="none")
    content = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": data_url(RED)}}]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=1, n_ctx=512, chat=True) as engine:
        (expected,) = engine.generate([MediaPrompt("what is it\n" + MARKER, (RED,))], greedy(8))
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens


def test_a_bad_image_in_a_chat_is_a_400_naming_it(image_server):
    import httpx

    def ask(url: str) -> httpx.Response:
        content = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": url}}]
        return httpx.post(f"{image_server}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})

    for url, why in ((data_url(b"not an image"), "not an image"), ("https://example.com/cat.png", "remote image URLs are not fetched"),
                     ("data:image/png;base64,@@@", "base64")):
        answer = ask(url)
        assert answer.status_code == 400 and why in answer.text, (url, answer.text)
    assert ask(data_url(GREEN)).status_code == 200  # and the server goes on


def test_an_anthropic_image_block_is_read_as_openai_s_image_part(image_server, tiny_model, projector):
    """The official anthropic client's base64 image block after a text block: the same answer as
    OpenAI's image_url part in that place, and count_tokens counts the image's positions."""
    from anthropic import Anthropic

    client = Anthropic(base_url=image_server, api_key="none")
    content = [{"type": "text", "text": "what is it"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}}]
    reply = client.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": content}])
    counted = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": content}])
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=1, n_ctx=512, chat=True) as engine:
        (expected,) = engine.generate([MediaPrompt("what is it\n" + MARKER, (RED,))], greedy(8))
    assert reply.content[0].text == expected.text
    assert counted.input_tokens == expected.prompt_tokens


def test_a_responses_input_image_is_read_as_the_chat_s_image_part(image_server, tiny_model, projector):
    from openai import OpenAI

    client = OpenAI(base_url=f"{image_server}/v1", api_key="none")
    content = [{"type": "input_text", "text": "what is it"}, {"type": "input_image", "image_url": data_url(RED)}]
    reply = client.responses.create(model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=8, temperature=0)
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=1, n_ctx=512, chat=True) as engine:
        (expected,) = engine.generate([MediaPrompt("what is it\n" + MARKER, (RED,))], greedy(8))
    assert reply.output_text == expected.text
    assert reply.usage.input_tokens == expected.prompt_tokens


def test_a_batch_job_of_chat_lines_with_images(tiny_model, projector, tmp_path):
    """`batch --mmproj` over OpenAI chat lines with image_url parts: each answers as the engine
    does; a line with an image that is no image goes to the error file, naming it."""
    from typer.testing import CliRunner

    from llamabatch.cli import app

    def line(custom_id: str, image: bytes) -> str:
        content = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}})

    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line("red", RED), line("junk", b"junk"), line("green", GREEN)]) + "\n")
    done = CliRunner().invoke(app, ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_model),
                                    "--mmproj", str(projector), "--ctx", "2048", "--parallel", "2"])
    assert done.exit_code == 1, done.output  # a line failed
    out = {json.loads(x)["custom_id"]: json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()}
    errors = {json.loads(x)["custom_id"]: json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()}
    assert sorted(out) == ["green", "red"] and sorted(errors) == ["junk"]
    assert "image 1: not an image" in errors["junk"]["error"]["message"]
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=1, n_ctx=512, chat=True) as engine:
        expected = engine.generate([MediaPrompt("what is it\n" + MARKER, (image,)) for image in (RED, GREEN)], greedy(6))
    for custom_id, want in zip(("red", "green"), expected):
        assert out[custom_id]["response"]["body"]["choices"][0]["message"]["content"] == want.text


def test_a_jsonl_job_names_its_images_by_path(tiny_model, projector, tmp_path):
    """llamabatch JSON Lines with "image" paths (relative to the file, a file:// URL, a list):
    each line answers as the engine does; a missing file fails its line alone; `run
    --prompts-file` reads the same lines."""
    from typer.testing import CliRunner

    from llamabatch.cli import app

    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "red.png").write_bytes(RED)
    (tmp_path / "green.png").write_bytes(GREEN)
    lines = [{"id": "red", "prompt": "what is it", "image": "photos/red.png"},
             {"id": "gone", "prompt": "what is it", "image": "photos/missing.png"},
             {"id": "both", "prompt": f"{MARKER} and {MARKER}", "image": [f"file://{tmp_path / 'green.png'}", "photos/red.png"]}]
    source = tmp_path / "job.jsonl"
    source.write_text("".join(json.dumps({**line, "max_tokens": 6, "temperature": 0}) + "\n" for line in lines))
    common = ["-m", str(tiny_model), "--mmproj", str(projector), "--chat", "--ctx", "2048", "--parallel", "2"]
    done = CliRunner().invoke(app, ["batch", str(source), "-o", str(tmp_path / "out.jsonl"), *common])
    assert done.exit_code == 1, done.output  # a line failed
    out = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()}
    errors = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()}
    assert sorted(out) == ["both", "red"] and "image file not found" in errors["gone"]["error"]["message"]
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=1, n_ctx=1024, chat=True) as engine:
        red, both = engine.generate([MediaPrompt("what is it", (RED,)), MediaPrompt(f"{MARKER} and {MARKER}", (GREEN, RED))], greedy(6))
    assert out["red"]["choices"][0]["text"] == red.text and out["both"]["choices"][0]["text"] == both.text
    source.write_text("".join(json.dumps({**line, "max_tokens": 6, "temperature": 0}) + "\n" for line in lines if line["id"] != "gone"))
    ran = CliRunner().invoke(app, ["run", "--prompts-file", str(source), "--json", *common])
    assert ran.exit_code == 0, ran.output
    assert [json.loads(x)["text"] for x in ran.stdout.splitlines()[:2]] == [red.text, both.text]


def test_sampled_samples_of_one_image_share_it_and_repeat_with_their_seed(tiny_model, projector):
    """n = 3 sampled samples of an image prompt (top-k, top-p, a seed): the image is read once
    for all three, and the same request draws the same three texts again."""
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7, n=3)

    def draw() -> tuple[list[str], int]:
        with BatchEngine(tiny_model, mmproj=projector, n_parallel=3, n_ctx=1024, chat=True) as engine:
            results = engine.generate([MediaPrompt("what is it", (RED,))], params)
            assert all(r.error is None and r.completion_tokens == 8 or r.finish_reason == "stop" for r in results)
            return [r.text for r in results], engine.stats.media_read

    (texts, read), (again, _) = draw(), draw()
    assert read == 1 and texts == again


@pytest.fixture(scope="module")
def files_server(tmp_path_factory):
    """A plain HTTP server on 127.0.0.1 serving a folder: red.png, and big.png (a PNG of 50 kB)."""
    import functools
    import http.server
    import threading

    folder = tmp_path_factory.mktemp("www")
    (folder / "red.png").write_bytes(RED)
    (folder / "big.png").write_bytes(png((10, 10, 200), size=(400, 300)) + b"\0" * 50_000)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_remote_image_is_fetched_where_the_server_allows_it(serve, projector, tiny_model, files_server, monkeypatch):
    """serve --allow-remote-media: an image_url (OpenAI) and a url source (Anthropic) naming an
    http URL answer as the same image inline does; a 404 and a file over the size limit are 400s
    naming the URL; without the flag (the other servers here), remote URLs are refused."""
    import httpx
    from anthropic import Anthropic
    from openai import OpenAI

    from llamabatch.serve import remote_media

    base = serve(n_parallel=2, engine_extra={"mmproj": projector}, allow_remote_media=True)
    client = OpenAI(base_url=f"{base}/v1", api_key="none")

    def ask(url: str):
        content = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}]
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)

    fetched, inline = ask(f"{files_server}/red.png"), ask(data_url(RED))
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    message = Anthropic(base_url=base, api_key="none").messages.create(
        model="tiny", max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                               {"type": "image", "source": {"type": "url", "url": f"{files_server}/red.png"}}]}])
    assert message.content[0].text == inline.choices[0].message.content
    monkeypatch.setattr(remote_media, "MAX_BYTES", 20_000)
    for path, why in (("missing.png", "HTTP 404"), ("big.png", "larger than")):
        content = [{"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": f"{files_server}/{path}"}}]
        answer = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": content}], "max_tokens": 4})
        assert answer.status_code == 400 and f"fetching {files_server}/{path}: {why}" in answer.text, answer.text


def test_ngram_drafts_beside_images_give_the_same_tokens_and_stop_before_an_image(tiny_model, projector):
    """--speculative ngram with images: a draft never runs into an image's positions (their ids
    are above the vocabulary), and greedy answers are those decoded without drafts."""
    from llamabatch.engine.speculative.drafters import NgramDrafter

    assert NgramDrafter(n_vocab=100)._tokens_only([5, 6, 150, 151, 7]) == [5, 6]
    prompts = [MediaPrompt("say it again and again: " + MARKER + " a red thing, a red thing, a red", (RED,)),
               MediaPrompt(MARKER + " and " + MARKER + " one two three, one two three, one", (GREEN, RED))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    answers = {}
    for mode in ("off", "ngram"):
        with BatchEngine(tiny_model, mmproj=projector, n_parallel=2, n_ctx=2048, speculative=mode) as engine:
            answers[mode] = [r.token_ids for r in engine.generate(prompts, params)]
            drafted = engine.stats.draft_tokens
    assert answers["ngram"] == answers["off"] and drafted > 0


def test_beside_decoding_streams_a_large_image_is_read_in_parts_within_the_step_budget(tiny_model, tmp_path):
    """With the step budget on and streams decoding, an image attended one way is read a part a
    step (the budget's prompt tokens, as a prompt would be): every stream gets its token every
    step, and the answer is the one the image read whole gives."""
    from llamabatch.engine.scheduling.budget import MIN_TOKENS, PROBE_TOKENS

    big = write_tiny_projector(tmp_path / "big-mmproj.gguf", image_size=112)  # 64 positions
    question = MediaPrompt("what is it", (RED,))
    with BatchEngine(tiny_model, mmproj=big, n_parallel=4, n_ctx=4096) as engine:
        (whole,) = engine.generate([question], greedy(8))
    with BatchEngine(tiny_model, mmproj=big, n_parallel=4, n_ctx=4096, step_target=1e-6) as engine:
        streams = engine.submit(["one stream", "another stream"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(5):  # their prompts, then decode steps alone (what a decode step costs)
            engine.step()
        (reader,) = engine.submit([question], greedy(8))
        read = []
        while reader.t_first_token is None:
            before = (reader.n_past, [s.n_generated for s in streams])
            engine.step()
            span = reader.media[0]
            read.append(min(max(reader.n_past, span.start), span.end) - min(max(before[0], span.start), span.end))  # the image's positions
            assert [s.n_generated for s in streams] == [n + 1 for n in before[1]]  # no stream stalls
        while reader.status is not Status.FINISHED:
            engine.step()
    parts = [n for n in read if n]
    assert sum(parts) == 64 and len(parts) >= 3 and all(n <= max(PROBE_TOKENS, MIN_TOKENS) for n in parts)
    assert reader.result().text == whole.text


def test_an_image_that_finds_no_room_fails_its_own_sequence_alone(tiny_model, projector, monkeypatch):
    """The images of two prompts decoded together find the KV cache full (llama_decode answers
    1): each is tried alone; the one that still finds no room fails its sequence, saying so,
    and the other answers as it would have."""
    from conftest import Faults

    prompts = [MediaPrompt("what is it", (RED,)), MediaPrompt("what is it", (GREEN,))]
    with BatchEngine(tiny_model, mmproj=projector, n_parallel=2, n_ctx=1024) as engine:
        expected = engine.generate(prompts[1:], greedy(6))[0].text
        engine.drop_cached_prefixes()
        Faults(monkeypatch, code=1, times=2, after=1)  # after the prompts' first token: both images, then the first alone
        failed, answered = engine.generate(prompts, greedy(6))
    assert failed.finish_reason == "error" and "reading its image" in failed.error
    assert answered.finish_reason == "length" and answered.text == expected
