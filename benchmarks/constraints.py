"""Structured output: which constraint engine, what it costs, whether outputs validate.

engines     the per-token cost of constraining one sequence along a real output (a 20-field
            schema; the logits of each step from an actual decode): llguidance (mask + apply +
            argmax, what llamabatch does), llama.cpp's grammar sampler filtering the whole
            vocabulary (a grammar sampler in the chain), and llama.cpp's sample-then-check
            (common_sampler: check the argmax alone, filter everything only when it is refused);
            and the compile time of each
throughput  generated tokens/s with a JSON schema on every sequence against none, same prompts
            (--per-slot of them per slot), --max-tokens 64, EOS honoured, at each --parallel,
            rotating runs; and against free text cut to the schema outputs' lengths
sampled     a decode step's time per active row with a JSON schema on every sequence against none,
            sampled as the CLI samples (temperature 0.7, top-k 40, top-p 0.95, min-p 0.05), the
            same --sampled-prompts prompts at once, alternating rounds; and against free text cut to
            the lengths the schema's outputs had (the same batch as it drains: a step of fewer rows
            costs more a row). The prompts' prefill is not timed. (A masked row whose few tokens
            top-k cannot fill must cost what those few cost.)
validity    every output parsed and validated (jsonschema), 14 schemas x --prompts prompts at each
            --temperature, all in one batch; every invalid output printed with its reason; with
            --llama-server, the same schemas and prompts sent to llama-server's /completion with
            json_schema (built by scripts/build_native.sh), side by side: validity and tokens/s
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import llama_cpp
import llguidance
import llguidance.numpy
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from llamabatch import BatchEngine, SamplingParams

from .harness import Spread, alternate, median, paired, progress, tiny_model
from .servers import llama_server

SMOKE = ["--model", "tiny", "--parallel", "2", "--per-slot", "2", "--rounds", "1", "--prompts", "2", "--schemas", "3",
         "--sampled-prompts", "2", "--sampled-tokens", "8",
         "--temperatures", "0.7", "--max-tokens", "64"]

ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"enum": ["FR", "DE", "US", "JP"]}},
    "required": ["street", "city", "zip", "country"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {  # 20 fields, nested: the compile-time schema
    "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
    "customer": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}[.]com$"},
        "vip": {"type": "boolean"}, "address": ADDRESS}, "required": ["name", "email", "vip", "address"], "additionalProperties": False},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number", "minimum": 0, "maximum": 10000}}, "required": ["sku", "quantity", "price"],
        "additionalProperties": False}},
    "status": {"enum": ["new", "paid", "shipped"]}, "express": {"type": "boolean"},
    "discount": {"type": "number", "minimum": 0, "maximum": 1}, "notes": {"type": "string", "maxLength": 60},
    "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["order_id", "customer", "items", "status", "express", "discount", "notes", "priority"],
    "additionalProperties": False}
SCHEMAS = {  # increasing difficulty
    "enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "unsure"]}}, "required": ["answer"],
             "additionalProperties": False},
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
               "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    "bounded numbers": {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                        "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["temperature", "humidity"],
                        "additionalProperties": False},
    "string pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                       "valid": {"type": "boolean"}}, "required": ["code", "valid"], "additionalProperties": False},
    "array of strings": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                         "minItems": 1, "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    "optional fields": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                        "subtitle": {"type": "string", "maxLength": 40}, "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
                        "required": ["title"], "additionalProperties": False},
    "nested object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "address": ADDRESS},
                      "required": ["name", "address"], "additionalProperties": False},
    "array of objects": {"type": "object", "properties": {"steps": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "text": {"type": "string", "maxLength": 30}},
        "required": ["n", "text"], "additionalProperties": False}}}, "required": ["steps"], "additionalProperties": False},
    "person with email": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                          "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}[.](com|org|net)$"}},
                          "required": ["name", "email"], "additionalProperties": False},
    "label with confidence": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                              "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
                              "required": ["label", "confidence"], "additionalProperties": False},
    "order of enum items": {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5,
                            "items": {"enum": ["apple", "bread", "milk", "eggs", "rice"]}}, "total": {"type": "number"}},
                            "required": ["items", "total"], "additionalProperties": False},
    "anyOf contact": {"type": "object", "properties": {"contact": {"anyOf": [
        {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}, "required": ["phone"],
         "additionalProperties": False},
        {"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"],
         "additionalProperties": False}]}}, "required": ["contact"], "additionalProperties": False},
    "enums and consts": {"type": "object", "properties": {"kind": {"const": "review"}, "stars": {"enum": [1, 2, 3, 4, 5]},
                         "language": {"enum": ["en", "fr", "de"]}, "verified": {"type": "boolean"}},
                         "required": ["kind", "stars", "language", "verified"], "additionalProperties": False},
    "date and nested arrays": {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                               "matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 3,
                                          "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
                               "required": ["date", "matrix"], "additionalProperties": False},
    "product catalog": {"type": "object", "properties": {"products": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 25}, "price": {"type": "number", "minimum": 0, "maximum": 999},
                                         "category": {"enum": ["food", "tools", "toys"]}, "stock": {"type": "integer", "minimum": 0, "maximum": 500}},
        "required": ["name", "price", "category", "stock"], "additionalProperties": False}}}, "required": ["products"],
        "additionalProperties": False},
    "20-field order": ORDER,
}
TOPICS = ["a bakery order", "a weather report", "a book", "a hotel review", "a museum visit", "a train ticket",
          "a birthday party", "a recipe", "a rescue dog", "a garden", "a concert", "a job offer", "a chess club",
          "a bicycle repair", "a school trip", "a coffee shop", "a lost umbrella", "a football match", "a dentist visit",
          "a new laptop", "a farmers market", "a city tour", "a piano lesson", "a camping trip", "a library card",
          "a wedding", "a car rental", "a science fair", "a pizza delivery", "a yoga class", "a flight delay", "an art gallery"]


def prompt(topic: str, name: str) -> str:
    return f"Write the data for {topic} as JSON ({name}).\nJSON: "


def engines(args: argparse.Namespace, report) -> None:
    """Each engine decodes its own greedy output for the same prompt, one sequence, timing only
    what it adds to a step; the output is then validated."""
    with BatchEngine(args.model, n_parallel=1, n_ctx=4096) as engine:
        vocab, n_vocab = engine.vocab, engine.vocab.n_vocab
        start = time.perf_counter()
        tokenizer = engine.grammars._llg_tokenizer()
        tokenizer_s = time.perf_counter() - start
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(ORDER, defaults={"whitespace_flexible": False}))
        llg_compile = time.perf_counter() - start
        start = time.perf_counter()
        gbnf = json_schema_to_gbnf(json.dumps(ORDER))
        llama_cpp.llama_sampler_free(llama_cpp.llama_sampler_init_grammar(vocab.handle, gbnf.encode(), b"root"))
        gbnf_compile = time.perf_counter() - start
        prompt_tokens = engine.tokenize_prompt(prompt("a bakery order", "order"))
        mask = np.empty((1, (n_vocab + 31) // 32), dtype=np.int32)

        def llguidance_step(row: np.ndarray) -> int:
            llguidance.numpy.fill_next_token_bitmask(matcher, mask)
            np.putmask(row, ~np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:n_vocab].view(bool), -np.inf)
            token = int(row.argmax())
            matcher.consume_token(token)
            return -1 if vocab.is_eog(token) else token

        results = {"llguidance: mask, apply, argmax": greedy_path(engine, prompt_tokens, llguidance_step)}
        for check_first in (False, True):
            grammar = llama_cpp.llama_sampler_init_grammar(vocab.handle, gbnf.encode(), b"root")
            step, refused = grammar_step(grammar, vocab, check_first)
            label = "llama.cpp: check the argmax, filter on refusal" if check_first else "llama.cpp: grammar over every candidate"
            results[label] = (*greedy_path(engine, prompt_tokens, step), *([refused[0]] if check_first else []))
            llama_cpp.llama_sampler_free(grammar)
    rows = []
    for label, (times, text, *refused) in results.items():
        verdict = check(text, ORDER) or "valid"
        rows.append([label, statistics.mean(times) * 1e3, statistics.median(times) * 1e3, len(times), verdict,
                     f"{refused[0]} of {len(times)}" if refused else ""])
    report.figure("compile_ms", {"llguidance": llg_compile * 1e3, "llguidance_tokenizer_s": tokenizer_s, "llama.cpp gbnf": gbnf_compile * 1e3})
    report.table(f"What each engine adds to a step: the 20-field schema, {n_vocab:,}-token vocabulary, one greedy sequence",
                 ["engine", "mean (ms)", "median (ms)", "steps", "output", "argmaxes refused"], rows,
                 f"Compile: llguidance {llg_compile * 1e3:.2f} ms (+ {tokenizer_s:.2f} s once per model for its tokenizer); "
                 f"llama.cpp GBNF conversion + grammar init {gbnf_compile * 1e3:.2f} ms.")


def grammar_step(grammar, vocab, check_first: bool):
    """A step function for llama.cpp's grammar sampler: filter every candidate, or (as llama.cpp's
    common_sampler) check the argmax alone and filter everything only when it is refused."""
    n_vocab = vocab.n_vocab
    candidates = (llama_cpp.llama_token_data * n_vocab)()
    ids = np.ctypeslib.as_array(ctypes.cast(candidates, ctypes.POINTER(ctypes.c_int32)), shape=(n_vocab, 3))
    logits = np.ctypeslib.as_array(ctypes.cast(candidates, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab, 3))
    single = (llama_cpp.llama_token_data * 1)()
    refused = [0]

    def filtered_argmax(row: np.ndarray) -> int:
        ids[:, 0] = np.arange(n_vocab)
        logits[:, 1] = row
        array = llama_cpp.llama_token_data_array(candidates, n_vocab, -1, False)
        llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
        return int(logits[:, 1].argmax())

    def step(row: np.ndarray) -> int:
        token = int(row.argmax())
        if check_first:
            single[0].id, single[0].logit, single[0].p = token, float(row[token]), 0.0
            llama_cpp.llama_sampler_apply(grammar, ctypes.byref(llama_cpp.llama_token_data_array(single, 1, -1, False)))
            if not np.isfinite(single[0].logit):
                refused[0] += 1
                token = filtered_argmax(row)
        else:
            token = filtered_argmax(row)
        if vocab.is_eog(token):
            return -1
        llama_cpp.llama_sampler_accept(grammar, token)
        return token

    return step, refused


def greedy_path(engine: BatchEngine, prompt_tokens: list[int], step, max_tokens: int = 400) -> tuple[list[float], str]:
    """Decode greedily, one token a step, with `step` choosing each token from the logits (-1: the
    end); the seconds each choice took, and the text."""
    ctx, batch, n_vocab = engine.ctx, engine.batch, engine.vocab.n_vocab
    engine.memory.clear(0)
    batch.set(prompt_tokens, list(range(len(prompt_tokens))), [0] * len(prompt_tokens), [0] * (len(prompt_tokens) - 1) + [1])
    ctx.decode(batch)
    times, tokens = [], []
    for i in range(max_tokens):
        row = ctx.output_logits(1, n_vocab)[0]
        started = time.perf_counter()
        token = step(row)
        times.append(time.perf_counter() - started)
        if token < 0:
            break
        tokens.append(token)
        batch.set([token], [len(prompt_tokens) + i], [0], [1])
        ctx.decode(batch)
    return times, engine.vocab.detokenize(tokens)


def throughput(args: argparse.Namespace, report) -> None:
    """Three sides, alternating: free text, the schema, and free text cut to the lengths the schema's
    outputs had (the same staggered finishes without masks: the constraint's own cost)."""
    schema = SCHEMAS["product catalog"]
    rows = []
    for parallel in map(int, str(args.parallel).split(",")):
        prompts = [prompt(TOPICS[i % len(TOPICS)], f"catalog {i}") for i in range(parallel * args.per_slot)]
        speeds: dict[str, list[float]] = {"free": [], "schema": [], "same lengths": []}
        with BatchEngine(args.model, n_parallel=parallel, n_ctx=parallel * 512) as engine:
            engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, json_schema=schema))  # tokenizer built
            lengths = [r.completion_tokens for r in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64, json_schema=schema))]
            sides = {
                "free": SamplingParams(temperature=0, max_tokens=64),
                "schema": SamplingParams(temperature=0, max_tokens=64, json_schema=schema),
                "same lengths": [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
            }
            for r in range(args.rounds):
                for side in list(sides)[r % 3:] + list(sides)[: r % 3]:
                    engine.drop_cached_prefixes()
                    engine.reset_stats()
                    engine.generate(prompts, sides[side])
                    speeds[side].append(engine.stats.tokens_per_s)
        vs_free = Spread.of([c / f for f, c in zip(speeds["free"], speeds["schema"])])
        vs_same = Spread.of([c / f for f, c in zip(speeds["same lengths"], speeds["schema"])])
        rows.append([parallel, len(prompts), statistics.mean(lengths), *(Spread.of(v) for v in speeds.values()), vs_free, vs_same])
        report.figure(f"schema_vs_same_lengths_{parallel}", vs_same)
    report.table("Generated tokens/s with a JSON schema on every sequence (the product catalog schema, max 64 tokens)",
                 ["--parallel", "prompts", "mean tokens (schema)", "free", "schema", "free, same lengths", "schema / free",
                  "schema / same lengths"], rows, f"Medians (lowest–highest) of {args.rounds} rotating rounds.")


def sampled(args: argparse.Namespace, report) -> None:
    """Decode steps only: each side's prompts are prefilled first (every sequence has its first
    token), then the remaining steps are timed and their rows counted."""
    schema = SCHEMAS["product catalog"]
    prompts = [prompt(TOPICS[i % len(TOPICS)], f"catalog {i}") for i in range(args.sampled_prompts)]
    cli_like = dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, max_tokens=args.sampled_tokens)
    sides = {"free": [SamplingParams(**cli_like, seed=i) for i in range(len(prompts))],
             "schema": [SamplingParams(**cli_like, seed=i, json_schema=schema) for i in range(len(prompts))]}
    with BatchEngine(args.model, n_parallel=len(prompts), n_ctx=len(prompts) * 512, n_threads=args.threads) as engine:
        lengths = [r.completion_tokens for r in engine.generate(prompts, sides["schema"])]  # seeded: every round's
        sides["same lengths"] = [SamplingParams(**{**cli_like, "max_tokens": n}, seed=i, ignore_eos=True) for i, n in enumerate(lengths)]

        def per_row(params: list[SamplingParams]):
            def measure() -> tuple[float, int]:
                engine.drop_cached_prefixes()
                sequences = engine.submit(prompts, params)
                while any(s.t_first_token is None and s.finish_reason is None for s in sequences):
                    engine.step()
                rows_before, started = engine.stats.sequence_slots, time.perf_counter()
                while engine.has_work:
                    engine.step()
                rows = engine.stats.sequence_slots - rows_before
                return (time.perf_counter() - started) / max(rows, 1) * 1e3, rows
            return measure

        runs = alternate({side: per_row(params) for side, params in sides.items()}, args.rounds, label="sampled")
    ms = {side: [m for m, _ in values] for side, values in runs.items()}
    over = {side: paired(ms["schema"], ms[side]) for side in ("free", "same lengths")}
    report.figure("sampled_schema_over_free_per_row", over["free"])
    report.figure("sampled_schema_over_same_lengths_per_row", over["same lengths"])
    report.table(
        f"A decode step's time per active row, sampled as the CLI samples (T 0.7, top-k 40, top-p 0.95, min-p 0.05), "
        f"{len(prompts)} prompts at once, max {args.sampled_tokens} tokens",
        ["side", "ms per active row", "rows decoded", "schema over it"],
        [[side, Spread.of(ms[side]), median([n for _, n in runs[side]]), over.get(side, "")] for side in runs],
        f"Medians (lowest–highest) of {args.rounds} alternating rounds; the prompts' prefill is not timed. 'same lengths' "
        "is free text cut to the lengths of the schema's outputs: the schema's own cost, at the same batch sizes as it drains.",
    )


def validity(args: argparse.Namespace, report) -> None:
    """Every schema x prompt at each temperature through one engine (all in one batch), and
    optionally through llama-server; valid / total per schema, side by side, and every invalid
    output with its reason."""
    schemas = dict(list(SCHEMAS.items())[: args.schemas])
    requests = [(name, schema, prompt(topic, name)) for name, schema in schemas.items() for topic in TOPICS[: args.prompts]]
    sides = {"llamabatch": lambda t: run_llamabatch(requests, t, args)}
    if args.llama_server:
        sides["llama-server"] = lambda t: run_llama_server(requests, t, args)
    for temperature in map(float, args.temperatures.split(",")):
        table = {}
        for side, run in sides.items():
            texts, finishes, seconds, tokens = run(temperature)
            verdicts = [check(text, schema) for (_, schema, _), text in zip(requests, texts)]
            table[side] = (verdicts, tokens / seconds)
            for (name, _, _), text, finish, verdict in zip(requests, texts, finishes, verdicts):
                if verdict is not None:
                    shown = text if len(text) <= 200 else f"{text[:100]} ... {text[-80:]}"
                    progress(f"[{side}, T={temperature:g}] {name}: {verdict} (finish {finish}, {len(text)} chars): {shown!r}")
        rows = []
        for name in schemas:
            cells = []
            for verdicts, _ in table.values():
                mine = [v for (n, _, _), v in zip(requests, verdicts) if n == name]
                cells.append(f"{sum(v is None for v in mine)}/{len(mine)}")
            rows.append([name, *cells])
        rows.append(["all", *(f"{sum(v is None for v in vs)}/{len(vs)}" for vs, _ in table.values())])
        rows.append(["generated tokens/s", *(speed for _, speed in table.values())])
        for side, (verdicts, _) in table.items():
            report.figure(f"valid_{side}_t{temperature:g}", f"{sum(v is None for v in verdicts)}/{len(verdicts)}")
        report.table(f"Valid / total per schema at temperature {temperature:g} ({args.prompts} prompts each, max_tokens {args.max_tokens})",
                     ["schema", *table], rows)


def check(text: str, schema: dict) -> str | None:
    """Why an output is not a valid instance of the schema (None: it is)."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    except jsonschema.ValidationError as e:
        return f"invalid ({e.message[:80]})"
    return None


def validity_slots(args) -> int:
    """Validity runs at the last --parallel given (throughput measures each)."""
    return int(str(args.parallel).split(",")[-1])


def run_llamabatch(requests: list, temperature: float, args: argparse.Namespace) -> tuple[list[str], list[str], float, int]:
    params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=i, json_schema=schema)
              for i, (_, schema, _) in enumerate(requests)]
    parallel = validity_slots(args)
    with BatchEngine(args.model, n_parallel=parallel, n_ctx=parallel * 1024, n_threads=args.threads) as engine:
        engine.generate([p for _, _, p in requests[:2]], params[:2])  # llguidance's tokenizer, built once
        engine.reset_stats()
        started = time.perf_counter()
        results = engine.generate([p for _, _, p in requests], params)
        seconds = time.perf_counter() - started
    cut = sum(r.finish_reason == "length" for r in results)
    progress(f"llamabatch T={temperature:g}: {cut} outputs cut by max_tokens (finish_reason length)")
    return [r.text for r in results], [r.finish_reason for r in results], seconds, sum(r.completion_tokens for r in results)


def run_llama_server(requests: list, temperature: float, args: argparse.Namespace) -> tuple[list[str], list[str], float, int]:
    """llama-server (the same llama.cpp) with as many slots and threads, its /completion with
    json_schema (converted to GBNF by llama.cpp), as many requests in flight as slots."""
    parallel = validity_slots(args)
    with BatchEngine(args.model, n_parallel=1, n_ctx=256) as engine:
        model = engine.model.path
    with llama_server(model, "-np", parallel, "-c", parallel * 1024, "-t", args.threads, "-fa", "auto", "-kvu") as server:

        def ask(i: int) -> dict:
            _, schema, text = requests[i]
            body = {"prompt": text, "json_schema": schema, "temperature": temperature, "n_predict": args.max_tokens, "seed": i}
            return httpx.post(server.base + "/completion", json=body, timeout=3600).json()

        started = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            answers = list(pool.map(ask, range(len(requests))))
        seconds = time.perf_counter() - started
    finishes = ["length" if a.get("stop_type") == "limit" else "stop" for a in answers]
    return [a.get("content", "") for a in answers], finishes, seconds, sum(a.get("tokens_predicted", 0) for a in answers)


def arguments(parser) -> None:
    parser.add_argument("--parts", default="engines,throughput,sampled,validity")
    parser.add_argument("--model", default=None, help="catalog name or GGUF path; 'tiny' for the tests' model")
    parser.add_argument("--parallel", default="16,32", help="throughput: each; validity: the last")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-slot", type=int, default=8, help="prompts per slot: the tail of the last wave weighs less with more")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--sampled-prompts", type=int, default=16, help="sampled: prompts (and slots)")
    parser.add_argument("--sampled-tokens", type=int, default=128, help="sampled: max_tokens")
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--llama-server", action="store_true", help="validity: also run llama-server (scripts/build_native.sh)")


def run(args, report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            args.model = str(tiny_model(Path(tmp)))
        for part in args.parts.split(","):
            {"engines": engines, "throughput": throughput, "sampled": sampled, "validity": validity}[part](args, report)
