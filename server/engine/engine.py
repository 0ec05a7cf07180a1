"""The engine's front: the device-owner thread that loads the graph and steps the core (server.engine.core), the
watchdog thread, admission from the event loop (the --max-queue bound), and the lifecycle /health reports.

- Continuous batching is the core's and the scheduler's: a waiting request takes a free KV slot as soon as there is
  one (up to the graph's slots and --max-batch); newcomers' prefill chunks interleave with decode steps.
- Host work (image encodes, prompt scoring) runs on the host workers it owns (server.engine.workers); one that
  finishes wakes the device thread.
- A graph call that stalls past `step_timeout_s` is abandoned by the watchdog: its requests get an error at once, and
  the engine reports `error` until the call returns (Python cannot interrupt it). Waiting requests past their
  wall-clock limit end even while the device is stuck.
"""

from __future__ import annotations

import asyncio
import collections.abc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from server.constraints.factory import ConstraintFactory
from server.engine.core import RUNNING, EngineCore
from server.engine.runner import DeviceWatch
from server.engine.sequence import State
from server.engine.types import EngineNotReady, GenerationRequest, KVUsage, QueueFull, RequestHandle
from server.engine.workers import HostWorkers

if TYPE_CHECKING:
    from server.engine.scheduler import Policy
    from server.engine.types import Tokenizer
    from server.graphs.base import Graph, VisionEncoder
    from server.model.embedding import HostEmbedding

log = logging.getLogger(__name__)


class Engine:
    """Owns the graph. `start()` loads it on the worker thread (HTTP can listen meanwhile), then serves."""

    core: EngineCore  # made by `_load` once the graph is in

    def __init__(self, embedding: HostEmbedding, tokenizer: Tokenizer, eos_token_ids: collections.abc.Sequence[int],
                 load_graph: Callable[[], Graph], *, max_queue: int = 16, request_timeout_s: float = 600.0,
                 step_timeout_s: float = 120.0, prefix_reuse: bool = True, on_loaded: Callable[[], None] | None = None,
                 constraints: ConstraintFactory | None = None, max_batch: int = 0,
                 load_vision: Callable[[], VisionEncoder] | None = None, policy: Policy | None = None,
                 host_workers: bool = True) -> None:
        self.embedding = embedding
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._load_graph = load_graph
        self._load_vision = load_vision  # the image encoder (None: a text-only server), loaded with the graph
        self._on_loaded = on_loaded  # process-wide policy once the graph is in (see server.app.process)
        self._constraints = constraints  # None: thinking budgets only (see ConstraintFactory)
        self.graph: Graph | None = None
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.step_timeout_s = step_timeout_s
        self._prefix_reuse = prefix_reuse  # off only to measure what it saves
        self.max_batch = max_batch  # most sequences at once (0: as many as the graph holds)
        self.capacity = 0  # how many run at once, known once the graph is in
        self._policy = policy  # the scheduler's (None: its default, server.engine.scheduler.TokenBudget)
        # Image encodes and prompt scoring on host worker threads (off: on the device thread, only to measure that)
        self._workers = HostWorkers(threads=host_workers, on_done=self._wake)

        # What /health reports is derived from these, so no transition can undo another (a stall that
        # recovers during a drain must leave the server draining).
        self._loaded = False
        self._load_error: str | None = None
        self._settled = threading.Event()  # loaded or failed: what wait_ready waits for
        self._draining = False
        self._stopping = False
        self._cond = threading.Condition()  # guards the core's records, _stopping and _watch
        self._watch = DeviceWatch()
        self._threads: list[threading.Thread] = []

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._worker, name="device-owner", daemon=True),
                         threading.Thread(target=self._watchdog, name="device-watchdog", daemon=True)]
        for thread in self._threads:
            thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the graph loaded (True: the engine serves) or failed to (False), or `timeout` passed."""
        return self._settled.wait(timeout) and self.state == "ok"

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.cancel_all()
        for thread in self._threads:
            thread.join(timeout)
        self._workers.shutdown()

    def _wake(self) -> None:
        """A host worker finished a piece of work: the device thread may have a sequence to schedule now."""
        with self._cond:
            self._cond.notify_all()

    def in_flight(self) -> list[RequestHandle]:
        """Requests submitted whose caller has not received their Finish yet, oldest first."""
        if not self._loaded:
            return []
        with self._cond:
            return [handle for handle in self.core.records if not handle.delivered]

    def cancel_all(self) -> None:
        for handle in self.in_flight():
            handle.cancel()

    def drain(self) -> None:
        """Stop admitting; in-flight and queued requests run to completion."""
        self._draining = True

    @property
    def prefix_reuse(self) -> bool:
        return self._prefix_reuse

    @prefix_reuse.setter
    def prefix_reuse(self, on: bool) -> None:
        self._prefix_reuse = on
        if self._loaded:  # takes effect from the next admission
            self.core.scheduler.prefix_reuse = on

    @property
    def state(self) -> str:
        """loading | ok | error | draining"""
        if self._load_error is not None:
            return "error"
        if self._draining:
            return "draining"
        if not self._loaded:
            return "loading"
        return "error" if self._watch.stall is not None else "ok"

    @property
    def state_reason(self) -> str:
        state = self.state
        if state == "error":
            return self._load_error or self._watch.stall or ""
        return "shutting down" if state == "draining" else ""

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return self.core.count(State.WAITING) if self._loaded else 0

    @property
    def running(self) -> int:
        """Requests holding a slot (preparing, prefilling or decoding)."""
        return self.core.count(*RUNNING) if self._loaded else 0

    @property
    def kv_usage(self) -> KVUsage:
        """The KV slots' use and the prefixes they keep for reuse (server.engine.types.KVUsage): what a router reads."""
        if not self._loaded:
            return KVUsage()
        scheduler = self.core.scheduler
        return scheduler.slots.usage(self.core.graph.max_total, scheduler.pool)

    @property
    def admitted(self) -> int:
        """Requests waiting or running, until their Finish: what --max-queue bounds."""
        return self.core.live if self._loaded else 0

    @property
    def step_batches(self) -> dict[int, int]:
        """Rows per graph call -> how many calls had that many (prefill chunks are calls of one row)."""
        with self._cond:
            return dict(self._watch.steps)

    def device_totals(self) -> tuple[int, float]:
        """(graph calls, seconds inside them) since the engine started: the rest of the worker's time is the host's."""
        with self._cond:
            return self._watch.calls, self._watch.device_s

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.admitted

    # ----------------------------------------------------------------- admission (event-loop side)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Raises EngineNotReady (loading, failed, draining) or QueueFull; the caller maps them to its protocol."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: collections.abc.Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Admits all of `requests` or none (QueueFull), queued back to back. Those with the same prompt (the choices
        of one request, n > 1) run one after another in one slot, so each finds its prompt still in the cache (no
        prefill); different prompts (a list of prompts) run side by side where there are slots."""
        state = self.state
        if state != "ok":
            raise EngineNotReady(state, self.state_reason)
        assert self.graph is not None
        assert all(0 < len(r.prompt_ids) < self.graph.max_total for r in requests), "the HTTP layer checks the context"
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(request, loop) for request in requests]
        with self._cond:
            if self.core.live + len(handles) > self.max_queue:
                raise QueueFull(self.max_queue)
            self.core.add(handles)
            self._cond.notify()
        return handles

    # ----------------------------------------------------------------- the device-owner thread

    def _worker(self) -> None:
        if not self._load():
            return
        core = self.core
        while True:
            with self._cond:
                while not self._stopping and not core.busy and not core.admissible:
                    self._cond.wait()
                if self._stopping and not core.busy:
                    break
            if core.step(admit=not self._stopping) is None and core.busy:
                with self._cond:  # every admitted sequence waits on its host work (Sequence.preparing)
                    self._cond.wait(0.01)
        core.cancel_waiting()

    def _load(self) -> bool:
        """Load the graph and what drives it; a failure is reported on /health, never raised into the void."""
        try:
            self.graph = graph = self._load_graph()
            vision = self._load_vision() if self._load_vision is not None else None
            # after the graph, whose weights' reads it would slow: the table's rows into the page cache before the
            # first prompts look them up on this thread
            self.embedding.warm()
            if self._on_loaded is not None:
                self._on_loaded()
        except Exception as exc:  # noqa: BLE001 - reported by `state`
            log.exception("graph failed to load")
            self._load_error = f"graph failed to load: {type(exc).__name__}: {exc}"
            self._settled.set()
            return False
        self.capacity = min(graph.slots, max(graph.decode_batches), self.max_batch or graph.slots)
        self.core = EngineCore(graph, self.embedding, self.tokenizer, self.eos_token_ids,
                               constraints=self._constraints or ConstraintFactory(graph.vocab_size),
                               capacity=self.capacity, request_timeout_s=self.request_timeout_s, lock=self._cond,
                               watch=self._watch, vision=vision, prefix_reuse=self._prefix_reuse,
                               policy=self._policy, workers=self._workers)
        self._loaded = True
        self._settled.set()
        log.info("graph ready: %s, max_total=%d, buckets=%s, %d at once (%d KV slots, decode batches %s)", graph.name,
                 graph.max_total, list(graph.prefill_buckets), self.capacity, graph.slots, list(graph.decode_batches))
        return True

    # ----------------------------------------------------------------- the watchdog thread

    def _watchdog(self) -> None:
        while not self._stopping:
            time.sleep(min(0.25, self.step_timeout_s / 4))
            if self._loaded:
                self.core.expire_waiting(time.monotonic())
                self._abandon_stalled()

    def _abandon_stalled(self) -> None:
        """A graph call past the step timeout: its requests end with an error now; the engine reports the stall."""
        watch = self._watch
        with self._cond:
            rows, started = watch.rows, watch.step_started
            if not rows or started is None or watch.abandoned or time.monotonic() - started <= self.step_timeout_s:
                return
            message = f"graph call exceeded the {self.step_timeout_s:g} s step timeout"
            watch.abandoned, watch.stall = True, message
            self.core.abandon(rows, message)
        log.error("%s; the device is marked unhealthy until it returns", message)
