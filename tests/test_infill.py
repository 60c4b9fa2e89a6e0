"""Fill-in-the-middle: llama-server's /infill and OpenAI's `suffix`, on a tiny model with FIM
tokens; a model without them is refused, naming what it lacks; llama-server answers the same."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from llamabatch import BatchEngine, PromptError
from llamabatch.engine import ExtraFile, Infill
from conftest import native_built
from tiny_model import BOS, FIM_TOKENS, Keys

PRE, SUF, MID, REP, SEP = (FIM_TOKENS[k] for k in (Keys.Tokenizer.FIM_PRE_ID, Keys.Tokenizer.FIM_SUF_ID, Keys.Tokenizer.FIM_MID_ID,
                                                   Keys.Tokenizer.FIM_REP_ID, Keys.Tokenizer.FIM_SEP_ID))
GAP = {"input_prefix": "def fib(n):\n    ", "input_suffix": "\n    return a", "n_predict": 8, "temperature": 0}


@pytest.fixture(scope="module")
def fim_base(serve, tiny_fim_model) -> str:
    return serve(n_parallel=4, n_ctx=4096, model=tiny_fim_model)


def test_the_prompt_is_laid_out_with_the_models_fim_tokens(tiny_fim_model):
    """Repository, each extra file under its name, the current file, then BOS, prefix and prompt,
    suffix, middle (or suffix first with spm); prefix and suffix cut to a batch, 3:1."""
    with BatchEngine(tiny_fim_model, n_parallel=1, n_ctx=1024, n_batch=64, n_ubatch=64) as engine:
        vocab = engine.vocab

        def ids(text: str) -> list[int]:
            return vocab.tokenize(text, add_special=False, parse_special=False)

        pre, suf, mid, rep, sep = (vocab.tokenize(t, add_special=False)[0] for t in (PRE, SUF, MID, REP, SEP))
        got = engine.infill_prompt(Infill("the capital", "of France", [ExtraFile("hello world", "a.py")], prompt="is"))
        assert got == [rep, *ids("myproject\n"), sep, *ids("a.py\n"), *ids("hello world"), sep, *ids("filename\n"),
                       BOS, pre, *ids("the capital"), *ids("is"), suf, *ids("of France"), mid]
        spm = engine.infill_prompt(Infill("the capital", "of France", spm=True))
        assert spm[spm.index(BOS):] == [BOS, suf, *ids("of France"), pre, *ids("the capital"), mid]
        # special-token text in the code is plain text, not a token
        assert engine.infill_prompt(Infill(PRE, "")).count(pre) == 1
        long = ids("the capital of France " * 40)
        cut = engine.infill_prompt(Infill(long, " ".join(["world"] * 40)))
        at_pre, at_suf = cut.index(pre), cut.index(suf)
        assert cut[at_pre + 1:at_suf] == long[-48:]  # the prefix's end: 3/4 of the batch
        assert at_suf + 1 + 14 == cut.index(mid)  # the suffix's start: a quarter less 2


def test_a_model_without_fim_tokens_is_refused_naming_them(tiny_model, base, client):
    with BatchEngine(tiny_model, n_parallel=1, n_ctx=256) as engine, pytest.raises(PromptError, match="no FIM prefix, suffix, middle token"):
        engine.infill_prompt(Infill("a", "b"))
    r = httpx.post(f"{base}/infill", json=GAP)
    assert r.status_code == 400 and "no FIM prefix, suffix, middle token" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="no FIM prefix"):
        client.completions.create(model="tiny", prompt="def fib(n):", suffix="return a", max_tokens=4)


def test_infill_answers_in_llama_servers_shape_and_as_openais_suffix_does(fim_base):
    whole = httpx.post(f"{fim_base}/infill", json=GAP, timeout=60).json()
    assert whole["stop"] is True and whole["tokens_predicted"] == 8 == len(whole["tokens"]) and whole["stop_type"] == "limit"
    assert whole["timings"]["predicted_n"] == 8 and whole["tokens_evaluated"] > 0
    client = openai.OpenAI(base_url=f"{fim_base}/v1", api_key="unused", max_retries=0)
    same = client.completions.create(model="tiny-fim", prompt=GAP["input_prefix"], suffix=GAP["input_suffix"], max_tokens=8, temperature=0)
    assert same.choices[0].text == whole["content"] and same.usage.prompt_tokens == whole["tokens_evaluated"]
    with httpx.stream("POST", f"{fim_base}/infill", json={**GAP, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == whole["content"] and events[-1]["tokens"] == whole["tokens"]
    picked = httpx.post(f"{fim_base}/infill", json={**GAP, "response_fields": ["content", "timings/predicted_n"]}).json()
    assert picked == {"content": whole["content"], "timings/predicted_n": 8}
    with pytest.raises(openai.BadRequestError, match="echo and suffix"):
        client.completions.create(model="tiny-fim", prompt="x", suffix="y", echo=True, max_tokens=2)


def test_editor_requests_are_batched_with_their_files_and_each_gets_its_own_middle(fim_base):
    """llama.vscode's shape: extra files, a typed start, its sampler chain and settings; four at once."""
    def ask(k: int) -> dict:
        body = {**GAP, "input_prefix": f"x{k} = {k}\ndef fib(n):\n    ", "prompt": "a", "id_slot": 0, "cache_prompt": True,
                "input_extra": [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}],
                "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99, "t_max_prompt_ms": 500}
        return httpx.post(f"{fim_base}/infill", json=body, timeout=60).json()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    alone = [ask(k) for k in range(4)]
    assert all(a["stop"] for a in answers)
    assert [a["tokens_evaluated"] for a in answers] == [a["tokens_evaluated"] for a in alone]


def test_the_samplers_field_builds_the_chain_in_its_order(fim_base):
    """top_k 1 alone in the chain leaves the best token: a draw at temperature 1 is the greedy one
    (temperature not named, so not applied); an unknown sampler is refused, naming it."""
    greedy = httpx.post(f"{fim_base}/infill", json=GAP).json()["content"]
    drawn = httpx.post(f"{fim_base}/infill", json={**GAP, "temperature": 1, "seed": 7, "samplers": ["top_k"], "top_k": 1}).json()
    assert drawn["content"] == greedy
    r = httpx.post(f"{fim_base}/infill", json={**GAP, "samplers": ["top_k", "nucleus"]})
    assert r.status_code == 400 and "unknown sampler 'nucleus'" in r.json()["error"]["message"]
    r = httpx.post(f"{fim_base}/infill", json={**GAP, "cache_prompt": False})
    assert r.status_code == 400


def test_a_middle_ends_at_a_line_once_its_time_is_up(fim_base, tiny_fim_model):
    """t_max_predict_ms: no new line is begun once the time is up (every token a newline here)."""
    with BatchEngine(tiny_fim_model, n_parallel=1, n_ctx=256) as engine:
        newline = engine.vocab.tokenize("\n", add_special=False)[-1]
    body = {**GAP, "n_predict": 64, "logit_bias": {str(newline): 100}}
    unbounded = httpx.post(f"{fim_base}/infill", json=body).json()
    assert unbounded["tokens_predicted"] == 64
    timed = httpx.post(f"{fim_base}/infill", json={**body, "t_max_predict_ms": 1}).json()
    assert 1 < timed["tokens_predicted"] < 64 and timed["stop_type"] == "limit" and timed["content"].endswith("\n")


def test_n_indent_ends_the_middle_where_its_block_does(fim_base, tiny_fim_model):
    """Every token a newline: the second line is empty, so indented less than 4, and ends it."""
    with BatchEngine(tiny_fim_model, n_parallel=1, n_ctx=256) as engine:
        newline = engine.vocab.tokenize("\n", add_special=False)[-1]
    got = httpx.post(f"{fim_base}/infill", json={**GAP, "n_predict": 16, "n_indent": 4, "logit_bias": {str(newline): 100}}).json()
    assert got["content"] == "\n" and got["tokens_predicted"] == 2


@pytest.mark.skipif(not native_built("llama-server"), reason="llama-server not built (scripts/build_native.sh; CI builds it)")
def test_llama_server_reads_the_same_prompt_and_writes_the_same_middle(fim_base, tiny_fim_model):
    from benchmarks.servers import llama_server

    body = {**GAP, "input_extra": [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}], "prompt": "a"}
    ours = httpx.post(f"{fim_base}/infill", json=body, timeout=60).json()
    with llama_server(tiny_fim_model, "-np", 1, "-c", 4096, "-b", 512, "-ub", 512, "-t", 2) as native:
        theirs = httpx.post(f"{native.base}/infill", json={**body, "return_tokens": True}, timeout=60).json()
    assert ours["tokens_evaluated"] == theirs["tokens_evaluated"]
    assert ours["tokens"] == theirs["tokens"]
