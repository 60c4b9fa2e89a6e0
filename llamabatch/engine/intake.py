"""Intake: prompts and their sampling parameters become queued sequences, or are refused."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from ..chat import Tools
from ..chat.conversation import ChatPrompt
from ..errors import ChatTemplateError, ConstraintError, PromptError, SamplingError
from .sampling.chain import build_sampler
from .config import EngineConfig
from .sampling.constraints import Constraint, Grammars
from .media import MediaSpan, token_list
from .native.projector import Projector
from .runtime import Runtime
from .sampling.params import SamplingParams
from .scheduling.scheduler import Scheduler
from .sequence import Sequence, Status
from .sampling.thinking import Thought


@dataclass(frozen=True)
class Prompt:
    """A text prompt with its tokens, as Intake.prepare tokenized it ahead of add(); with images
    or audio, as Intake.media_prompt read it (their positions hold placeholders: media.placeholders)."""

    text: str
    tokens: list[int]
    media: tuple[MediaSpan, ...] = ()


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt that shows images or plays audio clips (each the bytes of a file: JPEG, PNG, ...;
    WAV, MP3, FLAC), for a model loaded with a projector that reads them (--mmproj). Each marker
    in the text (libmtmd's, <__media__>) is the next one; a text without markers gets them all
    first, as llama-mtmd-cli places them. With --chat the text is the user's message."""

    text: str
    media: tuple[bytes, ...]
    templated: bool = False  # the text is a whole rendered chat prompt (the server's): not templated again


PromptInput = str | list[int] | Prompt | MediaPrompt


class Intake:
    """Checks what a caller asks for against the loaded model (the context, the vocabulary, the
    adapters), tokenizes it, and queues its sequences with the scheduler."""

    def __init__(self, config: EngineConfig, runtime: Runtime, scheduler: Scheduler, grammars: Grammars) -> None:
        self.config, self.runtime, self.scheduler, self.grammars = config, runtime, scheduler, grammars
        self.vocab = runtime.vocab
        self._next_index = 0
        self._uids = itertools.count()

    def prepare(self, prompts: list[PromptInput], params: SamplingParams) -> list[PromptInput]:
        """The slow part of add(), done ahead on the caller's thread: text prompts tokenized (as
        Prompts) and the constraint compiled. Safe beside a running step (it reads the vocabulary
        and the chat template, and fills the compiled cache under its lock), so the server does it
        before the engine thread, which every stream waits on, takes the request. Raises what
        add() would for the constraint; other refusals are left to add().
        Images and clips are left to add() too: the projector encodes with the decode's threads,
        and beside a decode on the same cores both slow down (a server's captioning job answered
        18% more images a second with the encoding between steps, as `batch` and llama-server do)."""
        constraint = Constraint.of(params)
        if constraint is not None:
            self.grammars.compile(constraint)
        return [Prompt(p, self.tokenize_prompt(p)) if isinstance(p, str) and p else p for p in prompts]

    def add(
        self, prompt: PromptInput, params: SamplingParams | None = None, index: int | None = None,
        *, score_from: int | None = None, priority: int = 0, priority_class: str = "interactive", streamed: bool = True,
    ) -> list[Sequence]:
        """BatchEngine.add: its sequences, queued; nothing queued when it raises."""
        params = params or SamplingParams()
        if index is None:
            index, self._next_index = self._next_index, self._next_index + 1
        if isinstance(prompt, MediaPrompt):
            prompt = self.media_prompt(prompt)
        media = prompt.media if isinstance(prompt, Prompt) else ()
        prompt, tokens = self._tokens(prompt)
        if media:
            self._check_media(media, tokens, params)
        if score_from is None and params.prompt_logprobs is not None and len(tokens) > 1:
            score_from = 1  # a one-token prompt has nothing to score: its only entry is the null
        if score_from is not None and not 1 <= score_from < len(tokens):
            raise PromptError(f"nothing to score: tokens from {score_from} on of a {len(tokens)}-token prompt")
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab.n_vocab:  # sorted: the largest id last
            raise SamplingError(f"logit_bias: token {params.logit_bias[-1][0]} is outside the vocabulary (0..{self.vocab.n_vocab - 1})")
        constraint = Constraint.of(params)
        matchers = [self.grammars.matcher(constraint) for _ in range(params.n)] if constraint else [None] * params.n
        adapters = self.runtime.adapters.default if params.adapters is None else params.adapters
        self.runtime.adapters.check(adapters)
        samples = params.per_sample()
        sequences = [self._new_sequence(index, k, prompt, tokens, p, media) for k, p in enumerate(samples)]
        if params.n > self.config.n_parallel and self.scheduler.checkpoint_every is not None:
            for seq in sequences:  # samples that wait for a slot take the prompt from a checkpoint there
                seq.checkpoint_at = len(tokens) - 1
        budget = params.thinking_budget
        close = self.vocab.tokenize(budget.markup.closing, add_special=False) if budget else None
        for seq, matcher, p in zip(sequences, matchers, samples):
            seq.matcher, seq.adapters = matcher, adapters
            seq.thought = Thought(budget, close) if budget else None
            seq.special = (matcher is not None or p.logprobs is not None or p.max_tokens == 0 or budget is not None
                           or p.max_predict_s is not None or bool(p.shown_tokens))
            seq.priority, seq.priority_class, seq.streamed = priority, priority_class, streamed
            seq.whole_text = not (streamed or seq.special or p.stop or p.n_indent)
            seq.score_from = -1 if score_from is None else score_from
            if params.max_tokens == 0 and score_from is None:  # nothing to generate, nothing to score: done
                seq.status, seq.finish_reason = Status.FINISHED, "length"
            else:
                self.scheduler.add(seq)
        return sequences

    def _tokens(self, prompt: PromptInput) -> tuple[str, list[int]]:
        """The prompt as text and as tokens, refused when empty or longer than a sequence's context."""
        if isinstance(prompt, Prompt):
            prompt, tokens = prompt.text, prompt.tokens
        elif len(prompt) == 0:
            raise PromptError("empty prompt")
        elif isinstance(prompt, str):
            tokens = self.tokenize_prompt(prompt)
        else:
            tokens = [int(t) for t in prompt]
            prompt = self.vocab.detokenize(tokens)  # refuses ids outside the vocabulary
        ctx = self.runtime.ctx
        if len(tokens) > ctx.n_ctx_seq:
            hint = "raise --ctx" if ctx.kv_unified else "raise --ctx or lower --parallel"
            raise PromptError(f"prompt is {len(tokens)} tokens, longer than the {ctx.n_ctx_seq}-token context of one sequence ({hint})")
        return prompt, tokens

    def _check_media(self, media: tuple[MediaSpan, ...], tokens: list[int], params: SamplingParams) -> None:
        """Refuse what a prompt with images or audio cannot do here."""
        if media[-1].end >= len(tokens):
            raise PromptError("the prompt ends with an image or a clip: a prompt must go on with text after its last one (its first token is sampled from that text)")
        if params.prompt_logprobs is not None:
            raise PromptError("prompt_logprobs (echo) with images or audio: their positions have no tokens to score")
        n_ubatch = self.runtime.ctx.n_ubatch
        for span in media:
            if span.image.non_causal and span.image.n_tokens > n_ubatch:
                raise PromptError(f"an image of {span.image.n_tokens} positions, attended both ways, must fit one micro-batch: raise --ubatch-size to {span.image.n_tokens} (now {n_ubatch})")

    def _new_sequence(self, index: int, sample: int, prompt: str, tokens: list[int], params: SamplingParams,
                      media: tuple[MediaSpan, ...] = ()) -> Sequence:
        n_ctx_seq = self.runtime.ctx.n_ctx_seq
        sampler = build_sampler(params, n_ctx_seq, self.vocab, len(tokens))  # penalties look back over the prompt too, as llama.cpp's server does
        # max_tokens reached, or the context: the newest token is decoded at len(tokens) - 1 next step, in a cell it needs.
        max_len = min(len(tokens) + params.max_tokens, n_ctx_seq + 1)
        return Sequence(index, prompt, params, list(tokens), len(tokens), sampler=sampler, sample=sample, uid=next(self._uids),
                        max_len=max_len, media=media)

    def submit(
        self, prompts: Iterable[PromptInput], params: SamplingParams | list[SamplingParams] | None = None,
        *, priority: int = 0, priority_class: str = "interactive", streamed: bool = True,
    ) -> list[Sequence]:
        """BatchEngine.submit: a prompt refused comes back as finished sequences with its error."""
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        return [seq for i, (p, sp) in enumerate(zip(prompts, params)) for seq in self._submit_one(i, p, sp, priority, priority_class, streamed)]

    def _submit_one(self, index: int, prompt: PromptInput, params: SamplingParams, priority: int, priority_class: str,
                    streamed: bool) -> list[Sequence]:
        try:
            return self.add(prompt, params, index, priority=priority, priority_class=priority_class, streamed=streamed)
        except (PromptError, SamplingError, ConstraintError) as e:
            prompt = prompt.text if isinstance(prompt, (Prompt, MediaPrompt)) else prompt if isinstance(prompt, str) else ""
            return [
                Sequence(index, prompt, p, [], 0, sample=k, status=Status.FINISHED, finish_reason="error", error=str(e), refused=True)
                for k, p in enumerate(params.per_sample())
            ]

    def media_prompt(self, shown: MediaPrompt) -> Prompt:
        """The prompt read by the projector: its text tokens, its images and clips encoded
        (PromptError for one that cannot be, or a model without a projector)."""
        projector, prompt, text, add_special = self._projected(shown)
        tokens, spans = token_list(projector.read(text, list(shown.media), add_special), self.vocab.n_vocab)
        return Prompt(prompt, tokens, spans)

    def _projected(self, shown: MediaPrompt) -> tuple[Projector, str, str, bool]:
        """The projector; the prompt with its media markers placed; the text the projector reads
        (the chat template applied); and whether BOS goes first."""
        prompt = shown.text
        projector = self.runtime.projector
        if projector is None:
            raise PromptError(f"{self.runtime.model.path.name} was loaded without a projector: images and audio need --mmproj (or mmproj in models.toml)")
        if projector.marker not in prompt:  # as llama-mtmd-cli: the media first
            prompt = projector.marker * len(shown.media) + prompt
        if shown.templated:
            return projector, prompt, prompt, self.runtime.chat is None or self.runtime.chat.adds_bos(prompt)
        if self.config.chat:
            text = self.chat_prompt([{"role": "user", "content": prompt}]).text
            return projector, prompt, text, self.runtime.chat.adds_bos(text)
        return projector, prompt, prompt, True

    def n_positions(self, prompt: PromptInput) -> int:
        """BatchEngine.prompt_length: the positions it fills, an image's and a clip's counted from
        their sizes without encoding them."""
        if isinstance(prompt, MediaPrompt):
            projector, _, text, add_special = self._projected(prompt)
            return projector.count(text, list(prompt.media), add_special)
        if isinstance(prompt, Prompt):
            return len(prompt.tokens)
        return len(self.tokenize_prompt(prompt) if isinstance(prompt, str) else prompt)

    def tokenize_prompt(self, prompt: str) -> list[int]:
        if self.config.chat:
            return self.chat_prompt([{"role": "user", "content": prompt}]).tokens
        return self.vocab.tokenize(prompt)

    def chat_prompt(
        self, messages: list[dict], tools: Tools | None = None, template_kwargs: dict | None = None, reasoning_budget: int = -1,
    ) -> ChatPrompt:
        """BatchEngine.chat_prompt."""
        chat = self.runtime.chat
        if chat is None:
            raise ChatTemplateError(f"{self.runtime.model.path.name} has no chat template (give --chat-template, set chat_template in models.toml, or drop --chat)")
        return chat.prompt(messages, tools, template_kwargs, reasoning_budget)
