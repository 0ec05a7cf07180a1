"""A request's Finish is the last thing that happens to it: `admitted` and `running` are settled before it is published.

The race this guards against: the worker published a Finish, then lowered the counts; a caller that had its Finish
(or the next test, admitting a full queue) could read a count that still held the finished request. The window is
a thread switch wide, so each test widens it on purpose: every Finish is followed by a pause on the thread that
published it (a worker descheduled right after publishing). Settled first, the counts read right at each Finish
are exact; settled after, they are one too high every time. One test per way a request ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from server.app.runtime import build_engine
from server.engine.engine import Engine
from server.engine.types import Finish, GenerationRequest, RequestHandle
from server.graphs.base import Graph
from server.graphs.null import NullGraph
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import SlowGraph, null_host, settings
from tests.support.wait import until

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def late_finishes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    publish = RequestHandle.publish

    def publish_then_pause(self: RequestHandle, event: object) -> None:
        publish(self, event)  # type: ignore[arg-type]
        if isinstance(event, Finish):
            time.sleep(0.05)  # whatever this thread still does for the request happens after the caller has it

    monkeypatch.setattr(RequestHandle, "publish", publish_then_pause)
    yield


def null_graph() -> NullGraph:
    host = null_host()
    return NullGraph(host.structure.vocab_size, max_total=host.max_total, prefill_bucket=host.spec.prefill_bucket,
                     favoured_token=host.tokenizer.get_vocab().get("▁a"))


def started(graph: Graph, **overrides: object) -> Engine:
    engine = build_engine(null_host(), settings(**overrides), load=lambda: graph)
    engine.start()
    assert engine.wait_ready(30), engine.state_reason
    return engine


def greedy(n: int, **fields: object) -> GenerationRequest:
    return GenerationRequest(prompt_ids=(2, 100, 200), max_new_tokens=n, sampling=GREEDY, **fields)  # type: ignore[arg-type]


def stuck_until(release: threading.Event) -> SlowGraph:
    """A null graph whose every call waits for `release`: a device that stopped answering."""

    class Stuck(SlowGraph):
        def forward(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
            release.wait(30)
            return super().forward(*args, **kwargs)  # type: ignore[arg-type]

    return Stuck(null_graph(), 0.0)


async def ended(engine: Engine, handle: RequestHandle) -> tuple[Finish, int, int]:
    """The request's Finish and (admitted, running) read the moment the caller has it."""
    async for event in handle.events():
        if isinstance(event, Finish):
            return event, engine.admitted, engine.running
    raise AssertionError("no Finish")


async def submitted_and_ended(engine: Engine, request: GenerationRequest) -> tuple[Finish, int, int]:
    return await ended(engine, engine.submit(request))


def test_choices_that_finish_are_no_longer_admitted() -> None:
    engine = started(null_graph())

    async def scenario() -> None:
        for _ in range(5):
            handles = engine.submit_all([greedy(3) for _ in range(3)])
            for index, handle in enumerate(handles):  # each Finish leaves exactly the choices after it admitted
                finish, admitted, running = await ended(engine, handle)
                assert finish.reason == "length"
                assert admitted == len(handles) - 1 - index
            assert running == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        engine.stop()


def test_a_request_failed_by_the_graph_is_no_longer_counted() -> None:
    engine = started(SlowGraph(null_graph(), 0.0, fail_after=2))
    try:
        finish, admitted, running = asyncio.run(asyncio.wait_for(submitted_and_ended(engine, greedy(8)), 10))
        assert finish.reason == "error" and (admitted, running) == (0, 0)
    finally:
        engine.stop()


def test_requests_cancelled_running_and_queued_are_no_longer_counted() -> None:
    engine = started(SlowGraph(null_graph(), 0.02))

    async def scenario() -> None:
        running, queued = engine.submit(greedy(200)), engine.submit(greedy(200))
        await until(lambda: engine.running == 1 and engine.queue_depth == 1, "one running, one queued", 10)
        queued.cancel()
        running.cancel()
        finish, admitted, _ = await ended(engine, running)
        assert finish.reason == "cancelled" and admitted == 1  # the queued one is still to be ended
        finish, admitted, now_running = await ended(engine, queued)
        assert finish.reason == "cancelled" and (admitted, now_running) == (0, 0)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        engine.stop()


def test_a_request_expired_in_the_queue_is_no_longer_counted() -> None:
    release = threading.Event()
    engine = started(stuck_until(release), step_timeout_s=60.0)

    async def scenario() -> None:
        engine.submit(greedy(4))  # runs, and hangs in the device
        await until(lambda: engine.running == 1, "one running", 10)
        finish, admitted, running = await ended(engine, engine.submit(greedy(4, timeout_s=0.3)))
        assert finish.reason == "length" and finish.timed_out
        assert (admitted, running) == (1, 1)  # only the stuck one

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        release.set()
        engine.stop()


def test_a_request_the_watchdog_abandons_is_no_longer_counted() -> None:
    release = threading.Event()
    engine = started(stuck_until(release), step_timeout_s=0.3)

    async def scenario() -> None:
        finish, admitted, running = await ended(engine, engine.submit(greedy(4)))
        assert finish.reason == "error" and "step timeout" in (finish.error or "")
        # Over for its caller, though its call has not returned: the engine says so by its state, not by counts.
        assert (admitted, running) == (0, 0) and engine.state == "error"

    try:
        asyncio.run(asyncio.wait_for(scenario(), 10))
    finally:
        release.set()
        engine.stop()


def test_requests_ended_by_stop_are_no_longer_counted() -> None:
    engine = started(SlowGraph(null_graph(), 0.02))

    async def scenario() -> list[tuple[str, int]]:
        handles = [engine.submit(greedy(200)) for _ in range(3)]
        await until(lambda: (engine.running, engine.queue_depth) == (1, 2), "one running, two queued", 10)
        stopping = asyncio.get_running_loop().run_in_executor(None, engine.stop)
        seen = []
        for handle in handles:
            finish, admitted, _ = await ended(engine, handle)
            seen.append((finish.reason, admitted))
        await stopping
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == [("cancelled", 2), ("cancelled", 1), ("cancelled", 0)]
