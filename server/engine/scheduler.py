"""Which graph call runs next (continuous batching, nano-vllm's Scheduler in NxD Inference's shape on Neuron): one
prefill chunk of a newcomer, or one decode step over every running sequence that has its prompt in the cache.

- Admission: a sequence gets a free KV slot (server.engine.kv.KVSlots.choose: the longest cached prefix of its
  prompt, else the least recently used); at most `capacity` run at once (the graph's slots, its largest decode
  batch, and --max-batch, whichever is least). Who is admitted when is the engine's (its FIFO queue); here, where.
- One step at a time, alternating while both kinds of work wait: a prefill chunk, then a decode step, then the next
  chunk. A running stream therefore never waits longer than one chunk plus one step between two tokens, however
  long the prompt that arrived beside it, and a newcomer's first token comes after its own prefill and at most the
  step that ran when it arrived plus one decode step. Prompts are prefilled in arrival order, chunk by chunk.
- A decode step takes every decoding sequence in admission order; the graph runs the smallest compiled batch that
  holds them (server.graphs.base).
- Prefill is planned once, when the sequence is admitted (server.engine.buckets); the engine checks for
  cancellation between any two graph calls of a prompt. An image's soft tokens are in one chunk: the plan never
  splits them, and a cached prefix that would end inside an image is cut back to the image's start.
A one-slot graph has capacity 1: one sequence prefills, then decodes, as it always did.
"""

from __future__ import annotations

import collections
import collections.abc
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from server.engine.buckets import chunk_spans
from server.engine.kv import KVSlots
from server.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """Prompt positions [begin, end) of `seq` into its KV slot."""

    seq: Sequence
    begin: int
    end: int
    last: bool  # the prompt's last chunk: its logits are what the first token is sampled from

    @property
    def rows(self) -> tuple[Sequence, ...]:
        return (self.seq,)


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """Each row's last token into its slot, for the logits of its next one."""

    rows: tuple[Sequence, ...]


Step = PrefillStep | DecodeStep


class Scheduler:
    """The running sequences (prefilling and decoding), their slots, and the next step."""

    def __init__(self, buckets: Seq[int], slots: KVSlots, capacity: int, *, prefix_reuse: bool = True) -> None:
        self.buckets = tuple(buckets)  # the graph's prefill lengths, ascending
        self.slots = slots
        self.capacity = capacity  # sequences at once
        self.prefix_reuse = prefix_reuse
        self.running: list[Sequence] = []  # in admission order
        self._prefilling: collections.deque[Sequence] = collections.deque()  # chunks still to run, first come first
        self._decoding: list[Sequence] = []  # in admission order
        self._last_was_prefill = False

    @property
    def busy(self) -> bool:
        return bool(self.running)

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.capacity and bool(self.slots.free)

    def add(self, seq: Sequence) -> torch.Tensor | None:
        """Admit `seq` into a free slot: what the slot holds of its prompt is kept, the rest planned into chunks.
        Returns the kept logits [1, 1, V] when the whole prompt is cached with them (it decodes at once)."""
        assert self.has_room, "admitted beyond the free slots"
        prompt = seq.prompt_keys
        # A request for the prompt's logprobs prefills all of it: the cache keeps KV, not the logits they come from.
        reuse = self.prefix_reuse and seq.prompt_logprobs is None
        kv = self.slots.choose(prompt, reuse)
        start, kept = kv.reuse(prompt, reuse)
        blocks = seq.image_blocks
        inside = next((begin for begin, end in blocks if begin < start < end), None)
        if inside is not None:  # the graph can continue only mid-image (a rewind): the whole image again
            start, kept = kv.rewind_to(inside), None
        seq.kv, seq.reused_tokens = kv, start
        seq.chunks = collections.deque(chunk_spans(start, seq.num_prompt_tokens, self.buckets, blocks))
        self.running.append(seq)
        if seq.chunks:
            self._prefilling.append(seq)
        return kept

    def decodes(self, seq: Sequence) -> None:
        """`seq` sampled its first token (after its last chunk, or from kept logits): it joins the decode steps."""
        if seq in self.running and seq not in self._decoding:
            self._decoding.append(seq)

    def schedule(self) -> Step | None:
        """The next step (None when nothing runs)."""
        if self._prefilling and (not self._decoding or not self._last_was_prefill):
            seq = self._prefilling[0]
            begin, end = seq.chunks.popleft()
            if not seq.chunks:
                self._prefilling.popleft()
            self._last_was_prefill = True
            return PrefillStep(seq, begin, end, last=not seq.chunks)
        self._last_was_prefill = False
        return DecodeStep(tuple(self._decoding)) if self._decoding else None

    @property
    def prefilling(self) -> collections.abc.Sequence[Sequence]:
        """Sequences admitted whose prompt is not all in the cache yet, in prefill order (read only)."""
        return self._prefilling

    def remove(self, seq: Sequence) -> None:
        """`seq` ended: nothing of it is scheduled any more; its slot is free, its KV kept for a later turn."""
        if seq not in self.running:
            return
        self.running.remove(seq)
        if seq in self._decoding:
            self._decoding.remove(seq)
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        seq.chunks.clear()
        if seq.kv is not None:
            self.slots.release(seq.kv)
