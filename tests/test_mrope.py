"""Images on M-RoPE models (Qwen2-VL and its kin): an image's rows sit on a grid of positions
(time, row, column), max(rows, columns) of them for its rows × columns cells, so after an image
a sequence's positions run behind its tokens. A tiny Qwen2-VL text model and projector, small
images made here; greedy tokens checked against llama.cpp's own llama-mtmd-cli."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamabatch.engine import BatchEngine, MediaPrompt, Result, SamplingParams
from conftest import native_built
from test_images import CHATML_QUOTED, MARKER, data_url, mtmd_cli_reply, png, run_json
from tiny_model import write_tiny_model, write_tiny_projector

# Two images of different grids: 60×40 is cut to 4×3 cells of 28 pixels (12 rows, 4 positions),
# 90×64 to 4×3 as well but of other pixels; 120×60 to 4×2 (8 rows, 4 positions).
WIDE, TALL, SMALL = png((200, 10, 10), (60, 40)), png((10, 200, 10), (90, 64)), png((10, 10, 200), (120, 60))


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory) -> tuple[Path, Path]:
    """The text model (seed 4: its replies to the two images differ early) and its projector."""
    folder = tmp_path_factory.mktemp("qwen2vl")
    return (write_tiny_model(folder / "qwen2vl.gguf", mrope="qwen2vl", chat_template=CHATML_QUOTED, seed=4),
            write_tiny_projector(folder / "mmproj.gguf", kind="qwen2vl_merger", image_size=560))


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def alone(model: Path, projector: Path, prompt: MediaPrompt, params: SamplingParams) -> Result:
    """The prompt's result in an engine of its own."""
    with BatchEngine(model, mmproj=projector, n_parallel=1, n_ctx=2048, chat=True) as engine:
        (result,) = engine.generate([prompt], params)
    return result


@pytest.mark.skipif(not native_built("llama-mtmd-cli"), reason="llama-mtmd-cli not built (scripts/build_native.sh; CI builds it)")
@pytest.mark.parametrize("arch", ["qwen2vl", "qwen3vl"])
def test_greedy_tokens_equal_llama_mtmd_cli_on_an_m_rope_model(qwen2vl, arch, tmp_path):
    """Two questions about two images decoded together, by the engine and by `run --image`,
    give llama-mtmd-cli's replies byte for byte; each image fills fewer positions than cells.
    Qwen2-VL's text model, and Qwen3-VL's (its sections interleaved), beside the same projector."""
    _, projector = qwen2vl
    model = write_tiny_model(tmp_path / f"{arch}.gguf", mrope=arch, chat_template=CHATML_QUOTED, seed=4)
    cases = [("what is it", WIDE), ("and what is this", TALL)]
    files = []
    for k, (_, image) in enumerate(cases):
        files.append(tmp_path / f"{k}.png")
        files[-1].write_bytes(image)
    expected = [mtmd_cli_reply(model, projector, path, prompt, 12, n_ctx=2048) for (prompt, _), path in zip(cases, files)]
    with BatchEngine(model, mmproj=projector, n_parallel=2, n_ctx=2048, chat=True) as engine:
        seqs = engine.submit([MediaPrompt(p, (image,)) for p, image in cases], greedy(12))
        for _ in engine.run():
            pass
        got = [b"".join(engine.vocab.piece(t) for t in s.tokens[s.n_prompt:] if not engine.vocab.is_eog(t)) for s in seqs]
    assert got == expected and expected[0] != expected[1]
    assert [(span.image.n_tokens, span.image.n_pos) for s in seqs for span in s.media] == [(12, 4), (12, 4)]
    lines = run_json(model, projector, [p for p, _ in cases], "--image", files, n_ctx=2048, max_tokens=12)
    assert [line["text"] for line in lines[:2]] == [e.decode(errors="replace") for e in expected]


def test_a_slot_s_memory_is_cut_where_the_next_prompt_parts_from_it(qwen2vl):
    """One slot, prompts run one after another, each finding the last one's memory: the same
    prompt again (kept whole), the same image with another question (cut after the image, where
    positions run behind tokens), another image (cut where the image starts), and a second image
    after the first. Each reply equals the one it gets in a fresh engine, and the reused prefixes
    are counted."""
    model, projector = qwen2vl
    prompts = [MediaPrompt("what is it", (WIDE,)), MediaPrompt("what is it", (WIDE,)), MediaPrompt("what is that", (WIDE,)),
               MediaPrompt("what is it", (SMALL,)), MediaPrompt("<__media__>what is it <__media__> and this", (SMALL, TALL))]
    fresh = [alone(model, projector, prompt, greedy()).token_ids for prompt in prompts]
    with BatchEngine(model, mmproj=projector, n_parallel=1, n_ctx=2048, chat=True) as engine:
        seqs = engine.submit(prompts, greedy())
        for _ in engine.run():
            pass
    results = [seq.result() for seq in seqs]
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.token_ids for r in results] == fresh
    assert len({tuple(t) for t in fresh}) >= 3  # the images and questions change the replies
    first_image = [seq.media[0] for seq in seqs]
    assert results[1].cached_tokens == seqs[1].n_prompt - 1  # all but the newest token, decoded again
    assert first_image[2].end < results[2].cached_tokens < seqs[2].n_prompt - 1  # "what is th"
    assert results[3].cached_tokens == first_image[3].start  # the chat's opening
    assert seqs[4].media[0].end < results[4].cached_tokens < seqs[4].media[1].start  # and "what is it"


def test_samples_of_an_m_rope_image_prompt_copy_its_memory(qwen2vl):
    """Three greedy samples of one image prompt: the followers copy the leader's prefix, image
    included, and all three reply as the prompt alone does."""
    model, projector = qwen2vl
    prompt = MediaPrompt("describe it", (TALL,))
    reply = alone(model, projector, prompt, greedy()).token_ids
    with BatchEngine(model, mmproj=projector, n_parallel=3, n_ctx=2048, chat=True) as engine:
        results = engine.generate([prompt], greedy(n=3))
        assert engine.stats.media_read == 1
    assert [r.token_ids for r in results] == [reply] * 3
    assert all(r.cached_tokens > 12 for r in results[1:])


def test_sampled_replies_to_m_rope_images_do_not_depend_on_the_batch(qwen2vl, monkeypatch):
    """Seeded sampling (temperature, top-k, top-p) in deterministic mode: three image prompts,
    one of them sampled twice, decoded together (fillers beside rows whose positions run behind
    their tokens) give each sequence the tokens it gets alone."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")  # (this process has decoded; the tiny models' float weights never tile)
    model, projector = qwen2vl
    prompts = [MediaPrompt("what is it", (WIDE,)), MediaPrompt("<__media__> and <__media__> which is red", (TALL, SMALL)),
               MediaPrompt("tell me", (SMALL,))]
    params = [SamplingParams(max_tokens=12, temperature=1.2, top_k=20, top_p=0.95, seed=7 + k, ignore_eos=True, n=1 + (k == 1))
              for k in range(3)]
    settings = dict(mmproj=projector, n_ctx=2048, chat=True, deterministic=True)
    apart = []
    for prompt, p in zip(prompts, params):
        with BatchEngine(model, n_parallel=2, **settings) as engine:
            apart += [r.token_ids for r in engine.generate([prompt], p)]
    with BatchEngine(model, n_parallel=4, **settings) as engine:
        together = [r.token_ids for r in engine.generate(prompts, params)]
    assert together == apart
    assert len({tuple(ids) for ids in apart}) == 4  # sampled: the two samples of one prompt differ too


@pytest.mark.parametrize("mode", [{"speculative": "ngram"}, {"overlap": "on"}])
def test_drafts_and_decodes_ahead_past_an_m_rope_image_give_the_same_tokens(qwen2vl, mode):
    """Ngram drafts (verified and rejected past an image, where positions run behind tokens) and
    decodes issued ahead (cut where a stop string ends a reply) give the tokens of the plain loop."""
    model, projector = qwen2vl
    prompts = [MediaPrompt("<__media__> one two three, one two three, one", (WIDE,)),
               MediaPrompt("<__media__> and <__media__> a red thing, a red thing, a red", (TALL, SMALL))]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[" France"])
    answers = {}
    for name, extra in (("plain", {}), ("mode", mode)):
        with BatchEngine(model, mmproj=projector, n_parallel=2, n_ctx=2048, **extra) as engine:
            answers[name] = [(r.token_ids, r.finish_reason) for r in engine.generate(prompts, params)]
            used = engine.stats.draft_tokens if "speculative" in mode else engine.stats.decodes_ahead
    assert answers["mode"] == answers["plain"] and used > 0


def test_a_chat_with_an_image_on_an_m_rope_model_answers_as_the_engine_does(serve, qwen2vl):
    """The official client's chat with a text part and an image_url part, two at once on a
    two-slot server: each answer is the engine's own for the same rendered prompt."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    model, projector = qwen2vl
    client = OpenAI(base_url=f"{serve(n_parallel=2, n_ctx=4096, model=model, engine_extra={'mmproj': projector})}/v1", api_key="none")

    def ask(image: bytes) -> str | None:
        content = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        reply = client.chat.completions.create(model="qwen2vl", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, (WIDE, TALL)))
    expected = [alone(model, projector, MediaPrompt("what is it\n" + MARKER, (image,)), greedy(8)).text for image in (WIDE, TALL)]
    assert answers == expected and expected[0] != expected[1]



@pytest.mark.parametrize("tier", ["cache_ram", "cache_dir"])
def test_an_m_rope_image_prompt_comes_back_from_the_prompt_cache(qwen2vl, tier, tmp_path):
    """One slot with the prompt cache: an image prompt's memory goes to the cache when another
    prompt takes the slot (to disk, when its engine closes), and a later question about the same
    image takes it back, image and all (its positions counted through the image), replying as
    it does alone. The disk tier is read by a second engine."""
    model, projector = qwen2vl
    look = "Look at every corner of this picture, the colours and the shapes in it, and then say: "  # what a restore must win
    later = MediaPrompt(look + "what is that", (WIDE,))
    reply = alone(model, projector, later, greedy())
    setting = {tier: "256MiB" if tier == "cache_ram" else str(tmp_path)}
    with BatchEngine(model, mmproj=projector, n_parallel=1, n_ctx=2048, chat=True, **setting) as engine:
        engine.generate([MediaPrompt(look + "what is it", (WIDE,)), MediaPrompt("what is it", (TALL,))], greedy())
        if tier == "cache_ram":
            (seq,) = engine.submit([later], greedy())
            for _ in engine.run():
                pass
            stats = engine.prompt_cache.stats.ram
    if tier == "cache_dir":
        with BatchEngine(model, mmproj=projector, n_parallel=1, n_ctx=2048, chat=True, **setting) as engine:
            (seq,) = engine.submit([later], greedy())
            for _ in engine.run():
                pass
            stats = engine.prompt_cache.stats.disk
    assert stats.hits == 1
    assert seq.media[0].end + len(look) < seq.n_cached < seq.n_prompt - 1  # the image, its text and "what is th"
    assert seq.result().token_ids == reply.token_ids
