"""Fill-in-the-middle prompts: the text before and after a gap, laid out with the model's FIM
tokens so that it writes the middle. Code editors ask for these (llama-server's /infill, OpenAI's
`suffix`); the prompt is then decoded as any other.

The layout is llama-server's, so that a model answers here as it does there (the repository-level
pattern of Qwen2.5-Coder's report, arXiv 2409.12186, where the model has its tokens):

    [REP]myproject\\n  [SEP]file\\n file's text ...  [SEP]filename\\n
    [BOS] [PRE] prefix prompt [SUF] suffix [MID]

Without a separator token each extra file is announced by a plain-text snippet line instead; with
spm (suffix first), [SUF] suffix comes before [PRE] prefix. Prefix and suffix are cut to what
one n_batch chunk holds, 3:1 (the prefix's end and the suffix's start are kept), and the extra
files' text to what the sequence's context has left, its end kept (the files named last are the
nearest)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PromptError
from .native.handles import Vocab

NONE = -1  # llama.cpp's LLAMA_TOKEN_NULL
SNIPPET = "\n\n--- snippet ---\n\n"  # an extra file's header where the model has no separator token
REPOSITORY = "myproject\n"  # the repository name llama-server gives (it takes none from the request)
CURRENT_FILE = "filename\n"  # and the current file's


@dataclass(frozen=True)
class ExtraFile:
    """Context from another file, ahead of the prefix."""

    text: str
    filename: str = "tmp"


@dataclass(frozen=True)
class Infill:
    """A gap to fill: the text before it (or its tokens), after it, files around it, and text that
    starts the middle (llama-server's `prompt`)."""

    prefix: str | list[int]
    suffix: str
    extra: Sequence[ExtraFile] = ()
    prompt: str = ""
    spm: bool = False  # suffix, prefix, middle: the order some models were trained on


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle tokens (NONE where it has none)."""

    pre: int
    suf: int
    mid: int
    rep: int
    sep: int

    @classmethod
    def of(cls, vocab: Vocab) -> FimTokens:
        return cls(*vocab.fim)

    def require(self) -> None:
        """A PromptError naming the tokens infilling needs that the model lacks."""
        missing = [name for name, token in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if token == NONE]
        if missing:
            raise PromptError(f"this model cannot fill in the middle: its vocabulary has no FIM {', '.join(missing)} token")


def infill_tokens(vocab: Vocab, gap: Infill, n_batch: int, n_ctx_seq: int, max_tokens: int) -> list[int]:
    """The prompt that asks the model for the middle of `gap`, within one sequence's context
    (`max_tokens`: the answer's room, 0 when unbounded)."""
    fim = FimTokens.of(vocab)
    fim.require()
    prompt = vocab.tokenize(gap.prompt, add_special=False)  # (the request's own text: its special tokens are read, as llama-server reads them)
    prefix = gap.prefix if isinstance(gap.prefix, list) else vocab.tokenize(gap.prefix, add_special=False, parse_special=False)
    suffix = vocab.tokenize(gap.suffix, add_special=False, parse_special=False)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)):]
    suffix = suffix[:max(0, n_batch // 4 - (2 + len(prompt)))]
    before, after = [fim.pre, *prefix, *prompt], [fim.suf, *suffix]
    if gap.spm:
        before, after = after, before
    if vocab.add_bos:
        before.insert(0, vocab.bos)
    extra = _extra_tokens(vocab, fim, gap.extra)
    room = max(0, n_ctx_seq - n_batch - 2 * max_tokens)
    return extra[len(extra) - min(len(extra), room):] + before + after + [fim.mid]


def _extra_tokens(vocab: Vocab, fim: FimTokens, files: Sequence[ExtraFile]) -> list[int]:
    def text(s: str) -> list[int]:
        return vocab.tokenize(s, add_special=False, parse_special=False)

    tokens = [fim.rep, *text(REPOSITORY)] if fim.rep != NONE else []
    for file in files:
        tokens += [fim.sep, *text(file.filename + "\n")] if fim.sep != NONE else text(SNIPPET)
        tokens += text(file.text)
    if fim.sep != NONE:
        tokens += [fim.sep, *text(CURRENT_FILE)]
    return tokens
