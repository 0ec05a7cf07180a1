"""Shared pieces of the API tests: the demo host (loaded once per session), engines, and live servers.

- `null_host()`: the exported Gemma-3 270M artifact dir with the null graph (real tokenizer and chat template,
  instant fixed logits favouring "▁a"); `hf_host()`: the same host running the real 270M on CPU.
- `SlowGraph`: a stand-in *device* (not our code): the null graph behind a per-call delay, optionally failing
  after N calls, so streams are slow enough to disconnect from, ping on, or fill the queue with; `SlowSlots` the same
  over several KV slots (what `slow_loader` gives for the null graph: the engine batches, as it serves).
- `LiveServer`: the real app under uvicorn on 127.0.0.1 (port 0) in a background thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from server.app.page import chat_page_html
from server.app.runtime import Host, build_engine, graph_loader, load_host
from server.config import Settings
from server.engine.engine import Engine
from server.graphs.base import Graph, OneSlotGraph
from tests.support.models import demo_dir
from tests.support.wait import wait_serving, wait_until

T = TypeVar("T")
API_KEY = "sk-test-key"


@functools.cache
def null_host() -> Host:
    return load_host(demo_dir(), "null", "gemma-test")


@functools.cache
def hf_host() -> Host:
    return dataclasses.replace(null_host(), graph_kind="hf")


def settings(**overrides: Any) -> Settings:
    # lazy_grammar: the grammar vocabulary's build holds the GIL ~10 s; only the tests that constrain output start it.
    base = Settings(artifacts=demo_dir(), graph="null", host="127.0.0.1", port=0, served_model_name="gemma-test",
                    lazy_grammar=True)
    return replace(base, **overrides)


class WrappedGraph(OneSlotGraph):
    """A test's stand-in device around a real graph: the same facts, one slot (the inner graph's slot 0), `rewind`
    passed through; subclasses change `forward`."""

    def __init__(self, inner: Graph, label: str) -> None:
        self.inner = inner
        self.max_total = inner.max_total
        self.prefill_buckets = inner.prefill_buckets
        self.prefill_bucket = max(inner.prefill_buckets)
        self.input_dtype = inner.input_dtype
        self.vocab_size = inner.vocab_size
        self.host_softcap = inner.host_softcap
        self.image_blocks = inner.image_blocks
        self.name = f"{label}-{inner.name}"
        self.calls = 0

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        blocks = {} if block_ids is None else {"block_ids": block_ids}
        return self.inner.prefill(embeds, positions, 0, last_only=last_only, on_submit=on_submit, **blocks)

    def rewind(self, position: int) -> int:
        return self.inner.rewind_slot(0, position)


class SlowGraph(WrappedGraph):
    """The null graph (or any graph) with `delay_s` per call; raises after `fail_after` calls if set."""

    def __init__(self, inner: Graph, delay_s: float, fail_after: int | None = None) -> None:
        super().__init__(inner, "slow")
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.call_starts: list[float] = []  # time.monotonic() at the start of each call

    def _device(self, on_submit: Callable[[], None] | None) -> None:
        self.calls += 1
        self.call_starts.append(time.monotonic())
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("simulated device fault")
        if on_submit is not None:
            on_submit()  # like a device: the inputs are ready, the (simulated) device time starts now
        time.sleep(self.delay_s)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._device(on_submit)
        return super().forward(embeds, positions, last_only=last_only, block_ids=block_ids)


class SlowSlots(SlowGraph):
    """SlowGraph over a graph of several KV slots (e.g. `serve --graph null`'s): every call, a prefill chunk or a
    decode step of B rows, takes `delay_s` and counts toward `fail_after`."""

    def __init__(self, inner: Any, delay_s: float, fail_after: int | None = None) -> None:
        super().__init__(inner, delay_s, fail_after)
        self.slots, self.decode_batches, self.prefill_buckets = inner.slots, inner.decode_batches, inner.prefill_buckets

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        self._device(on_submit)
        return self.inner.prefill(embeds, positions, slot, last_only=last_only)

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Any, *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        self._device(on_submit)
        return self.inner.decode(embeds, positions, slots)

    def rewind_slot(self, slot: int, position: int) -> int:
        return self.inner.rewind_slot(slot, position)


def slow_loader(host: Host, delay_s: float, fail_after: int | None = None) -> tuple[Callable[[], Graph], list[SlowGraph]]:
    """A loader of a SlowGraph around the host's own graph (SlowSlots when it has several KV slots, as the null graph
    has: the engine then batches); the list receives the graph once loaded."""
    made: list[SlowGraph] = []

    def load() -> Graph:
        inner = graph_loader(host)()
        graph = (SlowSlots if inner.slots > 1 else SlowGraph)(inner, delay_s, fail_after)
        made.append(graph)
        return graph

    return load, made


class LiveServer:
    def __init__(self, config: Settings, engine: Engine, host: Host) -> None:
        self.settings = config
        self.engine = engine
        self.host = host
        self.app = create_app(config, engine, host.info, page=chat_page_html())
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self, wait_ready: bool = True) -> LiveServer:
        self.thread.start()
        wait_until(lambda: self.server.started, "uvicorn to start", 60, alive=self.thread.is_alive)
        listener = self.server.servers[0]
        self.loop = listener.get_loop()
        self.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
        if wait_ready:
            self.wait_state("ok")
        return self

    def wait_state(self, state: str, timeout: float = 120.0) -> None:
        if state in ("ok", "error"):  # where loading ends
            self.engine.wait_ready(timeout)
            assert self.engine.state == state, f"engine in {self.engine.state}: {self.engine.state_reason}"
            return
        wait_until(lambda: self.engine.state == state, f"the engine to reach {state!r}", timeout)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the server's event loop (e.g. the app's drain)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@contextmanager
def live_server(config: Settings, engine: Engine | None = None, host: Host | None = None,
                wait_ready: bool = True) -> Iterator[LiveServer]:
    host = host or null_host()
    server = LiveServer(config, engine or build_engine(host, config), host).start(wait_ready)
    try:
        yield server
    finally:
        server.stop()


ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_serve(*args: str, timeout: float = 120) -> tuple[subprocess.Popen[str], str]:
    """`python -m server serve --graph null` on the demo artifacts, as a real process; returns once /health is ok.

    Output (stdout and stderr) is captured as text for the test to read after the process ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--artifacts", str(demo_dir()), "--graph", "null",
         "--port", str(port), *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    wait_serving(proc, f"{url}/health", timeout)
    return proc, url


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
