"""Turning a sequence's token bytes into text: whole UTF-8 characters only, cut at stop strings."""

from __future__ import annotations

import codecs


class TextStream:
    """Accumulates token pieces and hands out text deltas that are safe to show.

    A delta never ends inside a UTF-8 character (bytes of a split character wait for
    the rest), and never shows text that might turn out to be the start of a stop
    string. When a stop string appears, the text is cut just before it.

    A push costs its own piece, not the text so far: shown deltas are kept as a list, and
    only the unshown tail (which may begin a stop string) is searched.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._whole = True  # the decoder holds no bytes of a split character
        self._stop = stop
        self._shown: list[str] = []
        self._pending = ""  # decoded but not shown: it could begin a stop string
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that cut it (Anthropic's stop_sequence)

    @property
    def text(self) -> str:
        """All the text so far, cut at a stop string (held-back text included)."""
        if len(self._shown) > 1:
            self._shown[:] = ["".join(self._shown)]
        return (self._shown[0] if self._shown else "") + self._pending

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly shown text (maybe empty)."""
        if self._whole:
            try:  # most pieces are whole characters: a third of the incremental decoder's cost
                new = piece.decode()
            except UnicodeDecodeError:  # a split character (or bad bytes)
                new = self._decode(piece)
        else:
            new = self._decode(piece)
        if not self._stop:  # the common case, inline: a push per token of every sequence
            if new:
                self._shown.append(new)
            return new
        pending = self._pending + new
        # A stop can only start in the unshown tail: shown text never holds a stop prefix.
        hits = [(i, s) for s in self._stop if (i := pending.find(s)) >= 0]
        if hits:
            at, self.stop_hit = min(hits)
            self.stopped = True
            self._pending = ""
            return self._show(pending[:at])
        keep = self._held_back(pending)
        self._pending = pending[len(pending) - keep :]
        return self._show(pending[: len(pending) - keep])

    def _decode(self, piece: bytes) -> str:
        """Through the incremental decoder, which holds a split character's bytes (and replaces bad ones)."""
        new = self._decoder.decode(piece)
        self._whole = not self._decoder.getstate()[0]
        return new

    def finish(self) -> str:
        """The sequence ended: show whatever was held back (a dangling byte shows as U+FFFD)."""
        tail = self._pending if self.stopped else self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return self._show(tail)

    def _held_back(self, tail: str) -> int:
        """Length of the longest end of `tail` that could begin a stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _show(self, delta: str) -> str:
        if delta:
            self._shown.append(delta)
        return delta
