"""Turning a sequence's token bytes into text: whole UTF-8 characters only, cut at stop strings
and (for code filled in the middle) at a line indented less than its block."""

from __future__ import annotations

import codecs


class TextStream:
    """Accumulates token pieces and hands out text deltas that are safe to show.

    A delta never ends inside a UTF-8 character (bytes of a split character wait for
    the rest), and never shows text that might turn out to be the start of a stop
    string. When a stop string appears, the text is cut just before it.

    With `n_indent`, every line after the first must be indented by at least that many spaces or
    tabs (llama-server's n_indent: an editor's completion ends where its block does); the first
    line that is not, a blank one included, is cut before its text, and a line's indentation is
    held back until its text shows how deep it is.

    A push costs its own piece, not the text so far: shown deltas are kept as a list, and
    only the unshown tail (which may begin a stop string) is searched.
    """

    def __init__(self, stop: tuple[str, ...] = (), n_indent: int = 0) -> None:
        self._split = b""  # bytes of a character split between tokens, waiting for the rest
        self._stop = stop
        self._n_indent = n_indent
        self._plain = not stop and not n_indent
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

    def push(self, piece: bytes, text: str | None = None) -> str:
        """Add one token's bytes; return the newly shown text (maybe empty). `text`: the piece
        decoded, where it is whole characters by itself (the engine keeps it a token, so most
        pushes decode nothing)."""
        new = text if text is not None and not self._split else self._decode(piece)
        if self._plain:  # the common case, inline: a push per token of every sequence
            if new:
                self._shown.append(new)
            return new
        pending = self._pending + new
        # A stop can only start in the unshown tail: shown text never holds a stop prefix.
        hits: list[tuple[int, str | None]] = [(i, s) for s in self._stop if (i := pending.find(s)) >= 0]
        hits += self._short_line(pending)
        if hits:
            at, self.stop_hit = min(hits)
            self.stopped = True
            self._pending = ""
            return self._show(pending[:at])
        keep = max(self._held_back(pending), self._open_line(pending))
        self._pending = pending[len(pending) - keep :]
        return self._show(pending[: len(pending) - keep])

    def _decode(self, piece: bytes, final: bool = False) -> str:
        """Decoded after the split character's bytes, the bytes of one still split kept (bad bytes
        replaced): what an incremental decoder does, without its Python-level call."""
        data = self._split + piece
        new, used = codecs.utf_8_decode(data, "replace", final)
        self._split = data[used:]
        return new

    def finish(self) -> str:
        """The sequence ended: show whatever was held back (a dangling byte shows as U+FFFD)."""
        tail = self._pending if self.stopped else self._pending + self._decode(b"", final=True)
        self._pending = ""
        return self._show(tail)

    def _short_line(self, pending: str) -> list[tuple[int, None]]:
        """Where the text begins of the first line indented less than n_indent (a line begins
        after a newline; its newline is still pending while its indentation is unknown)."""
        start = pending.find("\n") if self._n_indent else -1
        while start >= 0:
            line = pending[start + 1:]
            indent = len(line) - len(line.lstrip(" \t"))
            if indent < len(line) and indent < self._n_indent:
                return [(start + 1 + indent, None)]
            start = pending.find("\n", start + 1)
        return []

    def _open_line(self, tail: str) -> int:
        """Length of the end of `tail` from a newline whose line has no text yet (n_indent)."""
        at = tail.rfind("\n") if self._n_indent else -1
        return len(tail) - at if at >= 0 and not tail[at + 1:].strip(" \t") else 0

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
