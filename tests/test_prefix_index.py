"""PrefixIndex: the longest shared prefix without a scan, checked against a scan."""

from __future__ import annotations

import random

import llamabatch.engine.scheduling.prefix_index as prefix_index
from llamabatch.engine.scheduling.prefix_index import PrefixIndex
from llamabatch.engine.sequence import common_prefix


class Holder:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens


def index_of(holders: list[Holder]) -> PrefixIndex[Holder]:
    index = PrefixIndex(lambda h: h.tokens)
    for h in holders:
        index.add(h)
    return index


def random_holders(rng: random.Random, n: int, stems: list[list[int]]) -> list[Holder]:
    return [Holder(rng.choice(stems)[: rng.randrange(1, 41)] + [rng.randrange(50) for _ in range(rng.randrange(30))])
            for _ in range(n)]


def check_against_a_scan(holders: list[Holder], stems: list[list[int]], rng: random.Random, slack: int) -> None:
    index = index_of(holders)
    for _ in range(300):
        prompt = rng.choice(stems)[: rng.randrange(1, 41)] + [rng.randrange(50) for _ in range(rng.randrange(10))]
        best = max(common_prefix(h.tokens, prompt) for h in holders)
        n, holder = next(index.matches(prompt), (0, None))
        assert best - slack <= n <= best
        assert holder is None or n == common_prefix(holder.tokens, prompt)  # what it says is exact


def test_the_first_match_is_the_longest_share_of_any_holder():
    rng = random.Random(0)
    stems = [[rng.randrange(50) for _ in range(40)] for _ in range(40)]
    check_against_a_scan(random_holders(rng, 30, stems), stems, rng, slack=0)


def test_with_many_holders_under_one_key_a_match_is_at_most_a_block_short():
    """Past its deepest key the index compares MAX_EXTENDED candidates, not all: bounded work."""
    rng = random.Random(1)
    stems = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    check_against_a_scan(random_holders(rng, 200, stems), stems, rng, slack=prefix_index.BLOCK - 1)


def test_matches_come_longest_first_each_holder_once():
    a, b, c = Holder(list(range(30))), Holder(list(range(12)) + [99] * 5), Holder([0, 1, 2, 7])
    found = list(index_of([a, b, c]).matches(list(range(20))))
    assert [n for n, _ in found] == [20, 12, 3]
    assert [h for _, h in found] == [a, b, c]


def test_a_short_prompt_finds_a_longer_cache_that_begins_with_it():
    cache = Holder([1, 5, 9, 4, 4, 4, 4, 4, 4, 4, 4])
    assert next(index_of([cache]).matches([1, 5, 9])) == (3, cache)


def test_removed_holders_are_not_found():
    a, b = Holder(list(range(20))), Holder(list(range(10)))
    index = index_of([a, b])
    index.remove(a)
    assert [h for _, h in index.matches(list(range(20)))] == [b]
    assert a not in index and len(index) == 1
    index.clear()
    assert list(index.matches(list(range(20)))) == []


def test_a_hash_collision_is_never_taken_for_a_share(monkeypatch):
    """Every prefix hashes alike: the index finds candidates, the token check refuses them."""
    monkeypatch.setattr(prefix_index, "hash", lambda value: 7, raising=False)
    other = Holder([5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert [n for n, _ in index_of([other]).matches([1, 2, 3, 4, 5, 6, 7, 8, 9])] == [0]
