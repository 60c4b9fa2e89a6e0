"""Find which held token list shares the longest prefix with a prompt, without a scan.

Holders (a free slot's cached KV, a sequence still prefilling its prompt) are filed under hashes
of their prefixes: the first k tokens for k = 1 .. BLOCK - 1 (so a short prompt finds a cache
that begins with it), then every BLOCK tokens, each hash chained on the one before, as vLLM
keys its prefix cache by hashed blocks. A lookup walks the prompt's keys until one is missing:
its cost grows with the shared length, not with the number of holders. The last BLOCK - 1
tokens of a match are compared directly, and the chosen holder's prefix is verified token by
token, so a hash collision can cost a missed share but never a wrong one.

A holder's namespace (the LoRA adapters its KV was computed under) seeds its hashes, and is
compared too: a prefix is only shared within one namespace.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from ..sequence import Sequence

BLOCK = 8  # keys every BLOCK tokens; matches up to BLOCK - 1 tokens past a key are found by comparison
# Shorter shared prefixes are decoded again: waiting for a leader and pausing its prefill at
# the shared length, or giving up another slot's cache, costs more than a few tokens of prefill.
MIN_SHARED_PREFIX = 8
MAX_EXTENDED = 8  # holders a lookup compares, deepest keys first: a few suffice, and it bounds the cost

H = TypeVar("H")


def prefix_keys(tokens: list[int], namespace: Hashable = ()) -> Iterator[tuple[int, int]]:
    """(k, key of tokens[:k]) for k = 1 .. BLOCK - 1, then every multiple of BLOCK."""
    for k in range(1, min(len(tokens), BLOCK - 1) + 1):
        yield k, hash((namespace, *tokens[:k]))
    key = hash(namespace)
    for k in range(BLOCK, len(tokens) + 1, BLOCK):
        key = hash((key, *tokens[k - BLOCK : k]))
        yield k, key


class PrefixIndex(Generic[H]):
    """Holders filed by the prefixes of their token lists."""

    def __init__(self, tokens_of: Callable[[H], list[int]], namespace_of: Callable[[H], Hashable] = lambda holder: ()) -> None:
        self._tokens_of = tokens_of
        self._namespace_of = namespace_of
        self._holders: dict[int, dict[H, None]] = {}  # key -> holders, in insertion order
        self._keys: dict[H, list[int]] = {}  # holder -> its keys, to remove it

    def __contains__(self, holder: H) -> bool:
        return holder in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, holder: H) -> None:
        keys = self._keys[holder] = []
        for _, key in prefix_keys(self._tokens_of(holder), self._namespace_of(holder)):
            self._holders.setdefault(key, {})[holder] = None
            keys.append(key)

    def remove(self, holder: H) -> None:
        for key in self._keys.pop(holder, ()):
            holders = self._holders[key]
            del holders[holder]
            if not holders:
                del self._holders[key]

    def clear(self) -> None:
        self._holders.clear()
        self._keys.clear()

    def matches(self, tokens: list[int], namespace: Hashable = ()) -> Iterator[tuple[int, H]]:
        """(shared length, holder) pairs, longest shares first; each holder once, and at most
        MAX_EXTENDED of them, so a lookup costs the same however many holders share a prefix."""
        found: list[tuple[int, dict[H, None]]] = []
        for k, key in prefix_keys(tokens, namespace):
            holders = self._holders.get(key)
            if holders is None:
                break
            found.append((k, holders))
        seen: set[H] = set()
        for depth, holders in reversed(found):
            ranked = []
            for holder in holders:
                if len(seen) == MAX_EXTENDED:
                    break
                if holder not in seen:
                    seen.add(holder)
                    shared = self._shared(tokens, holder, depth) if self._namespace_of(holder) == namespace else 0
                    ranked.append((shared, holder))
            ranked.sort(key=lambda pair: -pair[0])  # stable: ties keep insertion order
            yield from ranked
            if len(seen) == MAX_EXTENDED:
                return

    def _shared(self, tokens: list[int], holder: H, depth: int) -> int:
        """The exact shared length with a holder filed under tokens[:depth]; 0 if a hash lied."""
        held = self._tokens_of(holder)
        if held[:depth] != tokens[:depth]:
            return 0
        n, limit = depth, min(len(held), len(tokens))
        while n < limit and held[n] == tokens[n]:
            n += 1
        return n


def worth_sharing(seq: Sequence) -> int:
    """The shortest common prefix worth reusing for seq: MIN_SHARED_PREFIX, or all of a shorter prompt."""
    return min(MIN_SHARED_PREFIX, len(seq.tokens))
