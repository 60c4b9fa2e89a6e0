"""Everything the CLI shows: completions, the live stream view, progress, summaries, tables."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .engine import Event, Result, Sequence
from .measure.sweep import describe

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
# Wide tables stay whole when piped to a file, instead of squeezed into rich's default 80 columns.
wide = out if out.is_terminal else Console(highlight=False, width=200)


def error_line(message: str) -> None:
    """One line, never wrapped or parsed as markup: the CLI's only way to report an error."""
    err.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)


def note(message: str) -> None:
    """A line on stderr about what the command does (not a result, not an error)."""
    err.print(Text(message, style="dim"), soft_wrap=True)


def json_line(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def completion(result: Result, console: Console = out) -> None:
    """A finished prompt: header, prompt (dim) and completion, then how it ended; errors to stderr."""
    console.rule(Text(f"[{_label(result)}] {_one_line(result.prompt, 70)}", style="bold"), align="left")
    if result.error:
        error_line(f"prompt {_label(result)}: {result.error}")
        return
    console.print(Text(result.prompt, style="dim"), Text(result.text), sep="", soft_wrap=True)
    console.print(
        f"[dim]{result.finish_reason} · {result.prompt_tokens} prompt + "
        f"{result.completion_tokens} completion tokens · ttft {result.timings.ttft_s * 1000:.0f} ms[/]"
    )


def summary(stats: dict) -> None:
    table = Table(title="run summary", show_header=False, title_justify="left", box=None)
    for key, value in stats.items():
        table.add_row(key.replace("_", " "), str(value))
    out.print(table)


class Steps:
    """A long command's progress on stderr: `label`, what is done of the total, and a status. A
    bar on a terminal, gone when done; in a log, a plain line every `every_s` seconds (every
    update with 0), and a last one when the command ran long enough to have printed any."""

    def __init__(self, label: str, total: int | None = None, every_s: float = 10.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.done, self.status = 0, ""
        self.printed = time.perf_counter()
        self.lines, self.printed_state = 0, None
        self.bar = Progress(
            TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
            console=err, transient=True,
        ) if err.is_terminal else None

    def __enter__(self) -> Steps:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total, status="")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif exc_type is None and self.lines and self.printed_state != self._state:
            self._print()

    def update(self, done: int, total: int | None = None, status: str = "") -> None:
        """`done` of `total` (the one given before when None); `status` says what was last done."""
        self.done, self.total, self.status = done, total if total is not None else self.total, status
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=self.total, status=status)
        elif time.perf_counter() - self.printed >= self.every_s:
            self._print()

    @property
    def _state(self) -> tuple:
        return self.done, self.total, self.status

    def _print(self) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        err.print(f"{self.label}: {self.done}{of}" + (f" · {self.status}" if self.status else ""), soft_wrap=True)
        self.printed, self.lines, self.printed_state = time.perf_counter(), self.lines + 1, self._state


class BatchProgress:
    """A batch job's progress on stderr: requests done of the total, requests/s and generated
    tokens/s of this run, and the time left. A live bar on a terminal; in a log file, one plain
    line every `every_s` seconds and at the end."""

    def __init__(self, summary, every_s: float = 10.0, tokens: str = "generated") -> None:
        self.summary = summary
        self.tokens = tokens  # "generated" (completion tokens) or "embedded" (prompt tokens) a second
        self.every_s = every_s
        self.started = self.printed = time.perf_counter()
        self.bar = Progress(
            TextColumn("batch"), BarColumn(), TextColumn("{task.fields[status]}"), console=err, transient=True,
        ) if err.is_terminal else None

    def __enter__(self) -> BatchProgress:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("batch", total=self.summary.total, status="starting")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif exc_type is None:
            err.print(self.status(), soft_wrap=True)

    def update(self, summary) -> None:
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.update(self.task, completed=self._processed, status=self.status())
        elif now - self.printed >= self.every_s:
            err.print(self.status(), soft_wrap=True)
            self.printed = now

    @property
    def _processed(self) -> int:
        s = self.summary
        return s.done + s.failed + s.skipped

    def status(self) -> str:
        s, elapsed = self.summary, max(time.perf_counter() - self.started, 1e-9)
        rate = (s.done + s.failed) / elapsed
        done = f"{self._processed:,}" + (f"/{s.total:,}" if s.total is not None else "")
        tokens = s.prompt_tokens if self.tokens == "embedded" else s.completion_tokens
        text = f"{done} requests · {rate:,.1f} req/s · {tokens / elapsed:,.0f} tok/s"
        if s.total is not None and rate > 0:
            text += f" · ETA {_duration((s.total - self._processed) / rate)}"
        return text


def embed_summary(summary, output, errors) -> None:
    """`llamabatch embed`: what this run did, and where its vectors went."""
    s = summary
    _key_values("embed summary", [
        ("lines embedded", _of_total(s)),
        ("already done (skipped)", f"{s.skipped:,}"),
        ("failed", f"{s.failed:,}"),
        ("tokens embedded", f"{s.prompt_tokens:,}"),
        ("wall", f"{s.wall_s:.2f} s"),
        ("tokens/s", f"{s.prompt_tokens / s.wall_s if s.wall_s > 0 else 0:,.1f}"),
        ("output", str(output)),
        ("errors", str(errors)),
    ])


def _of_total(s) -> str:
    return f"{s.done:,}" + (f" of {s.total:,} in the input" if s.total is not None else "")


def _key_values(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False, title_justify="left", box=None)
    for key, value in rows:
        table.add_row(key, escape(value))
    out.print(table)


def batch_summary(summary, output, errors) -> None:
    """`llamabatch batch`: what this run did, and where its lines went."""
    s = summary
    _key_values("batch summary", [
        ("requests done", _of_total(s)),
        ("already done (skipped)", f"{s.skipped:,}"),
        ("failed", f"{s.failed:,}"),
        ("structured outputs cut short", f"{s.incomplete:,}"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("completion tokens", f"{s.completion_tokens:,}"),
        ("decode calls", f"{s.decode_calls:,}"),
        ("mean active sequences", f"{s.mean_active_sequences:.2f}"),
        ("wall", f"{s.wall_s:.2f} s" + (f" (estimated {s.estimated_s:.1f} s)" if s.estimated_s is not None else "")),
        ("tokens/s", f"{s.tokens_per_s:,.1f}"),
        ("output", str(output)),
        ("errors", str(errors)),
    ])


def job_estimate(e, brief: bool = False) -> None:
    """`batch --estimate` (a table), and the line every batch starts with (brief, on stderr)."""
    expected = "unknown: no batch size measured for this model and these settings (llamabatch tune)" if e.seconds is None \
        else f"{_duration(e.seconds)} ({e.seconds:.1f} s, from llamabatch tune's measurement)"
    if brief:
        note(f"job: {e.requests:,} requests, {e.prompt_tokens:,} prompt tokens, at most {e.max_new_tokens:,} new tokens; "
             f"--parallel {e.parallel}, KV cache {e.kv_bytes * _MIB:.0f} MiB; expected time {expected}")
        return
    _key_values("job estimate", [
        ("requests", f"{e.requests:,}" + (f" (and {e.bad_lines:,} lines that would fail)" if e.bad_lines else "")),
        ("prompt tokens", f"{e.prompt_tokens:,}"),
        ("new tokens, at most", f"{e.max_new_tokens:,}"),
        ("parallel", str(e.parallel)),
        ("KV cache", f"{e.kv_bytes * _MIB:.0f} MiB"),
        ("expected time", expected),
    ])


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StreamView:
    """Live view of the running sequences' text; each one's full completion prints above it when done."""

    def __init__(self, sequences: list[Sequence], max_rows: int = 12) -> None:
        self.sequences = {(seq.index, seq.sample): seq for seq in sequences}
        self.labels = {key: _label(seq.result()) for key, seq in self.sequences.items()}
        self.text: dict[tuple[int, int], str] = {}
        self.done = 0
        self.max_rows = max_rows
        self.live = Live(self._render(), console=out, refresh_per_second=12, transient=True)

    def __enter__(self) -> StreamView:
        self.live.__enter__()
        # Prompts rejected at submission never reach a step: report them now.
        for seq in self.sequences.values():
            if seq.finish_reason is not None:
                self._print_finished(seq)
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def update(self, events: Iterable[Event]) -> None:
        for event in events:
            key = (event.index, event.sample)
            self.text[key] = self.text.get(key, "") + event.text
            if event.finish_reason is not None:
                self.text.pop(key)
                self._print_finished(self.sequences[key])
        self.live.update(self._render())

    def _print_finished(self, seq: Sequence) -> None:
        self.done += 1
        completion(seq.result(), self.live.console)

    def _render(self) -> Group:
        rows = Table(show_header=False, box=None, expand=True)
        rows.add_column(width=6, style="bold cyan")
        rows.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        for key, text in list(self.text.items())[: self.max_rows]:
            rows.add_row(f"[{self.labels[key]}]", Text(_one_line(text[-200:], 200)))
        footer = Text(f"{self.done}/{len(self.sequences)} done, {len(self.text)} streaming", style="dim")
        return Group(rows, footer)


def models_table(rows: list[dict]) -> None:
    table = Table(title="models.toml", title_justify="left")
    for column in ("name", "here", "arch", "params", "quant", "ctx train", "size"):
        table.add_column(column, no_wrap=column in ("name", "quant"))
    for row in rows:
        table.add_row(
            escape(row["name"]), "yes" if row["available"] else "[red]no[/]", row.get("architecture", "-"),
            _human(row.get("parameters"), ""), row.get("quantization", "-"), str(row.get("trained_ctx", "-")),
            _human(row.get("file_bytes"), "B"),
        )
    out.print(table)
    for row in rows:
        out.print(f"[bold]{escape(row['name'])}[/]: {escape(row.get('description') or '')} [dim]({escape(row['source'])})[/]")


def plan_table(row: dict) -> None:
    """`llamabatch plan`: what the KV cache costs and how many sequences fit."""
    mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
    kv = (f"{row['kv_bytes_per_token']:,} B per token (K {row['cache_type_k']}, V {row['cache_type_v']}) "
          f"in {row['full_layers']} full-attention layers")
    if row["swa_layers"]:
        kv += f"; {row['swa_layers']} sliding-window layers keep {row['n_swa']} tokens + a ubatch per sequence"
    lines = [
        ("model weights", mib(row["model_bytes"])),
        ("KV cache", kv),
        *([("recurrent state", f"{row['state_bytes'] / 2**20:,.2f} MiB per sequence, and per checkpoint of it")]
          if row["state_bytes"] else []),
        ("context per sequence", f"{row['ctx_per_seq']:,} tokens"),
        ("memory budget", mib(row["budget_bytes"])),
        ("largest safe --parallel", f"[bold]{row['n_parallel']}[/] (--ctx {row['n_ctx']:,} in total"
         f"{', --kv-unified' if row['kv_unified'] else ''})"),
        ("  KV cache", mib(row["kv_bytes"])),
        ("  compute + logits buffers", mib(row["compute_bytes"] + row["output_bytes"])),
        *([("  checkpoints (at most)", mib(row["checkpoint_bytes"]))] if row["checkpoint_bytes"] else []),
        *([("  prompt cache in RAM", mib(row["prompt_cache_bytes"]))] if row["prompt_cache_bytes"] else []),
        ("  Python and libraries", mib(row["process_bytes"])),
        ("  total", mib(row["total_bytes"])),
    ]
    if "allocated_kv_bytes" in row:
        ratio = row["kv_bytes"] / row["allocated_kv_bytes"]
        lines.append(("llama.cpp allocated KV", f"{mib(row['allocated_kv_bytes'])} (estimate / actual = {ratio:.4f})"))
    table = Table(title="KV memory plan", show_header=False, title_justify="left", box=None)
    for key, value in lines:
        table.add_row(key, value)
    out.print(table)


class SweepView:
    """`llamabatch sweep`: the table grows as batch sizes are measured, above a progress bar."""

    def __init__(self, model: str, settings, config, n_steps: int, live: bool = True) -> None:
        self.caption = (
            f"{model} · PP {settings.prompt_tokens} · TG {settings.gen_tokens} · n_ctx {settings.context} · "
            f"n_batch {config.n_batch} · n_ubatch {config.n_ubatch} · {config.n_threads} threads · "
            f"ngl {config.gpu_layers} · {describe(settings, config)} · median of {settings.repeat}"
        )
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err)
        self.task = self.bar.add_task("warm-up", total=n_steps)
        self.live = Live(Group(self.bar), console=wide, refresh_per_second=4) if live else None

    def __enter__(self) -> SweepView:
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.live.__exit__(*exc)

    def show(self, points: list, step: str, done: bool = False) -> None:
        self.bar.update(self.task, advance=0 if done else 1, description=f"measured {step}")
        if self.live:
            table = sweep_table(points, self.caption)
            self.live.update(table if done else Group(table, self.bar))


_MS, _MIB = 1000, 1 / 2**20
_THROUGHPUT = [  # (header, field, format, scale)
    ("B", "batch_size", "{}", 1), ("N_KV", "n_kv", "{}", 1), ("S_PP", "s_pp", "{:.1f}", 1),
    ("S_TG", "s_tg", "{:.1f}", 1), ("S", "s", "{:.1f}", 1), ("speedup", "speedup", "{:.2f}x", 1),
    ("eff.", "efficiency", "{:.0%}", 1), ("Llama S", "sequential_s", "{:.1f}", 1),
    ("vs Llama", "speedup_vs_sequential", "{:.2f}x", 1), ("native S_TG", "native_s_tg", "{:.1f}", 1),
    ("S_TG/native", "s_tg_ratio", "{:.3f}", 1),
]
_LATENCY = [
    ("B", "batch_size", "{}", 1), ("TTFT p50", "ttft_p50_s", "{:.0f} ms", _MS), ("TTFT p99", "ttft_p99_s", "{:.0f} ms", _MS),
    ("TPOT p50", "tpot_p50_s", "{:.1f} ms", _MS), ("TPOT p99", "tpot_p99_s", "{:.1f} ms", _MS),
    ("KV cache", "kv_bytes", "{:.1f} MiB", _MIB), ("peak RSS", "peak_rss_bytes", "{:.0f} MiB", _MIB),
]


def sweep_table(points: list, caption: str) -> Group:
    """Throughput (tokens/s, as llama-batched-bench) and latency/memory, one row per batch size."""
    return Group(_table(points, _THROUGHPUT, "throughput, tokens/s"), _table(points, _LATENCY, "latency and memory"), Text(caption, style="dim"))


def _table(points: list, columns: list, title: str) -> Table:
    shown = [c for c in columns if any(getattr(p, c[1]) is not None for p in points)]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for header, *_ in shown:
        table.add_column(header, justify="right", no_wrap=True)
    for p in points:
        table.add_row(*("-" if getattr(p, key) is None else fmt.format(getattr(p, key) * scale) for _, key, fmt, scale in shown))
    return table


def tune_table(tuning, chosen, max_itl_s: float | None, job: tuple[float, float] | None = None) -> None:
    """The measured curve, the chosen batch size marked."""
    table = Table(title="decode throughput and inter-token latency against batch size", title_justify="left", box=box.SIMPLE_HEAD)
    for header in ("B", "S_TG tok/s", "S_PP tok/s", "ITL p50", "ITL p95", ""):
        table.add_column(header, justify="right", no_wrap=True)
    for p in tuning.points:
        marks = (["chosen"] if p is chosen else []) + (["over --max-itl"] if max_itl_s is not None and p.itl_p95_s > max_itl_s else [])
        mark = ", ".join(marks)
        table.add_row(str(p.batch_size), f"{p.s_tg:.1f}", f"{p.s_pp:.0f}", f"{p.itl_p50_s * 1e3:.1f} ms", f"{p.itl_p95_s * 1e3:.1f} ms", mark)
    wide.print(table)
    measured = f"({tuning.prompt_tokens}-token prompts; measured in {tuning.seconds:.1f} s, stored as {tuning.key})"
    if max_itl_s is not None and chosen.itl_p95_s > max_itl_s:  # nothing met the budget: say so, and what was taken instead
        wide.print(f"no batch size keeps p95 within {max_itl_s * 1e3:.0f} ms between tokens: batch size {chosen.batch_size}, "
                   f"the lowest latency measured (p95 {chosen.itl_p95_s * 1e3:.0f} ms) {measured}")
        return
    budget = f" within p95 {max_itl_s * 1e3:.0f} ms between tokens" if max_itl_s is not None else ""
    best = (f"the soonest end of the job ({job[0]:.0f} prompt and {job[1]:.0f} new tokens a request, prefill counted)"
            if job else "the highest decode throughput")
    wide.print(f"batch size {chosen.batch_size}: {best}{budget} {measured}")


def score_table(scores: list) -> None:
    """`llamabatch score`: each item's tokens scored, log-likelihood, perplexity and greediness."""
    table = Table(title="scores", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("item", "tokens", "log-likelihood", "perplexity", "greedy"):
        table.add_column(column, justify="left" if column == "greedy" else "right")
    for s in scores:
        if s.error is None:
            table.add_row(str(s.index), str(s.n_tokens), f"{s.logprob:.4f}", f"{s.perplexity:.4g}", "yes" if s.greedy else "no")
        else:
            table.add_row(str(s.index), "-", "-", "-", "failed")
    wide.print(table)


def determinism_table(checks: list, deterministic: bool) -> None:
    """Identical share per prompt-length bucket and batch size, then each divergence."""
    buckets = [(0, 32), (33, 128), (129, 512), (513, 10**9)]
    parallels = sorted({c.parallel for c in checks})
    mode = "deterministic mode" if deterministic else "llama.cpp defaults"
    table = Table(title=f"solo vs batched, token-identical ({mode})", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("prompt tokens")
    for parallel in parallels:
        table.add_column(f"--parallel {parallel}", justify="right")
    for low, high in buckets:
        rows = [[c for c in checks if c.parallel == p and low <= c.prompt_tokens <= high] for p in parallels]
        if any(rows):
            label = f"{low}-{high}" if high < 10**9 else f"> {low - 1}"
            table.add_row(label, *(f"{sum(c.identical for c in r)}/{len(r)}" for r in rows))
    out.print(table)
    same = sum(c.logprobs_identical for c in checks)
    out.print(f"sampled tokens' log-probabilities bit-identical: {same}/{len(checks)}")
    for c in checks:
        if not c.identical:
            out.print(f"prompt {c.index} ({c.prompt_tokens} tokens), --parallel {c.parallel}: differs from token {c.first_difference}")


def write_csv(path, rows: list[dict]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _human(value: int | None, unit: str) -> str:
    if value is None:
        return "-"
    for prefix in ("", "K", "M", "G", "T"):
        if value < 1000:
            return f"{value:.0f}{prefix}{unit}" if prefix == "" else f"{value:.1f}{prefix}{unit}"
        value /= 1000
    return f"{value:.1f}P{unit}"


def _label(result: Result) -> str:
    """A prompt's number, with the sample's after a dot when it has more than one."""
    return f"{result.index}.{result.sample}" if result.n_samples > 1 else str(result.index)


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
