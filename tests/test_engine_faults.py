"""The engine under faults: a graph that raises, one that stalls, one that fails to load, and stop() with a queue.

Each ends the affected request with an event (never a hang) and leaves the engine serving the next one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import torch

from server.api.service import engine_error
from server.app.runtime import build_engine
from server.engine.engine import Engine
from server.engine.types import Finish, GenerationRequest
from server.graphs.base import Graph
from server.graphs.null import NullGraph
from server.sampling.params import SamplingParams
from tests.support.api_fixtures import SlowGraph, null_host, settings
from tests.support.wait import until, wait_until

GREEDY = SamplingParams(temperature=0.0)


def null_graph() -> NullGraph:
    host = null_host()
    return NullGraph(host.structure.vocab_size, max_total=host.max_total, prefill_bucket=host.spec.prefill_bucket,
                     favoured_token=host.tokenizer.get_vocab().get("▁a"))


def greedy(prompt: tuple[int, ...], n: int, **fields: object) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=n, sampling=GREEDY, **fields)  # type: ignore[arg-type]


def started(load: Callable[[], Graph], **overrides: object) -> Engine:
    engine = build_engine(null_host(), settings(**overrides), load=load)
    engine.start()
    engine.wait_ready(30)
    return engine


async def collect(engine: Engine, n: int = 8) -> tuple[str, Finish]:
    completion = await engine.submit(greedy((2, 100, 200), n)).result()
    return completion.text, completion.finish


def stuck_until(release: threading.Event) -> SlowGraph:
    """A null graph whose every call waits for `release`: a device that stopped answering."""
    graph = SlowGraph(null_graph(), 0.0)
    inner_forward = graph.forward

    def stuck(*args: object, **kwargs: object) -> object:
        release.wait(30)
        return inner_forward(*args, **kwargs)  # type: ignore[arg-type]

    graph.forward = stuck  # type: ignore[method-assign]
    return graph


def test_a_graph_that_raises_ends_that_request_and_the_next_one_runs() -> None:
    graph = SlowGraph(null_graph(), 0.0, fail_after=4)  # prefill + 3 decode steps, then a device fault
    engine = started(lambda: graph)
    try:
        _, finish = asyncio.run(collect(engine))
        assert finish.reason == "error" and "simulated device fault" in (finish.error or "")
        assert engine.state == "ok"
        graph.fail_after = None
        text, finish = asyncio.run(collect(engine))
        assert finish.reason == "length" and finish.completion_tokens == 8 and text
        assert finish.reused_tokens == 0  # the cache was reset after the fault, never trusted
    finally:
        engine.stop()


def test_a_token_fault_never_loses_the_token_before_it() -> None:
    """The fault hits before the graph submits its device work, which is when it would publish the previous token:
    that token is published anyway (after the call), then the error."""
    graph = SlowGraph(null_graph(), 0.0, fail_after=4)  # prefill + 3 decode steps, then a device fault

    async def run() -> tuple[list[int], Finish]:
        completion = await engine.submit(greedy((2, 100, 200), 8)).result()
        return completion.token_ids, completion.finish

    engine = started(lambda: graph)
    try:
        tokens, finish = asyncio.run(run())
        assert finish.reason == "error"
        assert len(tokens) == 4  # sampled from the prefill and the 3 decode steps that ran
    finally:
        engine.stop()


def test_each_token_goes_out_once_the_next_step_is_submitted() -> None:
    """Not while the next step's inputs are still built (the event loop would take the GIL from the device owner),
    and not after that step's device work either: while call k + 2 runs on the device, token k reaches the client.

    Waits on state both ways: each simulated device step holds until its token arrived (a token published only after
    the call returned would time the step out), and each arrival records how many calls had built their inputs."""
    tokens = 5
    inner = null_graph()
    built: list[int] = []  # calls whose inputs were ready (their on_submit ran), in order
    arrived = [threading.Event() for _ in range(tokens)]
    seen_during_step: list[bool] = []  # per decode call: did the token it carries arrive while the step ran?

    class Handshake(SlowGraph):
        def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                    on_submit: Callable[[], None] | None = None) -> torch.Tensor:
            self.calls += 1
            call = self.calls  # call 1 is the prefill (it yields token 0); call k + 2 carries token k out

            def submitted() -> None:
                built.append(call)
                if on_submit is not None:
                    on_submit()

            logits = self.inner.forward(embeds, positions, last_only=last_only, on_submit=submitted)
            if call >= 2:  # the device step: the previous token must reach the client meanwhile
                seen_during_step.append(arrived[call - 2].wait(10))
            return logits

    graph = Handshake(inner, 0.0)
    built_at_arrival: list[int] = []

    async def consume() -> None:
        handle = engine.submit(greedy((2, 100, 200), tokens))
        index = 0
        async for event in handle.events():
            if isinstance(event, Finish):
                return
            built_at_arrival.append(len(built))
            arrived[index].set()
            index += 1

    engine = started(lambda: graph)
    try:
        asyncio.run(consume())
    finally:
        engine.stop()
    assert graph.calls == tokens  # prefill + 4 decode steps; the 5th token is never fed back
    assert seen_during_step == [True] * (tokens - 1), "a token went out only after the next device step"
    for token, count in enumerate(built_at_arrival[:-1]):
        assert count >= token + 2, f"token {token} went out before call {token + 2} had built its inputs"


def test_a_stalled_graph_call_fails_its_request_and_health_recovers() -> None:
    graph = SlowGraph(null_graph(), 0.0)
    release = threading.Event()
    inner_forward = graph.forward

    def stalling(*args: object, **kwargs: object) -> object:
        if graph.calls == 2:  # the first decode step hangs
            graph.calls += 1
            release.wait(30)
        return inner_forward(*args, **kwargs)  # type: ignore[arg-type]

    graph.forward = stalling  # type: ignore[method-assign]
    engine = started(lambda: graph, step_timeout_s=0.4)
    try:
        began = time.monotonic()
        _, finish = asyncio.run(collect(engine))
        waited = time.monotonic() - began
        assert finish.reason == "error" and "step timeout" in (finish.error or "")
        assert waited < 5, waited
        assert engine.state == "error" and "step timeout" in engine.state_reason
        release.set()  # the device comes back: the engine is healthy again and serves
        wait_until(lambda: engine.state == "ok", "the engine to be healthy again", 10)
        _, finish = asyncio.run(collect(engine))
        assert finish.reason == "length"
    finally:
        release.set()
        engine.stop()


def test_a_graph_that_fails_to_load_reports_why() -> None:
    def broken() -> NullGraph:
        raise FileNotFoundError("sqz_neff.pt: truncated")

    engine = started(broken)
    try:
        assert engine.state == "error"
        assert "graph failed to load" in engine.state_reason and "truncated" in engine.state_reason
        with pytest.raises(Exception, match="not ready: error") as info:
            asyncio.run(collect(engine))
        assert engine_error(info.value).status == 503
    finally:
        engine.stop()


def test_stop_finishes_queued_requests_instead_of_leaving_them_waiting() -> None:
    engine = started(lambda: SlowGraph(null_graph(), 0.05))

    async def scenario() -> list[Finish]:
        handles = [engine.submit(greedy((2, 100), 50)) for _ in range(3)]
        await until(lambda: (engine.running, engine.queue_depth) == (1, 2))  # the first is running, two are queued
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        finishes = []
        for handle in handles:
            async for event in handle.events():
                if isinstance(event, Finish):
                    finishes.append(event)
        return finishes

    finishes = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert [f.reason for f in finishes] == ["cancelled"] * 3
    assert engine.admitted == 0


def test_queued_requests_expire_while_the_device_is_stuck() -> None:
    release = threading.Event()
    graph = stuck_until(release)
    engine = started(lambda: graph, step_timeout_s=60.0)

    async def scenario() -> Finish:
        engine.submit(greedy((2, 100), 4))  # runs, and hangs in the device
        await until(lambda: engine.running == 1)
        queued = engine.submit(greedy((2, 100), 4, timeout_s=0.5))
        async for event in queued.events():
            if isinstance(event, Finish):
                return event
        raise AssertionError("no Finish")

    try:
        began = time.monotonic()
        finish = asyncio.run(asyncio.wait_for(scenario(), 10))
        assert finish.reason == "length" and finish.timed_out and finish.completion_tokens == 0
        assert time.monotonic() - began < 3
        assert engine.queue_depth == 0
    finally:
        release.set()
        engine.stop()


def test_a_stall_that_recovers_during_a_drain_leaves_the_server_draining() -> None:
    release = threading.Event()
    graph = stuck_until(release)
    engine = started(lambda: graph, step_timeout_s=0.3)

    async def scenario() -> None:
        handle = engine.submit(greedy((2, 100), 4))
        async for event in handle.events():
            if isinstance(event, Finish):
                assert event.reason == "error"
        assert engine.state == "error"
        engine.drain()
        assert engine.state == "draining"
        release.set()
        assert await engine.wait_idle(5)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 20))
        assert engine.state == "draining"
        with pytest.raises(Exception, match="draining"):
            asyncio.run(collect(engine))
    finally:
        release.set()
        engine.stop()
