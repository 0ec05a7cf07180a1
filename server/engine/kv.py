"""The host's record of the graph's KV slots (the caches themselves live with the graph): per slot, the token ids it
holds, to find the longest common prefix with the next prompt, and the last prefilled prompt's logits, so the same
prompt again (the 2nd..nth choice of a request, a regenerated answer) costs no graph call.

- The last prompt token is always recomputed when its logits were not kept: they are what the first token is
  sampled from, and the graph does not hand back logits it computed earlier.
- The graph has the last word on what it can keep: `rewind` answers where it can really continue (server.graphs.base).
- An idle slot keeps its KV until a newcomer needs it: `KVSlots.choose` gives a prompt the free slot holding the
  longest prefix of it (a user's next turn finds its own conversation) when that prefix is at least half the prompt.
  The half is llama.cpp's --slot-prompt-similarity 0.5: without it, a shared BOS or system prompt would send every
  newcomer into some other user's conversation and evict it, while an empty slot stood by.
- Else a slot is evicted, the cheapest to lose first: an empty one, then one whose cache is *short* (no longer than
  one prefill call: `short`, the largest prefill bucket), the least recently used of those, and only then a long one
  (least recently used). A coding agent's 10-30k-token prefix costs tens of prefill calls to rebuild; its probes and
  side requests (`max_tokens: 1`, a title) and short chats churn the short slots and leave it in place. Plain LRU
  would hand such a request the agent's slot whenever the agent was the one idle longest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from server.engine.types import KVUsage

if TYPE_CHECKING:
    from server.graphs.base import KVPool

log = logging.getLogger(__name__)


class KVSlot:
    """Token ids whose KV one graph slot holds (`tokens[p]` sits at position p), and the kept last-prefill logits.
    At an image's soft tokens `tokens` holds the image's content keys instead (negative ints, server.engine.types
    .image_key): the same placeholder ids from another image never match."""

    __slots__ = ("index", "tokens", "last_used", "_rewind", "_kept")

    def __init__(self, rewind: Callable[[int], int], index: int = 0) -> None:
        self.index = index  # the graph's slot id
        self.tokens: list[int] = []
        self.last_used = 0  # when it was last given to a sequence (a counter): the least recent is evicted first
        self._rewind = rewind  # the graph's, for this slot: forget positions >= p, answer where the next write starts
        self._kept: tuple[list[int], torch.Tensor] | None = None  # (the last prefilled prompt, its last logits [1, 1, V])

    def match(self, prompt: Sequence[int], prefix_reuse: bool = True) -> int:
        """How many of `prompt`'s positions this slot could skip (before the graph's say): the whole prompt when it is
        the kept one, else the common prefix short of the last token. No graph call."""
        if not prefix_reuse:
            return 0
        ids = list(prompt)
        if self.kept_logits(ids) is not None:
            return len(ids)
        return _common(self.tokens, ids[:-1])

    def reuse(self, prompt: Sequence[int], prefix_reuse: bool = True) -> tuple[int, torch.Tensor | None]:
        """Rewind the slot to what it can keep of `prompt`: (the position prefill starts at, the kept logits [1, 1, V]
        when the whole prompt is in the cache with its logits: then nothing is to be prefilled)."""
        ids = list(prompt)
        kept = self.kept_logits(ids) if prefix_reuse else None
        if kept is not None:
            start = self._truncate(len(ids))
            if start == len(ids):
                return start, kept  # Sampler.sample never modifies its input: the kept copy stays as it was
        self._kept = None  # whatever is prefilled next replaces it (and a cancelled prefill leaves none)
        common = _common(self.tokens, ids[:-1]) if prefix_reuse else 0
        return self._truncate(common), None

    def kept_logits(self, prompt: Sequence[int]) -> torch.Tensor | None:
        """The kept last logits [1, 1, V] when `prompt` is the kept one and all of it is in the slot, else None."""
        kept = self._kept
        ids = list(prompt)
        return kept[1] if kept is not None and kept[0] == ids and self.tokens[: len(ids)] == ids else None

    def rewind_to(self, position: int) -> int:
        """Forget positions >= `position` (and the kept logits): where the next prefill starts (<= position)."""
        self._kept = None
        return self._truncate(position)

    def keep(self, prompt: Sequence[int], logits: torch.Tensor) -> None:
        """Remember a fully prefilled prompt's last logits [1, 1, V] for the same prompt again."""
        # A copy: a graph may hand back a view of an output buffer its next call overwrites.
        self._kept = (list(prompt), logits.clone())

    def reset(self) -> None:
        """Forget everything (after a fault: the cache's contents are no longer trusted)."""
        self.tokens, self._kept = [], None
        try:
            self._rewind(0)
        except Exception:  # noqa: BLE001 - a graph that cannot even rewind fails its next call, with that request
            log.exception("graph rewind failed")

    def _truncate(self, position: int) -> int:
        start = self._rewind(position)
        del self.tokens[start:]
        return start


def _common(cached: list[int], wanted: Sequence[int]) -> int:
    common = 0
    for have, want in zip(cached, wanted, strict=False):
        if have != want:
            break
        common += 1
    return common


SIMILARITY = 0.5  # a free slot is chosen for its cached prefix only when that covers this share of the prompt


class KVSlots:
    """The slots a scheduler may use, and which of them are free (no running sequence)."""

    def __init__(self, rewind_slot: Callable[[int, int], int], count: int, short: int | None = None) -> None:
        """`short`: a cache of at most this many tokens is cheap to rebuild (one prefill call); None: any is."""
        self.all = [KVSlot(_rewinder(rewind_slot, s), s) for s in range(count)]
        self.free: list[KVSlot] = list(self.all)
        self.short = short
        self._clock = 0

    def choose(self, prompt: Sequence[int], prefix_reuse: bool = True) -> KVSlot:
        """Take the free slot holding the longest prefix of `prompt`, if at least half of it (SIMILARITY); else evict the
        cheapest to lose (`eviction_order`). There must be a free slot."""
        matches = [(s.match(prompt, prefix_reuse), -s.last_used, s.index) for s in self.free]
        best = max(matches)
        slot = self.all[best[2]]
        if best[0] < SIMILARITY * len(prompt):
            slot = min(self.free, key=self.eviction_order)
        self.free.remove(slot)
        self._clock += 1
        slot.last_used = self._clock
        return slot

    def eviction_order(self, slot: KVSlot) -> tuple[bool, bool, int, int]:
        """Smallest first: empty, then short (<= `short` tokens), then long; the least recently used within each."""
        held = len(slot.tokens)
        long = self.short is not None and held > self.short
        return long, held > 0, slot.last_used, slot.index

    def usage(self, max_total: int, pool: KVPool | None = None) -> KVUsage:
        """What the slots hold now (and, with KV lent by need, the pool). Read from another thread than the one that
        writes them (a scrape): a snapshot of the free list and the lengths, each read whole under the GIL, so the
        figures are of one moment or the next."""
        free = {s.index for s in list(self.free)}
        held = [(s.index in free, len(s.tokens)) for s in self.all]
        in_use = [n for idle, n in held if not idle]
        cached = [n for idle, n in held if idle and n > 0]
        capacity = len(held) * max_total
        blocks = lent = 0
        if pool is not None:
            lent = pool.in_use
            blocks = lent + pool.free_blocks
            capacity = min(capacity, blocks * pool.block_size)
        return KVUsage(slots=len(held), slots_in_use=len(in_use), tokens_capacity=capacity,
                       tokens_in_use=sum(in_use), cached_prefixes=len(cached), cached_tokens=sum(cached),
                       blocks=blocks, blocks_in_use=lent)

    def release(self, slot: KVSlot) -> None:
        """`slot`'s sequence ended: free again, its KV kept for whoever comes back to it."""
        if slot not in self.free:
            self.free.append(slot)


def _rewinder(rewind_slot: Callable[[int, int], int], slot: int) -> Callable[[int], int]:
    return lambda position: rewind_slot(slot, position)
