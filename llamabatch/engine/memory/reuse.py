"""What an admitted sequence finds in its slot: the prefix the slot kept, or more of its prompt
from the prompt cache; what a slot is about to lose goes to the prompt cache first."""

from __future__ import annotations

from ..adapters import AdapterSet
from .streams import Memory
from .prompt_cache import MIN_TOKENS, CachedPrompt, PromptCache
from ..results import RunStats
from ..scheduling.scheduler import Scheduler
from ..sequence import Sequence


class PrefixReuse:
    def __init__(self, memory: Memory, scheduler: Scheduler, prompt_cache: PromptCache | None, stats: RunStats,
                 fixed_adapters: int = 0) -> None:
        """`fixed_adapters`: adapter ids below it are the engine's from its start; a prompt decoded
        under one loaded later is not kept, since the cache's files name adapters by id and the next
        process may give that id to another."""
        self.memory, self.scheduler, self.prompt_cache, self.stats = memory, scheduler, prompt_cache, stats
        self.fixed_adapters = fixed_adapters

    def resume(self, seq: Sequence) -> None:
        """Give an admitted sequence its memory (memory.resume): what its slot keeps of the
        prefix the scheduler matched, or more of its prompt from the prompt cache. Whatever the
        slot held that the sequence does not keep goes to the prompt cache first."""
        cache = self.prompt_cache
        if cache is not None and seq.swapped is None:
            slot = self.scheduler.slot_of(seq)
            if seq.n_past < len(slot.cached):
                self._keep(cache, seq.seq_id, slot.cached, slot.adapters)
            if seq.leader is None:  # (a leader, admitted before it, looked here already)
                self._restore(seq, cache)
        self.memory.place(seq.seq_id, seq.grid)  # (the slot's or the cache's memory agrees with it where it is kept)
        self.memory.resume(seq)
        self.stats.prompt_tokens_reused += seq.n_cached

    def keep_free_slots(self) -> None:
        """Every free slot's cached prompt into the prompt cache (before the slots lose them)."""
        cache = self.prompt_cache
        if cache is not None:
            for slot in self.scheduler.slots.cached_slots():
                self._keep(cache, slot.seq_id, slot.cached, slot.adapters)

    def drop_cached_prefixes(self) -> None:
        """Free the KV that finished sequences left in their slots for later prompts."""
        for seq_id in self.scheduler.slots.evict_cached():
            self.memory.clear(seq_id)

    def _keep(self, cache: PromptCache, seq_id: int, tokens: list[int], adapters: AdapterSet) -> None:
        """The stream's memory (it holds exactly `tokens`) into the prompt cache."""
        if len(tokens) < MIN_TOKENS or cache.holds(tokens, adapters) or self.memory.held(seq_id) != len(tokens):
            return
        if any(id >= self.fixed_adapters for id, _ in adapters):
            return
        state, checkpoints, grid = self.memory.snapshot(seq_id)
        if state:
            cache.keep(CachedPrompt.of(tokens, adapters, state, checkpoints, grid))

    def _restore(self, seq: Sequence, cache: PromptCache) -> None:
        """Where a cached prompt gives more of this one than its slot does, it replaces the slot's
        memory, and seq.n_past becomes the prefix they share (memory.resume then cuts it there)."""
        limit = min(len(seq.tokens) - 1, seq.shareable)  # as the scheduler's match: the newest token is decoded again
        if limit < MIN_TOKENS:
            return
        best, n_best, n_shared = None, self.memory.reusable(seq.seq_id, seq.n_past) + MIN_TOKENS - 1, 0  # worth a restore
        for shared, entry in cache.candidates(seq.tokens[:limit], seq.adapters):
            n = self.memory.reusable_from(shared, entry.n_tokens, entry.positions)
            if n > n_best:
                best, n_best, n_shared = entry, n, shared
        if best is None:
            cache.stats.misses += 1
            return
        loaded = cache.load(best)
        held = self.memory.put_back(seq.seq_id, *loaded, best.grid) if loaded is not None else 0
        seq.hold(n_shared)
        if held != best.n_tokens:
            if loaded is not None:
                cache.refuse(best, "llama.cpp did not take its state")
            self.memory.clear(seq.seq_id)
            seq.hold(0)
