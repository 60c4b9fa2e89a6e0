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

    @property
    def lost(self) -> int:
        """Cells it fills beyond its positions (M-RoPE's grid: n_tokens cells, max(rows, columns)
        positions); 0 for an image laid out one position a cell."""
        return self.image.n_tokens - self.image.n_pos


def position(spans: tuple[MediaSpan, ...], n: int) -> int:
    """Where token n of a sequence with these images sits: n, less what each M-RoPE image before
    it lost (a token within an image: where the image starts; all its cells hold that position)."""
    lost = 0
    for span in spans:
        if n < span.end:
            return min(n, span.start) - lost if span.lost else n - lost
        lost += span.lost
    return n - lost


def cells_through(spans: tuple[MediaSpan, ...], last: int) -> int:
    """How many leading tokens a sequence with these images holds when the last position its
    memory holds is `last` (-1: none): position()'s inverse, an M-RoPE image counted whole."""
    lost = 0
    for span in spans:
        first = span.start - lost
        if last < first:
            break
        if span.lost and last < first + span.image.n_pos:
            return span.end
        lost += span.lost
    return last + 1 + lost


def whole(spans: tuple[MediaSpan, ...], n: int) -> int:
    """n, or where the M-RoPE image it cuts into starts: such an image's cells all hold one
    position, so memory is cut before it or after it, never within."""
    return next((span.start for span in spans if span.lost and span.start < n < span.end), n)


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
