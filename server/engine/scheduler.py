"""Which graph call runs next (continuous batching, nano-vllm's Scheduler in NxD Inference's shape on Neuron): one
prefill chunk of a newcomer, or one decode step over every sequence that has its prompt in the cache.

- Admission: a sequence gets a free KV slot (server.engine.kv.KVSlots.choose: the longest cached prefix of its
  prompt, else the cheapest cache to lose: empty, short, then long); at most `capacity` run at once (the graph's
  slots, its largest decode batch, and --max-batch, whichever is least). Who is admitted when is the engine core's
  (first come, first served); here, where.
- What runs next is the policy's (`Policy`, swappable): it is handed the ready prefilling sequences (admitted, their
  host work done, chunks left) and the decoding ones, both in admission order, and returns the step.
  `TokenBudget`, the default (vLLM's token budget, over a contract of one prompt's chunk per call): between two decode
  steps at most `budget` prefill tokens run (default: one chunk), so a running stream never waits longer than one
  chunk plus one step between two tokens; the chunk goes to the prompt with the fewest tokens left (a 16-token probe
  beside an 8k prompt is done after its one chunk), and a prompt passed over `patience` times gets the next chunk,
  so a long prompt is never starved (docs/concurrency.md argues the choice).
  `Alternate`, the first policy, stays for comparison: chunk and decode step in turn, prompts first come, first served.
- A decode step takes every decoding sequence; the graph runs the smallest compiled batch that holds them.
- n > 1 side by side (`add_copy`): a choice admitted while the choice before it still has its prompt's chunks to run
  takes a slot of its own and no chunks; once that prompt is prefilled the engine copies its slot into the choice's
  (`Graph.copy_slot`). A source that ends first hands its prompt to its first waiting choice, which then prefills it.
- Prefill is planned once, when the sequence is admitted (server.engine.buckets). An image's soft tokens are in one
  chunk: the plan never splits them, and a cached prefix that would end inside an image is cut back to its start.
- KV lent by need (a graph with a `pool`, server.graphs.base `KVPool`: a v4 build): a sequence is admitted only when
  its prompt's blocks fit (`fits`: the free blocks and those idle slots hold, which are evicted for it, cheapest
  first: `KVSlots.eviction_order`). Before a step runs, its rows' new blocks are made room for (`room_for`): idle
  slots' blocks first, then the youngest running sequence is preempted (vLLM's recompute preemption: it leaves its
  slot, idle with its KV, and waits to be admitted again; its prompt and generated tokens are then prefilled again,
  as much as its slot no longer holds, and its stream goes on where it was). docs/concurrency.md argues the choice.
A one-slot graph has capacity 1: one sequence prefills, then decodes, as it always did.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from server.engine.buckets import chunk_spans
from server.engine.kv import KVSlots
from server.engine.sequence import Sequence, State
from server.graphs.base import KVPool


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """Prompt positions [begin, end) of `seq` into its KV slot."""

    seq: Sequence
    begin: int
    end: int
    last: bool  # the prompt's last chunk: its logits are what the first token is sampled from

    @classmethod
    def next_of(cls, seq: Sequence) -> PrefillStep:
        """The next planned chunk of `seq`, taken off its plan."""
        begin, end = seq.chunks.popleft()
        return cls(seq, begin, end, last=not seq.chunks)

    @property
    def rows(self) -> tuple[Sequence, ...]:
        return (self.seq,)


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """Each row's last token into its slot, for the logits of its next one."""

    rows: tuple[Sequence, ...]


Step = PrefillStep | DecodeStep


class Policy(Protocol):
    def next_step(self, prefilling: Seq[Sequence], decoding: Seq[Sequence]) -> Step | None:
        """The next step over these (each in admission order; `prefilling` are ready and have chunks left), or None
        for nothing to run now."""
        ...


class Alternate:
    """A prefill chunk and a decode step in turn while both wait; prompts first come, first served (module docs)."""

    def __init__(self) -> None:
        self._last_was_prefill = False

    def next_step(self, prefilling: Seq[Sequence], decoding: Seq[Sequence]) -> Step | None:
        if prefilling and (not decoding or not self._last_was_prefill):
            self._last_was_prefill = True
            return PrefillStep.next_of(prefilling[0])
        self._last_was_prefill = False
        return DecodeStep(tuple(decoding)) if decoding else None


class TokenBudget:
    """Decode steps keep their cadence; between two of them at most `budget` prefill tokens (0: one chunk, whatever
    its size), given to the ready prompt with the fewest tokens left; one passed over `patience` chunks in a row goes
    first (the oldest such), so every prompt gets at least one chunk in `patience` + 1. Deterministic: the choice is a
    function of the sequences' plans, their admission order and the chunks this policy handed out."""

    def __init__(self, budget: int = 0, patience: int = 16) -> None:
        self.budget = budget
        self.patience = patience
        self._spent = 0  # prefill tokens since the last decode step
        self._passed: dict[Sequence, int] = {}  # chunks given to others since a prompt's own last one

    def next_step(self, prefilling: Seq[Sequence], decoding: Seq[Sequence]) -> Step | None:
        self._passed = {seq: self._passed.get(seq, 0) for seq in prefilling}  # those that left are forgotten
        if not prefilling:
            self._spent = 0
            return DecodeStep(tuple(decoding)) if decoding else None
        seq = self.choose(prefilling)
        begin, end = seq.chunks[0]
        if decoding and self._spent and self._spent + (end - begin) > self.budget:
            self._spent = 0  # the round is full: the running streams' step
            return DecodeStep(tuple(decoding))
        self._spent = self._spent + (end - begin) if decoding else 0
        for other in prefilling:
            self._passed[other] = 0 if other is seq else self._passed[other] + 1
        return PrefillStep.next_of(seq)

    def choose(self, prefilling: Seq[Sequence]) -> Sequence:
        """Who gets the next chunk: the oldest prompt passed over `patience` times, else the fewest tokens left (the
        earliest admitted among equals)."""
        aged = [seq for seq in prefilling if self._passed.get(seq, 0) >= self.patience]
        if aged:
            return aged[0]
        return min(prefilling, key=remaining)  # min keeps the first of equals: admission order


def remaining(seq: Sequence) -> int:
    """Prompt tokens `seq` has still to prefill."""
    return seq.chunks[-1][1] - seq.chunks[0][0] if seq.chunks else 0


class Scheduler:
    """The sequences holding a KV slot (`active`, in admission order) and the next step, as the policy picks it."""

    def __init__(self, buckets: Seq[int], slots: KVSlots, capacity: int, *, prefix_reuse: bool = True,
                 policy: Policy | None = None, pool: KVPool | None = None) -> None:
        self.buckets = tuple(buckets)  # the graph's prefill lengths, ascending
        self.slots = slots
        self.capacity = capacity  # sequences at once
        self.prefix_reuse = prefix_reuse
        self.policy: Policy = policy or TokenBudget()
        self.active: list[Sequence] = []
        self.pool = pool  # KV lent by need (None: a free slot is all a sequence needs)

    @property
    def busy(self) -> bool:
        return bool(self.active)

    @property
    def has_room(self) -> bool:
        return len(self.active) < self.capacity and bool(self.slots.free)

    @property
    def prefilling(self) -> list[Sequence]:
        """Admitted sequences whose prompt is not all in the cache yet, in admission order (ready or not)."""
        return [seq for seq in self.active if seq.chunks]

    @property
    def decoding(self) -> list[Sequence]:
        return [seq for seq in self.active if seq.state is State.DECODING]

    @property
    def copying(self) -> list[Sequence]:
        """Admitted choices waiting for another's prompt to be prefilled, to copy its slot (n > 1)."""
        return [seq for seq in self.active if seq.source is not None]

    def copies_of(self, source: Sequence) -> list[Sequence]:
        return [seq for seq in self.active if seq.source is source]

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt (and its first token) can have its KV now: the free blocks and those idle slots hold
        (evicted for it by `add`) cover it, beside what the admitted sequences' prompts still take. Always, without a
        pool."""
        pool = self.pool
        if pool is None:
            return True
        idle = sum(pool.held(slot.index) for slot in self.slots.free)
        promised = sum(max(0, pool.blocks_for(self._first_need(other)) - pool.held(other.kv.index))
                       for other in self.active if other.kv is not None)
        return pool.blocks_for(self._first_need(seq)) + promised <= pool.free_blocks + idle

    def _first_need(self, seq: Sequence) -> int:
        """Positions `seq` holds once its prompt is prefilled and its first token decoded (within one slot's reach)."""
        assert self.pool is not None
        return min(len(seq.prompt_keys) + 1, self.pool.reach)

    def room_for(self, needs: dict[int, int]) -> bool:
        """Evict idle slots' blocks, cheapest first, until every slot of `needs` (slot -> positions) can grow there;
        whether they can. Always, without a pool."""
        pool = self.pool
        if pool is None:
            return True
        for slot in sorted(self.slots.free, key=self.slots.eviction_order):
            if not pool.shortfall(needs):
                break
            if slot.index not in needs and pool.held(slot.index):
                slot.rewind_to(0)  # its blocks back to the pool (the graph's rewind); its conversation is re-prefilled
        return not pool.shortfall(needs)

    def step_needs(self, step: Step) -> dict[int, int]:
        """Slot -> positions each row must hold for `step` to run."""
        if isinstance(step, PrefillStep):
            assert step.seq.kv is not None
            return {step.seq.kv.index: step.end}
        return {seq.kv.index: len(seq.kv.tokens) + 1 for seq in step.rows if seq.kv is not None}

    def preempt(self, seq: Sequence) -> None:
        """`seq` leaves its slot (idle, its KV kept until evicted) and waits to be admitted again: what it needs then is
        its prompt and generated tokens (`Sequence.suspend`)."""
        self.active.remove(seq)
        seq.chunks.clear()
        seq.suspend()
        if seq.kv is not None:
            self.slots.release(seq.kv)
            seq.kv = None

    def add(self, seq: Sequence) -> torch.Tensor | None:
        """Admit `seq` into a free slot: what the slot holds of its prompt is kept, the rest planned into chunks.
        Returns the kept logits [1, 1, V] when the whole prompt is cached with them (it decodes at once)."""
        assert self.has_room, "admitted beyond the free slots"
        # A request for the prompt's logprobs prefills all of it: the cache keeps KV, not the logits they come from.
        seq.kv = self.slots.choose(seq.prompt_keys, self.prefix_reuse and seq.prompt_logprobs is None)
        self.active.append(seq)
        kept = self._plan(seq)
        if self.pool is not None:  # `fits` said the idle slots' blocks cover it
            assert self.room_for({seq.kv.index: self._first_need(seq)}), "admitted beyond the free KV"
        return kept

    def add_copy(self, seq: Sequence, source: Sequence) -> None:
        """Admit `seq`, a choice of `source`'s prompt (source still has chunks to run), into a free slot that takes a
        copy of source's once that prompt is prefilled (`copied`): no chunks of its own."""
        assert self.has_room, "admitted beyond the free slots"
        kv = self.slots.choose(seq.prompt_keys, prefix_reuse=False)  # its KV is replaced: the cheapest to lose
        kv.rewind_to(0)
        seq.kv, seq.source = kv, source
        self.active.append(seq)

    def copied(self, seq: Sequence) -> None:
        """`seq`'s slot now holds its source's prompt (the graph copied it): it reused all of it."""
        source = seq.source
        assert seq.kv is not None and source is not None and source.kv is not None
        seq.kv.tokens = list(source.kv.tokens)
        seq.source, seq.reused_tokens = None, seq.num_prompt_tokens

    def _plan(self, seq: Sequence) -> torch.Tensor | None:
        """What `seq`'s slot keeps of its prompt, the rest planned into chunks; the kept logits (as `add`)."""
        kv, prompt = seq.kv, seq.prompt_keys
        assert kv is not None
        reuse = self.prefix_reuse and seq.prompt_logprobs is None
        start, kept = kv.reuse(prompt, reuse)
        blocks = seq.image_blocks
        inside = next((begin for begin, end in blocks if begin < start < end), None)
        if inside is not None:  # the graph can continue only mid-image (a rewind): the whole image again
            start, kept = kv.rewind_to(inside), None
        if not seq.preemptions:  # a resumed sequence's prompt was counted when it first ran
            seq.reused_tokens = start
        seq.chunks = collections.deque(chunk_spans(start, len(prompt), self.buckets, blocks))
        return kept

    def schedule(self) -> Step | None:
        """The next step (None when nothing can run now)."""
        step = self.policy.next_step([seq for seq in self.prefilling if seq.ready], self.decoding)
        if isinstance(step, PrefillStep):
            step.seq.state = State.PREFILLING
        return step

    def remove(self, seq: Sequence) -> None:
        """`seq` ended: nothing of it is scheduled any more; its slot is free, its KV kept for a later turn."""
        if seq not in self.active:
            return
        self.active.remove(seq)
        seq.chunks.clear()
        if seq.kv is not None:
            self.slots.release(seq.kv)
        orphans = self.copies_of(seq)
        if orphans:  # its prompt never reached the cache: the first choice waiting for it prefills it for the rest
            lead, *rest = orphans
            lead.source = None
            self._plan(lead)
            for choice in rest:
                choice.source = lead
