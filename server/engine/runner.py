"""`Runner`, the only caller of `graph.forward`: each call timed where the watchdog sees it (`DeviceWatch`), counted
for the request, its KV recorded; `Abandoned` when the watchdog gave up on it meanwhile.

The decode fast path (measured; keep it when changing this file):
- publish on submit: the previous token's Delta goes out from the graph's `on_submit` callback, right before the
  step's device work (why then: server.graphs.base; later, the client would wait for the whole device step). A call
  that fails before submitting publishes it afterwards: no token is ever lost.
- positions pre-built: one [1, 1] tensor per position, made once (a fresh `torch.tensor` per token is a call on
  the critical path).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from server.engine.kv import KVSlot
from server.engine.types import RequestHandle
from server.graphs.base import Graph
from server.model.embedding import HostEmbedding


class Abandoned(Exception):
    """The watchdog gave up on the current graph call; its request already got an error."""


@dataclass(slots=True)
class DeviceWatch:
    """What the device-owner thread and the watchdog both touch: read and written under the engine's lock only."""

    running: RequestHandle | None = None  # the request whose graph calls run now, until its Finish
    step_started: float | None = None  # while a graph call runs
    abandoned: bool = False  # the watchdog gave up on the current call
    stall: str | None = None  # why, until that call returns
    graph_calls: int = 0  # of the running request
    device_s: float = 0.0

    def begin(self, handle: RequestHandle) -> None:
        """`handle` is the request on the device now: its counters start from zero."""
        self.running, self.graph_calls, self.device_s = handle, 0, 0.0

    def recovered(self) -> None:
        """An abandoned call has returned (or raised): the device answers again."""
        if self.abandoned:
            self.abandoned, self.stall = False, None


class Runner:
    """One graph call per method: `prefill` (one chunk) and `decode` (one token), each recorded in the KV slot."""

    def __init__(self, graph: Graph, embedding: HostEmbedding, lock: threading.Condition, watch: DeviceWatch) -> None:
        self.graph = graph
        self.embedding = embedding
        self._lock = lock
        self._watch = watch
        self._positions = [torch.tensor([[p]]) for p in range(graph.max_total)]  # [1, 1] each: the decode fast path

    def prefill(self, kv: KVSlot, ids: Sequence[int], begin: int, end: int, *, last: bool) -> torch.Tensor:
        """ids[begin:end] into the slot at positions begin..end-1: logits, [1, 1, V] of the chunk's last position when
        `last` (the prompt's last chunk: what its first token is sampled from), else [1, T, V]."""
        chunk = ids[begin:end]
        embeds = self.embedding.lookup(chunk)  # [1, T, H]
        positions = torch.arange(begin, end).unsqueeze(0)  # [1, T]
        logits = self._call(embeds, positions, last_only=last)
        kv.tokens.extend(chunk)
        return logits

    def decode(self, kv: KVSlot, token: int, on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """`token` into the slot at its next position: logits [1, 1, V]. `on_submit` publishes the previous token."""
        embeds = self.embedding.lookup([token])  # [1, 1, H]
        logits = self._call(embeds, self._positions[len(kv.tokens)], last_only=True, publish=on_submit)  # [1, 1, V]
        kv.tokens.append(token)
        return logits

    def _call(self, embeds: torch.Tensor, positions: torch.Tensor, last_only: bool,
              publish: Callable[[], None] | None = None) -> torch.Tensor:
        """One graph call; `publish` runs once: when the graph submits its device work, or after a failure before that."""
        watch = self._watch
        with self._lock:
            watch.step_started = started = time.monotonic()
        submitted: float | None = None

        def on_submit() -> None:
            nonlocal submitted
            if submitted is None:
                submitted = time.monotonic()
                if publish is not None:
                    publish()

        try:
            logits = self.graph.forward(embeds, positions, last_only=last_only, on_submit=on_submit)
        finally:
            if submitted is None and publish is not None:
                publish()
            with self._lock:
                watch.step_started = None
                watch.graph_calls += 1
                # Device time from the submission on: building the call's inputs is the host's work, not the device's.
                watch.device_s += time.monotonic() - (submitted or started)
                abandoned = watch.abandoned
        if abandoned:
            raise Abandoned
        return logits
