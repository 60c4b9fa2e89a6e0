"""A prompt's images in its sequence: where each sits among its tokens, and the token ids that
stand for its positions (the stepper decodes its embeddings there, apart from the step's batch)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

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


class GridImage(NamedTuple):
    """An M-RoPE image among a sequence's tokens: cells start .. end - 1, n_pos positions (fewer:
    Qwen-VL's grid of rows × columns cells takes max(rows, columns)). What a stream's positions
    are counted through (a Sequence's grid; the prompt cache keeps it beside a state)."""

    start: int
    end: int
    n_pos: int

    @property
    def lost(self) -> int:
        """Cells it fills beyond its positions."""
        return self.end - self.start - self.n_pos


Grid = tuple[GridImage, ...]  # a sequence's M-RoPE images, in order (empty: a position a token)


def grid(spans: tuple[MediaSpan, ...]) -> Grid:
    """The images among these that fill fewer positions than cells."""
    return tuple(GridImage(span.start, span.end, span.image.n_pos) for span in spans if span.image.n_pos < span.image.n_tokens)


def position(images: Grid, n: int) -> int:
    """Where token n of a sequence with these images sits: n, less what each image before it
    lost (a token within an image: where the image starts; all its cells hold that position)."""
    lost = 0
    for image in images:
        if n < image.end:
            return min(n, image.start) - lost
        lost += image.lost
    return n - lost


def cells_through(images: Grid, last: int) -> int:
    """How many leading tokens a sequence with these images holds when the last position its
    memory holds is `last` (-1: none): position()'s inverse, an image counted whole."""
    lost = 0
    for image in images:
        first = image.start - lost
        if last < first:
            break
        if last < first + image.n_pos:
            return image.end
        lost += image.lost
    return last + 1 + lost


def whole(images: Grid, n: int) -> int:
    """n, or where the image it cuts into starts: an image's cells all hold one position, so
    memory is cut before it or after it, never within."""
    return next((image.start for image in images if image.start < n < image.end), n)


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
