"""Load on loopback: 64 concurrent streaming clients against a queue of 16, a device of a few ms per step.

Every request either completes (a finish_reason, then `[DONE]`) or gets 429 with `Retry-After`; a third of the
clients (seeded) go away at random points, before the headers or mid-stream. Afterwards nothing is left behind:
the engine is idle, every admitted request got its Finish, `/health` is ok, no thread or server-loop task is
left over, and resident memory is where it was.

How the numbers are measured (printed; run with `-s` to see them):
- throughput: completed requests and the completion tokens of their usage chunks, over the wall time of the run;
- queue wait: `Finish.queue_wait_s` of every request, exactly, recorded by wrapping the app's
  `Metrics.observe_finish` (which also feeds the `gemma4_queue_wait_seconds` histogram, whose count must agree);
- RSS: VmRSS of this process (server and clients share it) after a warm-up run of the same workload. Sampling is
  seeded from a fixed set so the warm-up touches the same rows of the memory-mapped embedding table.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio.to_thread
import httpx
import pytest

from server.app.runtime import build_engine
from tests.support.api_fixtures import LiveServer, null_host, settings, slow_loader
from tests.support.wait import wait_until

STEP_S = 0.003
MAX_QUEUE = 16
CLIENTS = 64
ROUNDS = 5
MAX_TOKENS = 16
SEEDS = 8  # sampling seeds cycle over this set
RNG_SEED = 20240611
CHAT_ROUTE = 'gemma4_http_requests_total{route="/v1/chat/completions",status="%s"}'


@dataclass
class Tally:
    completed: int = 0
    rejected: int = 0  # 429 with Retry-After
    gone: int = 0  # the client went away on purpose
    gone_early: int = 0  # ... of which before the response headers (the server may have answered 200 or 429)
    tokens: int = 0  # completion tokens of completed streams (their usage chunks)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    reason: str
    queue_wait_s: float


class Recorder(logging.Handler):
    """Every request's Finish, from the server's one log line per generation request (its public record)."""

    LINE = re.compile(r" queue=([0-9.]+)s total=[0-9.]+s finish=(\w+)")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.finishes: list[Finished] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = self.LINE.search(record.getMessage())
        if match:
            self.finishes.append(Finished(match.group(2), float(match.group(1))))


@pytest.fixture(scope="module")
def loaded() -> Iterator[tuple[LiveServer, Recorder]]:
    config = settings(max_queue=MAX_QUEUE, sse_ping_s=60.0)
    load, _ = slow_loader(null_host(), STEP_S)
    live = LiveServer(config, build_engine(null_host(), config, load=load), null_host()).start()
    recorder = Recorder()
    logger = logging.getLogger("server.api")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(recorder)
    try:
        yield live, recorder
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
        live.stop()


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def samples(live: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def finished_total(s: dict[str, float]) -> float:
    return sum(v for k, v in s.items() if k.startswith("gemma4_requests_finished_total"))


async def one_request(client: httpx.AsyncClient, body: dict[str, object], leave_at: int | None, before_headers: bool,
                      tally: Tally, rng: random.Random) -> None:
    request = client.build_request("POST", "/v1/chat/completions", json=body)
    if before_headers:
        task = asyncio.ensure_future(client.send(request, stream=True))
        await asyncio.sleep(rng.uniform(0, 0.02))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            response = await task
            await response.aclose()  # it was quicker than us: go away now
        tally.gone += 1
        tally.gone_early += 1
        return
    response = await client.send(request, stream=True)
    try:
        if response.status_code == 429:
            error = json.loads(await response.aread())["error"]
            if response.headers.get("retry-after") != "1" or error["code"] != "queue_full":
                tally.problems.append(f"429 without Retry-After/queue_full: {response.headers} {error}")
            tally.rejected += 1
            return
        if response.status_code != 200:
            tally.problems.append(f"status {response.status_code}: {(await response.aread())[:300]!r}")
            return
        data: list[str] = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data.append(line.removeprefix("data: "))
                if leave_at is not None and len(data) >= leave_at:
                    tally.gone += 1
                    return
        if leave_at is not None:
            tally.gone += 1  # it finished before the client meant to leave: fine either way
        if not data or data[-1] != "[DONE]":
            tally.problems.append(f"no [DONE]: {data[-3:]}")
            return
        chunks = [json.loads(d) for d in data[:-1]]
        if any("error" in c for c in chunks):
            tally.problems.append(f"in-band error: {chunks[-1]}")
            return
        final, usage = chunks[-2], chunks[-1]
        if final["choices"][0]["finish_reason"] not in ("length", "stop") or usage["choices"] != []:
            tally.problems.append(f"bad ending: {chunks[-2:]}")
            return
        tally.completed += 1
        tally.tokens += usage["usage"]["completion_tokens"]
    finally:
        await response.aclose()


async def run_clients(url: str, clients: int, rounds: int, rng_seed: int) -> tuple[Tally, float]:
    rng = random.Random(rng_seed)
    leavers = set(rng.sample(range(clients), clients // 3))
    tally = Tally()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one_client(index: int) -> None:
            my_rng = random.Random(rng_seed * 1000 + index)
            await asyncio.sleep(my_rng.uniform(0, 0.05))
            for turn in range(rounds):
                body = {"messages": [{"role": "user", "content": f"client {index} turn {turn}"}],
                        "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": (index + turn) % SEEDS,
                        "stream": True, "stream_options": {"include_usage": True}}
                leave_at = before_headers = None
                if index in leavers:
                    before_headers = my_rng.random() < 0.3
                    leave_at = my_rng.randint(1, MAX_TOKENS + 3)
                await one_request(client, body, leave_at, bool(before_headers), tally, my_rng)
                await asyncio.sleep(my_rng.uniform(0.01, 0.08))  # think time (and a jittered back-off after a 429)

        began = time.monotonic()
        await asyncio.gather(*(one_client(i) for i in range(clients)))
        return tally, time.monotonic() - began


def settle(live: LiveServer, timeout: float = 10.0) -> None:
    """Wait until the engine is idle, every request's Finish was received and every connection is closed."""
    engine, connections = live.engine, live.server.server_state.connections

    def busy() -> tuple[int, ...]:
        return engine.admitted, engine.queue_depth, engine.running, len(engine.in_flight()), len(connections)

    wait_until(lambda: busy() == (0, 0, 0, 0, 0), "the engine and the connections to be idle", timeout)


def server_tasks(live: LiveServer) -> Counter[str]:
    async def names() -> Counter[str]:
        me = asyncio.current_task()
        return Counter(t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not me)  # type: ignore[union-attr]

    return live.run(names())


def threads() -> tuple[set[int], int]:
    """(idents of the threads that are not anyio's worker pool, the pool's size)."""
    pool = [t for t in threading.enumerate() if t.name == "AnyIO worker thread"]
    return {t.ident for t in threading.enumerate() if t not in pool and t.ident is not None}, len(pool)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def test_64_streaming_clients_against_a_queue_of_16_lose_nothing_and_leak_nothing(
        loaded: tuple[LiveServer, Recorder]) -> None:
    live, recorder = loaded
    # Warm up with the same workload (seeds, prompts, pool sizes), so what is measured next is steady state.
    warm, _ = asyncio.run(run_clients(live.url, CLIENTS, 2, RNG_SEED + 1))
    assert not warm.problems, warm.problems[:5]
    settle(live)
    gc.collect()
    threads_before, pool_before = threads()
    tasks_before = server_tasks(live)
    rss_before = rss_kb()
    metrics_before = samples(live)
    recorder.finishes.clear()

    tally, wall = asyncio.run(run_clients(live.url, CLIENTS, ROUNDS, RNG_SEED))

    assert not tally.problems, tally.problems[:5]
    attempts = CLIENTS * ROUNDS
    assert tally.completed + tally.rejected + tally.gone == attempts, tally
    assert tally.completed > 0 and tally.rejected > 0 and tally.gone >= CLIENTS // 3, tally

    settle(live)
    health = httpx.get(f"{live.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}

    # Nothing lost: every admitted stream (a 200) got exactly one Finish, counted in the metrics
    metrics_after = samples(live)
    route = CHAT_ROUTE
    admitted = metrics_after.get(route % 200, 0) - metrics_before.get(route % 200, 0)
    rejected = metrics_after.get(route % 429, 0) - metrics_before.get(route % 429, 0)
    finished = finished_total(metrics_after) - finished_total(metrics_before)
    assert finished == admitted == len(recorder.finishes), (finished, admitted, len(recorder.finishes))
    assert tally.rejected <= rejected <= tally.rejected + tally.gone_early  # some leavers were refused unawares
    assert admitted + rejected <= attempts
    waits_counted = metrics_after["gemma4_queue_wait_seconds_count"] - metrics_before["gemma4_queue_wait_seconds_count"]
    assert waits_counted == len(recorder.finishes)
    reasons = Counter(f.reason for f in recorder.finishes)
    assert set(reasons) <= {"length", "stop", "cancelled"}, reasons
    assert reasons["length"] + reasons["stop"] >= tally.completed

    # Nothing leaked: threads, server-loop tasks (after a short settle), memory
    wait_until(lambda: server_tasks(live) == tasks_before, "the server loop's tasks to settle", 5)
    threads_after, pool_after = threads()
    assert threads_after == threads_before, (threads_before, threads_after)
    async def pool_limit() -> float:
        return anyio.to_thread.current_default_thread_limiter().total_tokens

    assert pool_after <= live.run(pool_limit())  # anyio's worker pool is bounded: idle workers are not a leak
    gc.collect()
    rss_after = rss_kb()

    generated = metrics_after["gemma4_generation_tokens_total"] - metrics_before["gemma4_generation_tokens_total"]
    completed_waits = [f.queue_wait_s for f in recorder.finishes if f.reason in ("length", "stop")]
    all_waits = [f.queue_wait_s for f in recorder.finishes]
    print(f"\n[load] {CLIENTS} clients x {ROUNDS} requests, queue {MAX_QUEUE}, step {STEP_S * 1000:.0f} ms, "
          f"max_tokens {MAX_TOKENS}: {tally.completed} completed, {tally.rejected} x 429, {tally.gone} client-gone "
          f"in {wall:.2f} s\n"
          f"[load] throughput: {tally.completed / wall:.1f} completed req/s, {tally.tokens / wall:.0f} delivered tok/s "
          f"(all generated, cancelled streams' too: {generated / wall:.0f} tok/s)\n"
          f"[load] queue wait (Finish.queue_wait_s) of completed requests: p50 {percentile(completed_waits, 0.5) * 1000:.0f} ms, "
          f"p99 {percentile(completed_waits, 0.99) * 1000:.0f} ms; of all {len(all_waits)} admitted: "
          f"p50 {percentile(all_waits, 0.5) * 1000:.0f} ms, p99 {percentile(all_waits, 0.99) * 1000:.0f} ms; "
          f"finish reasons {dict(reasons)}\n"
          f"[load] RSS {rss_before / 1024:.1f} MB -> {rss_after / 1024:.1f} MB ({(rss_after / rss_before - 1) * 100:+.2f}%); "
          f"threads {len(threads_before)} + pool {pool_before} -> {len(threads_after)} + pool {pool_after}; "
          f"server-loop tasks {sum(tasks_before.values())} -> {sum(server_tasks(live).values())}")
    assert abs(rss_after - rss_before) <= 0.05 * rss_before, (rss_before, rss_after)
