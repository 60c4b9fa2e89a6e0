"""Turning a sequence's token bytes into text: whole UTF-8 characters only, cut at stop strings."""

from __future__ import annotations

import codecs


class TextStream:
    """Accumulates token pieces and hands out text deltas that are safe to show.

    A delta never ends inside a UTF-8 character (bytes of a split character wait for
    the rest), and never shows text that might turn out to be the start of a stop
    string. When a stop string appears, the text is cut just before it.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self.text = ""
        self.stopped = False
        self._shown = 0  # length of self.text already handed out

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly shown text (maybe empty)."""
        self.text += self._decoder.decode(piece)
        if self._cut_at_stop():
            return self._flush()
        return self._take(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The sequence ended: show whatever was held back (a dangling byte shows as U+FFFD)."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._flush()

    def _cut_at_stop(self) -> bool:
        # A stop can only start in the not-yet-shown tail: shown text never holds a stop prefix.
        hits = [i for i in (self.text.find(s, self._shown) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could begin a stop string."""
        tail = self.text[self._shown :]
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _take(self, end: int) -> str:
        delta = self.text[self._shown : end]
        self._shown = end
        return delta

    def _flush(self) -> str:
        return self._take(len(self.text))
