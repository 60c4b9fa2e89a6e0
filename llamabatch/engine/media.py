"""A prompt's images in its sequence: where each sits among its tokens, and the token ids that
stand for its positions (the stepper decodes its embeddings there, apart from the step's batch)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .native.projector import Encoded, Piece

# Token ids that stand for an image's positions: above the vocabulary, so no text ever matches
# one, and kept within int32. Derived from the image's hash, so the same image after the same
# text shares its prefix (and its KV) as text does, and a different image parts at its first position.
_PLACEHOLDER_RANGE = 2**31 - 2**24


@dataclass(frozen=True)
class MediaSpan:
    """An image at positions start .. start + image.n_tokens - 1 of its sequence."""

    start: int
    image: Encoded

    @property
    def end(self) -> int:
        return self.start + self.image.n_tokens


def placeholders(image: Encoded, n_vocab: int) -> list[int]:
    """The token ids an image's positions take in its sequence's token list."""
    digest = hashlib.blake2b(image.key.encode(), digest_size=8).digest()
    first = int.from_bytes(digest, "little") % _PLACEHOLDER_RANGE
    return [n_vocab + (first + i) % _PLACEHOLDER_RANGE for i in range(image.n_tokens)]


def token_list(pieces: list[Piece], n_vocab: int) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """A prompt read by the projector as one token list (an image's positions hold its
    placeholders) and the spans its images fill."""
    tokens: list[int] = []
    spans = []
    for piece in pieces:
        if isinstance(piece, Encoded):
            spans.append(MediaSpan(len(tokens), piece))
            tokens += placeholders(piece, n_vocab)
        else:
            tokens += piece
    return tokens, tuple(spans)
