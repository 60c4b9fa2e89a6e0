"""`llamabatch sweep --plot`: throughput and latency against batch size (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
except ImportError:
    from ..errors import LlamabatchError

    raise LlamabatchError("--plot needs matplotlib: pip install 'llamabatch[plot]'") from None

from .sweep import SweepPoint


def sweep_plot(points: list[SweepPoint], path: Path, title: str) -> None:
    sizes = [p.batch_size for p in points]
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    speed.plot(sizes, [p.s_tg for p in points], "o-", label="llamabatch S_TG")
    speed.plot(sizes, [p.s for p in points], "o--", label="llamabatch S")
    for key, style, label in (("native_s_tg", "s-", "native llama-batched-bench S_TG"),
                              ("sequential_s", "^:", "llama-cpp-python Llama, one at a time (S)")):
        if all(getattr(p, key) is not None for p in points):
            speed.plot(sizes, [getattr(p, key) for p in points], style, label=label)
    speed.set(xscale="log", xlabel="batch size B", ylabel="tokens / s", title="throughput")
    latency.plot(sizes, [p.tpot_p50_s * 1000 for p in points], "o-", label="time per output token (p50)")
    latency.plot(sizes, [p.ttft_p50_s * 1000 for p in points], "o--", label="time to first token (p50)")
    latency.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="ms", title="latency")
    for ax in (speed, latency):
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tune_plot(tuning, chosen, path: Path) -> None:
    """`llamabatch tune --plot`: decode throughput and p50/p95 inter-token latency against B."""
    sizes = [p.batch_size for p in tuning.points]
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    speed.plot(sizes, [p.s_tg for p in tuning.points], "o-", label="decode tokens/s (S_TG)")
    speed.plot([chosen.batch_size], [chosen.s_tg], "r*", markersize=14, label=f"chosen: B = {chosen.batch_size}")
    speed.set(xscale="log", xlabel="batch size B", ylabel="tokens / s", title="throughput")
    latency.plot(sizes, [p.itl_p50_s * 1000 for p in tuning.points], "o-", label="inter-token latency p50")
    latency.plot(sizes, [p.itl_p95_s * 1000 for p in tuning.points], "o--", label="inter-token latency p95")
    latency.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="ms", title="latency")
    for ax in (speed, latency):
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
