"""The step budget in time: how many prompt tokens a step may carry beside the decoding sequences
so that it ends within a target, from what steps cost on this machine and model.

A step is the gap every decoding sequence waits between two of its tokens. A step carrying a
whole n_batch chunk of a long prompt takes many decode steps' time (Gemma 3 270M on 2 cores:
60 ms for 7 decode rows, over a second with 505 prompt tokens beside them), so every stream
stalls for as long as the prompt has chunks. With a time budget a prompt is read in pieces that
keep each step near the target, and the streams keep flowing (vLLM's chunked prefill and
Sarathi-Serve's stall-free batching bound a step's tokens the same way).

The budget keeps only streams flowing: beside decoders whose end alone is awaited (a request
answered whole, a batch job's line) a prompt is read in whole chunks. Their total time is about
the same either way (the prompt's work is done beside them, in pieces or at once), while pieces
cost the prompt its first token later and every extra step another pass over the weights.
"""

from __future__ import annotations

# A step's target, when none is set: this many times a step of the decode rows alone. On a CPU
# every decode row costs real work (Gemma 3's 262k-token output layer), so time the streams get
# while a prompt is read is time the prompt waits for: at 3 decode steps (2-core EPYC, Gemma 3
# 270M, 7 streams, a 3,000-token prompt) the streams' worst gap fell from 12.6 to 5.7 of their
# usual gaps but the prompt's first token came 2.3x later; at 400 ms (6.7 decode steps) 7.6 and
# 1.13x (`python -m benchmarks stall`). Six keeps a long prompt's wait within an eighth or so.
AUTO_TARGET = 6.0
# Moving averages over steps. A decode step's time is steady (many steps, a slow average, so that
# one slow step does not make prompt tokens look free); a prompt token's is weighted to the latest:
# it costs more with every chunk (it attends to all the prompt before it), and a lagging average
# overshoots the target.
DECODE_MEMORY = 0.9
TOKEN_MEMORY = 0.3
# Prompt tokens a step with decoders carries whatever the budget says (a prompt always
# progresses), the chunk that measures a prompt token's cost when none is known yet, and how much
# a step's prompt tokens may grow over the last step's (one noisy measurement moves it little).
MIN_TOKENS = 16
PROBE_TOKENS = 32
MAX_GROWTH = 2


class StepBudget:
    """Learns from the engine's own steps what a step of decode rows costs, and what each prompt
    token beside them adds; says how many prompt tokens the next step may carry. `target`: the
    step time to keep to, in seconds (None: AUTO_TARGET decode steps; 0: no time budget)."""

    def __init__(self, target: float | None = None) -> None:
        self.target = target
        self.decode_s: float | None = None  # a step of decode rows alone
        self.token_s: float | None = None  # what a prompt token adds to a step
        self._last = 0  # prompt tokens of the last step beside decoders

    @property
    def on(self) -> bool:
        """Prompts are read within a time budget, and share it (else: whole chunks, oldest first)."""
        return self.target != 0

    def observe(self, n_decoding: int, n_prompt: int, seconds: float) -> None:
        """A step of n_decoding decode rows and n_prompt prompt tokens took `seconds`."""
        if n_prompt == 0:
            self.decode_s = _moved(self.decode_s, seconds, DECODE_MEMORY)
        elif n_decoding and self.decode_s is not None:
            self.token_s = _moved(self.token_s, max(seconds - self.decode_s, 0.0) / n_prompt, TOKEN_MEMORY)
        self._last = n_prompt if n_decoding else 0

    def prompt_tokens(self, n_streamed: int, most: int) -> int:
        """The prompt tokens the next step may carry beside decode rows, n_streamed of them read
        as they come (Sequence.streamed), at most `most` (what n_batch leaves): all of them with no
        stream to keep flowing (a decoder whose end alone is awaited loses nothing when a step
        is long), or no time budget."""
        if not n_streamed or not self.on or self.decode_s is None:
            return most
        if self.token_s is None:
            return min(most, PROBE_TOKENS)
        target = self.target if self.target is not None else AUTO_TARGET * self.decode_s
        room = target - self.decode_s
        fits = MIN_TOKENS if room <= 0 else int(room / self.token_s) if self.token_s > 0 else most
        return min(most, max(MIN_TOKENS, fits), max(MIN_TOKENS, MAX_GROWTH * self._last) if self._last else most)


def _moved(average: float | None, value: float, memory: float) -> float:
    return value if average is None else memory * average + (1 - memory) * value


def shares(wants: list[int], budget: int) -> list[int]:
    """The budget's prompt tokens shared out among prompts that want `wants` more (in admission
    order): half of it equally (each prompt being read progresses; none waits for another to
    finish), the rest to the oldest first (so the first prompts finish and start decoding early).
    A prompt never gets more than it wants."""
    given = [0] * len(wants)
    fair, left = budget // 2, budget - budget // 2
    open_ = sorted(range(len(wants)), key=wants.__getitem__)  # the smallest wants first: their spare goes on
    for k, i in enumerate(open_):
        given[i] = min(wants[i], fair // (len(open_) - k))
        fair -= given[i]
    left += fair
    for i, want in enumerate(wants):
        extra = min(want - given[i], left)
        given[i] += extra
        left -= extra
    return given
