"""Which graph call runs next: a prefill chunk of the sequence that just started, or a decode step.

Prefill is planned once, when the sequence starts (server.engine.buckets), and runs one chunk per step, so the engine
checks for cancellation between any two graph calls. One sequence at a time today (one KV cache); continuous batching
(graph contract v3) changes this file and the runner: several sequences, a newcomer's chunk or one decode over all.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from server.engine.buckets import chunk_spans
from server.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PrefillStep:
    """Prompt positions [begin, end) of `seq` into the KV cache."""

    seq: Sequence
    begin: int
    end: int
    last: bool  # the prompt's last chunk: its logits are what the first token is sampled from


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """`seq`'s last token into the KV cache, for the logits of the next one."""

    seq: Sequence


Step = PrefillStep | DecodeStep


class Scheduler:
    """The running sequence (at most one) and its next step."""

    def __init__(self, buckets: Seq[int]) -> None:
        self.buckets = tuple(buckets)  # the graph's prefill lengths, ascending
        self.running: Sequence | None = None
        self._chunks: collections.deque[tuple[int, int]] = collections.deque()  # the running prompt's, still to run
        self._decode: DecodeStep | None = None  # made once per sequence: the decode loop allocates nothing here

    def add(self, seq: Sequence, start: int) -> None:
        """`seq` runs next, its prompt from position `start` on still to prefill (none left: it decodes at once)."""
        assert self.running is None, "one sequence at a time"
        self.running = seq
        self._chunks = collections.deque(chunk_spans(start, seq.num_prompt_tokens, self.buckets))
        self._decode = DecodeStep(seq)

    def schedule(self) -> Step | None:
        """The next step of the running sequence (None when nothing runs)."""
        seq = self.running
        if seq is None:
            return None
        if self._chunks:
            begin, end = self._chunks.popleft()
            return PrefillStep(seq, begin, end, last=not self._chunks)
        return self._decode

    def remove(self, seq: Sequence) -> None:
        """`seq` ended: nothing of it is scheduled any more."""
        if self.running is seq:
            self.clear()

    def clear(self) -> None:
        """Nothing runs (after a fault: whatever ran is over)."""
        self.running, self._chunks, self._decode = None, collections.deque(), None
