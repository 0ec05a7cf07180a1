"""The engine core with no thread: a stand-in device that records every call, the core built around it, and the events
a request has been sent so far (its event loop is run just long enough to deliver them)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from server.constraints.factory import ConstraintFactory
from server.engine.core import EngineCore
from server.engine.runner import DeviceWatch
from server.engine.scheduler import Policy
from server.engine.types import Delta, Event, Finish, GenerationRequest, RequestHandle
from server.graphs.blocks import KVBlocks
from server.graphs.null import NullGraph
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import null_host

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Call:
    kind: str  # "prefill" | "decode"
    slots: tuple[int, ...]
    positions: tuple[int, ...]  # prefill: the chunk's positions; decode: each row's
    last_only: bool = True


class RecordingGraph(NullGraph):
    """A several-slot null graph (instant, real shapes) that records each call as it is made; `during` runs inside
    each call, after the graph's `on_submit` and before it returns."""

    def __init__(self, vocab_size: int, *, slots: int = 4, batches: Sequence[int] = (1, 2, 4), bucket: int = 8,
                 max_total: int = 256, favoured_token: int | None = None, kv_pool: KVBlocks | None = None) -> None:
        NullGraph.__init__(self, vocab_size, max_total=max_total, prefill_bucket=bucket, slots=slots,
                           decode_batches=batches, favoured_token=favoured_token, kv_pool=kv_pool)
        self.log: list[Call] = []
        self.during: Callable[[Call], None] = lambda call: None

    def _then(self, call: Call, on_submit: Callable[[], None] | None) -> Callable[[], None]:
        def submitted() -> None:
            if on_submit is not None:
                on_submit()
            self.log.append(call)
            self.during(call)
        return submitted

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        call = Call("prefill", (slot,), tuple(positions[0].tolist()), last_only)
        return super().prefill(embeds, positions, slot, last_only=last_only, on_submit=self._then(call, on_submit))

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        call = Call("decode", tuple(int(s) for s in slots), tuple(positions[:, 0].tolist()))
        return super().decode(embeds, positions, slots, on_submit=self._then(call, on_submit))


class Walk:
    """An EngineCore over a RecordingGraph, stepped by the test; requests submitted on a loop that is not running."""

    def __init__(self, *, policy: Policy | None = None, capacity: int = 4, **graph: Any) -> None:
        host = null_host()
        self.host = host
        favoured = host.tokenizer.get_vocab().get("▁a")
        self.graph = RecordingGraph(host.structure.vocab_size, favoured_token=favoured, **graph)
        self.loop = asyncio.new_event_loop()
        self.core = EngineCore(self.graph, host.embedding, host.tokenizer, frozenset(host.stop_token_ids),
                               constraints=ConstraintFactory(host.structure.vocab_size), capacity=capacity,
                               request_timeout_s=600.0, lock=threading.Condition(), watch=DeviceWatch(), policy=policy)
        self._seen: dict[RequestHandle, list[Event]] = {}

    def submit(self, prompt: Sequence[int], new_tokens: int, **fields: Any) -> RequestHandle:
        return self.choices(prompt, new_tokens, 1, **fields)[0]

    def choices(self, prompt: Sequence[int], new_tokens: int, n: int, **fields: Any) -> list[RequestHandle]:
        """`n` requests of one submission (an n > 1 request's choices)."""
        request = GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=new_tokens,
                                    **{"sampling": GREEDY, "ignore_eos": True, **fields})
        handles = [RequestHandle(request, self.loop) for _ in range(n)]
        self.core.add(handles)
        return handles

    def events(self, handle: RequestHandle) -> list[Event]:
        """Every event published to `handle` so far, in order."""
        self.loop.run_until_complete(asyncio.sleep(0))  # deliver what the core handed to the loop
        seen = self._seen.setdefault(handle, [])
        queue: asyncio.Queue[Event] = handle._events
        while not queue.empty():
            seen.append(queue.get_nowait())
        return seen

    def tokens(self, handle: RequestHandle) -> list[int]:
        return [e.token_id for e in self.events(handle) if isinstance(e, Delta) and e.token_id is not None]

    def finish(self, handle: RequestHandle) -> Finish | None:
        return next((e for e in self.events(handle) if isinstance(e, Finish)), None)

    def close(self) -> None:
        self.loop.close()


def prompt_of(length: int, start: int = 300) -> list[int]:
    return [2, *range(start, start + length - 1)]
