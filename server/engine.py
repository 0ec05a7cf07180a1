"""The device owner: one thread runs the graph, a bounded FIFO feeds it, asyncio queues carry events back.

Per request: reuse the longest common prefix already in the graph's KV cache (chats re-send the whole
conversation), prefill the rest in bucket-sized chunks, then decode until eos / stop string / max tokens /
end of context / wall-clock limit. Between any two graph calls the worker checks for cancellation, so a
client that goes away frees the device within one step.

Deliberate choices:
- One worker thread, batch size 1: the device holds one KV cache; there is nothing to batch with.
- The engine only emits small events; the HTTP layer formats them.
- A graph call that raises ends that request with an error event and resets the cache; the next request
  runs. A graph call that stalls past `step_timeout_s` is abandoned by a watchdog: its request gets an
  error at once, the engine reports `error` until the call returns (Python cannot interrupt it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import torch

from server.buckets import buckets_of, chunk_spans
from server.detok import IncrementalDetokenizer, StopMatcher
from server.embedding import HostEmbedding
from server.errors import APIError
from server.graphs.base import Graph
from server.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    timeout_s: float | None = None  # wall-clock limit from submission; None = the engine's default
    skip_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """New text safe to show (stop strings held back), and the token it came from (None for a final flush)."""

    text: str
    token_id: int | None = None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int = 0
    prefill_calls: int = 0
    queue_wait_s: float = 0.0
    ttft_s: float | None = None  # submission -> first token
    total_s: float = 0.0
    graph_calls: int = 0
    device_s: float = 0.0  # time inside those graph calls: the rest of total_s is queueing and host work
    error: str | None = None
    timed_out: bool = False


Event = Delta | Finish


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: its text, its token ids (eos included when it stopped there), and how it ended."""

    text: str
    token_ids: list[int]
    finish: Finish


class QueueFull(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            429,
            f"The server is busy: {limit} requests are already admitted. Retry shortly.",
            code="queue_full",
            headers={"Retry-After": "1"},
        )


class RequestHandle:
    """The caller's side of one request: an async stream of events, and `cancel()`."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False  # set by the worker side once a Finish was sent

    def _emit(self, event: Event) -> None:
        """Called from the worker thread."""
        if isinstance(event, Finish):
            self.finished = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Finish):
                return

    async def result(self) -> Completion:
        """Wait for the whole generation (non-streaming callers)."""
        text: list[str] = []
        token_ids: list[int] = []
        async for event in self.events():
            if isinstance(event, Finish):
                return Completion("".join(text), token_ids, event)
            text.append(event.text)
            if event.token_id is not None:
                token_ids.append(event.token_id)
        raise AssertionError("the event stream ended without a Finish")


class _Abandoned(Exception):
    """The watchdog gave up on the current graph call; its request already got an error."""


class Engine:
    """Owns the graph. `start()` loads it on the worker thread (HTTP can listen meanwhile), then serves."""

    def __init__(
        self,
        embedding: HostEmbedding,
        tokenizer: object,
        eos_token_ids: Sequence[int],
        load_graph: Callable[[], Graph],
        *,
        max_queue: int = 16,
        request_timeout_s: float = 600.0,
        step_timeout_s: float = 120.0,
        prefix_reuse: bool = True,
    ) -> None:
        self.embedding = embedding
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._load_graph = load_graph
        self.graph: Graph | None = None
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.step_timeout_s = step_timeout_s
        self.prefix_reuse = prefix_reuse  # off only to measure what it saves

        # What /health reports is derived from these, so no transition can undo another (a stall that
        # recovers during a drain must leave the server draining).
        self._loaded = False
        self._load_error: str | None = None
        self._stall: str | None = None  # set while a graph call is abandoned by the watchdog
        self._draining = False
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._cond = threading.Condition()
        self._admitted = 0  # queued + running: what --max-queue bounds
        self._running: RequestHandle | None = None
        self._cached: list[int] = []  # token ids whose KV the graph holds, slot = index
        self._step_started: float | None = None
        self._abandoned = False
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._positions: list[torch.Tensor] = []
        self._graph_calls = 0  # of the running request
        self._device_s = 0.0

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        worker = threading.Thread(target=self._worker, name="device-owner", daemon=True)
        watchdog = threading.Thread(target=self._watchdog, name="device-watchdog", daemon=True)
        self._threads = [worker, watchdog]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            for handle in self._queue:
                handle.cancel()
            if self._running is not None:
                self._running.cancel()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def drain(self) -> None:
        """Stop admitting; in-flight and queued requests run to completion."""
        self._draining = True

    @property
    def state(self) -> str:
        """loading | ok | error | draining"""
        if self._load_error is not None:
            return "error"
        if self._draining:
            return "draining"
        if not self._loaded:
            return "loading"
        return "error" if self._stall is not None else "ok"

    @property
    def state_reason(self) -> str:
        state = self.state
        if state == "error":
            return self._load_error or self._stall or ""
        return "shutting down" if state == "draining" else ""

    @property
    def ready(self) -> bool:
        return self.state == "ok"

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return 1 if self._running is not None else 0

    @property
    def admitted(self) -> int:
        return self._admitted

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._admitted == 0

    # ----------------------------------------------------------------- admission (event-loop side)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        state, reason = self.state, self.state_reason
        if state != "ok":
            raise APIError(503, f"The model is not ready: {state}{': ' + reason if reason else ''}",
                           code="model_" + state, headers={"Retry-After": "5"})
        assert self.graph is not None
        assert 0 < len(request.prompt_ids) < self.graph.max_total, "the HTTP layer checks the context budget"
        handle = RequestHandle(request, asyncio.get_running_loop())
        with self._cond:
            if self._admitted >= self.max_queue:
                raise QueueFull(self.max_queue)
            self._admitted += 1
            self._queue.append(handle)
            self._cond.notify()
        return handle

    # ----------------------------------------------------------------- worker thread

    def _worker(self) -> None:
        try:
            self.graph = self._load_graph()
        except Exception as exc:  # noqa: BLE001 - any load failure is reported on /health, never raised into the void
            log.exception("graph failed to load")
            self._load_error = f"graph failed to load: {type(exc).__name__}: {exc}"
            return
        # Everything built so far (transformers' modules, the tokenizer, the graph) lives as long as the process.
        # Freezing it out of the collector's generations stops full collections from walking those millions of
        # objects in the middle of a stream (they were the p99 of the per-token host overhead).
        gc.collect()
        gc.freeze()
        # Decode positions, made once: [1, 1] each (a fresh torch.tensor per token is a call on the critical path).
        self._positions = [torch.tensor([[p]]) for p in range(self.graph.max_total)]
        self._loaded = True
        log.info("graph ready: %s, max_total=%d, bucket=%d", self.graph.name, self.graph.max_total,
                 self.graph.prefill_bucket)
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    # Nobody may wait forever on a request the engine will never run.
                    while self._queue:
                        queued = self._queue.popleft()
                        queued._emit(self._finish(queued, "cancelled", len(queued.request.prompt_ids), 0))
                        self._admitted -= 1
                    return
                handle = self._queue.popleft()
                self._running = handle
            try:
                if handle.cancelled.is_set():
                    handle._emit(self._finish(handle, "cancelled", 0, 0))
                else:
                    self._generate(handle)
            except _Abandoned:
                self._reset_cache()
            except Exception as exc:  # noqa: BLE001 - one request fails, the engine keeps serving
                log.exception("request %s failed in the graph", handle.request.request_id)
                self._reset_cache()
                if not handle.finished:
                    handle._emit(self._finish(handle, "error", len(handle.request.prompt_ids), 0,
                                              error=f"{type(exc).__name__}: {exc}"))
            finally:
                with self._cond:
                    self._running = None
                    self._admitted -= 1
                if self._abandoned:
                    self._abandoned = False
                    self._stall = None

    def _reset_cache(self) -> None:
        self._cached = []
        if self.graph is not None:
            try:
                self.graph.rewind(0)
            except Exception:  # noqa: BLE001
                log.exception("graph rewind failed")

    def _call(self, embeds: torch.Tensor, positions: torch.Tensor, last_only: bool,
              publish: Callable[[], None] | None = None) -> torch.Tensor:
        """One graph call. `publish` (the previous token's event) runs when the graph submits its device work (see
        graphs.base), or after the call if the graph failed before that; once either way."""
        assert self.graph is not None
        self._step_started = started = time.monotonic()
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
            self._step_started = None
            if submitted is None and publish is not None:
                publish()
            self._graph_calls += 1
            # Device time from the submission on: building the call's inputs is the host's work, not the device's.
            self._device_s += time.monotonic() - (submitted or started)
        if self._abandoned:
            raise _Abandoned
        return logits

    def _deadline(self, handle: RequestHandle) -> float:
        """The request's wall-clock limit, counted from submission (queue time included)."""
        return handle.submitted + (handle.request.timeout_s or self.request_timeout_s)

    def _expire(self, handle: RequestHandle) -> None:
        """End a request whose limit ran out before it reached the device: no work nobody can wait for."""
        log.warning("request %s hit its wall-clock limit while queued", handle.request.request_id)
        handle._emit(self._finish(handle, "length", len(handle.request.prompt_ids), 0, timed_out=True))

    def _expire_queued(self) -> None:
        """Queued requests past their wall-clock limit end now, even while the device is stuck on another."""
        now = time.monotonic()
        with self._cond:
            expired = [h for h in self._queue if now > self._deadline(h)]
            for handle in expired:
                self._queue.remove(handle)
                self._admitted -= 1
        for handle in expired:
            self._expire(handle)

    def _watchdog(self) -> None:
        while not self._stopping:
            time.sleep(min(0.25, self.step_timeout_s / 4))
            self._expire_queued()
            started, handle = self._step_started, self._running
            if started is None or handle is None or self._abandoned:
                continue
            if time.monotonic() - started > self.step_timeout_s:
                self._abandoned = True
                message = f"graph call exceeded the {self.step_timeout_s:g} s step timeout"
                log.error("request %s: %s; the device is marked unhealthy until it returns",
                          handle.request.request_id, message)
                self._stall = message
                handle._emit(self._finish(handle, "error", len(handle.request.prompt_ids), 0, error=message))

    def _finish(self, handle: RequestHandle, reason: str, prompt: int, completion: int, **extra: object) -> Finish:
        now = time.monotonic()
        started = handle.started or now
        ran = handle is self._running and handle.started is not None
        return Finish(reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                      queue_wait_s=started - handle.submitted, total_s=now - handle.submitted,
                      graph_calls=self._graph_calls if ran else 0, device_s=self._device_s if ran else 0.0,
                      **extra)  # type: ignore[arg-type]

    def _generate(self, handle: RequestHandle) -> None:
        graph = self.graph
        assert graph is not None
        request = handle.request
        self._graph_calls, self._device_s = 0, 0.0
        handle.started = time.monotonic()
        deadline = self._deadline(handle)
        ids = list(request.prompt_ids)
        if time.monotonic() > deadline:  # it ran out between two watchdog sweeps of the queue
            self._expire(handle)
            return

        # Prefix reuse: keep what the cache already holds of this prompt, but always recompute the
        # last prompt token: its logits are what the first sampled token comes from.
        common = 0
        for cached, wanted in zip(self._cached if self.prefix_reuse else (), ids[:-1], strict=False):
            if cached != wanted:
                break
            common += 1
        start = graph.rewind(common)
        del self._cached[start:]
        reused = start

        logits: torch.Tensor | None = None
        prefill_calls = 0
        for begin, end in chunk_spans(start, len(ids), buckets_of(graph)):
            if handle.cancelled.is_set():
                handle._emit(self._finish(handle, "cancelled", len(ids), 0, reused_tokens=reused,
                                          prefill_calls=prefill_calls))
                return
            chunk = ids[begin:end]
            embeds = self.embedding.lookup(chunk)  # [1, T, H]
            positions = torch.arange(begin, end).unsqueeze(0)  # [1, T]
            logits = self._call(embeds, positions, last_only=end >= len(ids))
            self._cached.extend(chunk)
            prefill_calls += 1
        assert logits is not None

        sampler = Sampler(request.sampling, graph.vocab_size, ids, graph.host_softcap)
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=request.skip_special_tokens)
        stops = StopMatcher(request.stop)
        budget = min(request.max_new_tokens, graph.max_total - len(ids))
        generated = 0
        ttft: float | None = None
        reason = "length"
        timed_out = False
        while True:
            # [1, 1, V] -> [V]: calls are last_only, so this is the last position (one torch call, [0, -1] is two)
            result = sampler.sample(logits.reshape(-1))
            token = result.token_id
            sampler.accept(token)
            generated += 1
            if ttft is None:
                ttft = time.monotonic() - handle.submitted
            logprob = (TokenLogprob(token, result.logprob, result.top_logprobs)
                       if result.logprob is not None else None)
            if token in self.eos_token_ids:
                handle._emit(Delta("", token, logprob))
                reason = "stop"
                break
            text, hit = stops.push(detok.push(token))
            delta = Delta(text, token, logprob)
            if hit:
                reason = "stop"
            elif generated >= budget:
                pass
            elif time.monotonic() > deadline:
                timed_out = True
                log.warning("request %s hit its %g s wall-clock limit after %d tokens",
                            request.request_id, deadline - handle.submitted, generated)
            elif handle.cancelled.is_set():
                reason = "cancelled"
            else:
                # The event goes out when the graph submits the next step (see graphs.base): published here, the
                # event loop would take the GIL from this thread while it still builds that step's inputs.
                embeds = self.embedding.lookup([token])  # [1, 1, H]
                logits = self._call(embeds, self._positions[len(self._cached)], last_only=True,
                                    publish=functools.partial(handle._emit, delta))
                self._cached.append(token)
                continue
            handle._emit(delta)
            break

        if reason != "stop":
            # Release what the detokenizer and the stop matcher were holding back for a continuation.
            tail, hit = stops.push(detok.flush())
            if hit:
                reason = "stop"
            else:
                tail += stops.flush()
            if tail:
                handle._emit(Delta(tail))
        handle._emit(self._finish(handle, reason, len(ids), generated, reused_tokens=reused,
                                  prefill_calls=prefill_calls, ttft_s=ttft, timed_out=timed_out))
