"""Scoring prompts: which tokens of an item are decoded and from where they are scored, and an
item's total over its sequences. The log-probabilities themselves are taken in the step loop
(sampling.score_rows), from the rows a scored prompt asks logits for."""

from __future__ import annotations

from ..errors import PromptError
from .native.handles import Vocab
from .results import Score
from .sequence import Sequence


def scored_prompts(vocab: Vocab, item: str | tuple[str, str], bos: bool, chunk: int | None) -> list[tuple[list[int], int]]:
    """The token lists to decode for one item, each with the index its scoring starts from.

    A (context, continuation) pair is tokenized as lm-evaluation-harness does: the context's
    trailing spaces move to the continuation, the whole string is tokenized, and the tokens past
    the context's own are the continuation's. A text is scored from its second token, or in
    llama-perplexity's windows when chunk is given."""
    if isinstance(item, str):
        tokens = vocab.tokenize(item, add_special=bos)
        if chunk is None:
            return [(tokens, 1)]
        if len(tokens) < chunk:
            raise PromptError(f"the text is {len(tokens)} tokens: a {chunk}-token window needs at least {chunk}")
        first = [vocab.bos] if bos else []
        windows = [tokens[i * chunk : (i + 1) * chunk] for i in range(len(tokens) // chunk)]
        return [(first + w[len(first):], chunk // 2 + 1) for w in windows]
    context, continuation = item
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    head = vocab.tokenize(context, add_special=bos)
    whole = vocab.tokenize(context + continuation, add_special=bos)
    if not head:
        raise PromptError("empty context: give one, or score with a BOS token")
    if len(whole) <= len(head):
        raise PromptError("empty continuation: nothing to score")
    return [(head + whole[len(head):], len(head))]


def total_score(index: int, sequences: list[Sequence]) -> Score:
    """One item's score over its sequences (llama-perplexity windows: several)."""
    parts = [seq.scored for seq in sequences]
    error = next((seq.error for seq in sequences if seq.error), None)
    return Score(index, sum(p.logprob for p in parts), sum(p.n_tokens for p in parts), all(p.greedy for p in parts), error)
