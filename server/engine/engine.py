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
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from server.engine.buckets import buckets_of, chunk_spans
from server.engine.types import (
    Delta,
    EngineNotReady,
    Finish,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    TokenConstraint,
    TokenLogprob,
)
from server.graphs.base import Graph
from server.model.detok import IncrementalDetokenizer, StopMatcher
from server.model.embedding import HostEmbedding
from server.sampling.sampler import Sampler

if TYPE_CHECKING:
    from server.constraints.constraint import ConstraintSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Shared:
    """What the worker and the watchdog threads both touch: read and written under `Engine._cond` only."""

    stopping: bool = False
    running: RequestHandle | None = None
    step_started: float | None = None  # while a graph call runs
    abandoned: bool = False  # the watchdog gave up on the current call
    stall: str | None = None  # why, until that call returns
    graph_calls: int = 0  # of the running request
    device_s: float = 0.0


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
        on_loaded: Callable[[], None] | None = None,
        constraints: Callable[[ConstraintSpec], TokenConstraint] | None = None,
    ) -> None:
        self.embedding = embedding
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._load_graph = load_graph
        self._on_loaded = on_loaded  # process-wide policy once the graph is in (see server.app.process)
        self._constraints = constraints  # a request's constraint (a value) -> a fresh matcher for one run
        self.graph: Graph | None = None
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.step_timeout_s = step_timeout_s
        self.prefix_reuse = prefix_reuse  # off only to measure what it saves

        # What /health reports is derived from these, so no transition can undo another (a stall that
        # recovers during a drain must leave the server draining).
        self._loaded = False
        self._load_error: str | None = None
        self._settled = threading.Event()  # loaded or failed: what wait_ready waits for
        self._draining = False
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._cond = threading.Condition()
        self._admitted = 0  # queued + running: what --max-queue bounds
        self._submitted: dict[RequestHandle, None] = {}  # in submission order, until the caller has the Finish
        self._shared = _Shared()
        self._cached: list[int] = []  # token ids whose KV the graph holds, slot = index
        self._kept: tuple[list[int], torch.Tensor] | None = None  # the last prefilled prompt and its last logits
        self._threads: list[threading.Thread] = []
        self._positions: list[torch.Tensor] = []

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        worker = threading.Thread(target=self._worker, name="device-owner", daemon=True)
        watchdog = threading.Thread(target=self._watchdog, name="device-watchdog", daemon=True)
        self._threads = [worker, watchdog]
        for thread in self._threads:
            thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the graph loaded (True: the engine serves) or failed to (False), or `timeout` passed."""
        return self._settled.wait(timeout) and self.state == "ok"

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._shared.stopping = True
            self._cond.notify_all()
        self.cancel_all()
        for thread in self._threads:
            thread.join(timeout)

    def in_flight(self) -> list[RequestHandle]:
        """Requests submitted whose caller has not received their Finish yet, oldest first."""
        with self._cond:
            for handle in [h for h in self._submitted if h.delivered]:
                del self._submitted[handle]
            return list(self._submitted)

    def cancel_all(self) -> None:
        """Cancel every request in flight."""
        for handle in self.in_flight():
            handle.cancel()

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
        return "error" if self._shared.stall is not None else "ok"

    @property
    def state_reason(self) -> str:
        state = self.state
        if state == "error":
            return self._load_error or self._shared.stall or ""
        return "shutting down" if state == "draining" else ""

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return 1 if self._shared.running is not None else 0

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
        """Raises EngineNotReady (loading, failed, draining) or QueueFull; the caller maps them to its protocol."""
        return self.submit_all([request])[0]

    def submit_all(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Admits all of `requests` or none (QueueFull), queued back to back: the choices of one request (n > 1, a
        list of prompts) run one after another, so each finds its prompt still in the cache (no prefill)."""
        state = self.state
        if state != "ok":
            raise EngineNotReady(state, self.state_reason)
        assert self.graph is not None
        assert all(0 < len(r.prompt_ids) < self.graph.max_total for r in requests), "the HTTP layer checks the budget"
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(request, loop) for request in requests]
        with self._cond:
            if self._admitted + len(handles) > self.max_queue:
                raise QueueFull(self.max_queue)
            self._admitted += len(handles)
            self._queue.extend(handles)
            self._submitted.update(dict.fromkeys(handles))
            self._cond.notify()
        return handles

    # ----------------------------------------------------------------- worker thread

    def _worker(self) -> None:
        try:
            self.graph = self._load_graph()
            if self._on_loaded is not None:
                self._on_loaded()
        except Exception as exc:  # noqa: BLE001 - any load failure is reported on /health, never raised into the void
            log.exception("graph failed to load")
            self._load_error = f"graph failed to load: {type(exc).__name__}: {exc}"
            self._settled.set()
            return
        # Decode positions, made once: [1, 1] each (a fresh torch.tensor per token is a call on the critical path).
        self._positions = [torch.tensor([[p]]) for p in range(self.graph.max_total)]
        self._loaded = True
        self._settled.set()
        log.info("graph ready: %s, max_total=%d, bucket=%d", self.graph.name, self.graph.max_total,
                 self.graph.prefill_bucket)
        shared = self._shared
        while True:
            with self._cond:
                while not self._queue and not shared.stopping:
                    self._cond.wait()
                if shared.stopping:
                    # Nobody may wait forever on a request the engine will never run.
                    while self._queue:
                        queued = self._queue.popleft()
                        queued.publish(self._finish(queued, "cancelled", len(queued.request.prompt_ids), 0))
                        self._admitted -= 1
                    return
                handle = self._queue.popleft()
                shared.running, shared.graph_calls, shared.device_s = handle, 0, 0.0
            try:
                if handle.cancelled.is_set():
                    handle.publish(self._finish(handle, "cancelled", 0, 0))
                else:
                    self._generate(handle)
            except _Abandoned:
                self._reset_cache()
            except Exception as exc:  # noqa: BLE001 - one request fails, the engine keeps serving
                log.exception("request %s failed in the graph", handle.request.request_id)
                self._reset_cache()
                if not handle.finished:
                    handle.publish(self._finish(handle, "error", len(handle.request.prompt_ids), 0,
                                                error=f"{type(exc).__name__}: {exc}"))
            finally:
                with self._cond:
                    shared.running = None
                    self._admitted -= 1
                    if shared.abandoned:
                        shared.abandoned, shared.stall = False, None

    def _reset_cache(self) -> None:
        self._cached, self._kept = [], None
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
        shared = self._shared
        with self._cond:
            shared.step_started = started = time.monotonic()
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
            with self._cond:
                shared.step_started = None
                shared.graph_calls += 1
                # Device time from the submission on: building the call's inputs is the host's work, not the device's.
                shared.device_s += time.monotonic() - (submitted or started)
                abandoned = shared.abandoned
        if abandoned:
            raise _Abandoned
        return logits

    def _deadline(self, handle: RequestHandle) -> float:
        """The request's wall-clock limit, counted from submission (queue time included)."""
        return handle.submitted + (handle.request.timeout_s or self.request_timeout_s)

    def _expire(self, handle: RequestHandle) -> None:
        """End a request whose limit ran out before it reached the device: no work nobody can wait for."""
        log.warning("request %s hit its wall-clock limit while queued", handle.request.request_id)
        handle.publish(self._finish(handle, "length", len(handle.request.prompt_ids), 0, timed_out=True))

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
        shared = self._shared
        while not shared.stopping:
            time.sleep(min(0.25, self.step_timeout_s / 4))
            self._expire_queued()
            with self._cond:
                handle, started = shared.running, shared.step_started
                if handle is None or started is None or shared.abandoned:
                    continue
                if time.monotonic() - started <= self.step_timeout_s:
                    continue
                message = f"graph call exceeded the {self.step_timeout_s:g} s step timeout"
                shared.abandoned, shared.stall = True, message
                finish = self._finish(handle, "error", len(handle.request.prompt_ids), 0, error=message)
            log.error("request %s: %s; the device is marked unhealthy until it returns",
                      handle.request.request_id, message)
            handle.publish(finish)

    def _finish(self, handle: RequestHandle, reason: str, prompt: int, completion: int, **extra: object) -> Finish:
        now = time.monotonic()
        started = handle.started or now
        shared = self._shared
        ran = handle is shared.running and handle.started is not None
        return Finish(reason=reason, prompt_tokens=prompt, completion_tokens=completion,
                      queue_wait_s=started - handle.submitted, total_s=now - handle.submitted,
                      graph_calls=shared.graph_calls if ran else 0, device_s=shared.device_s if ran else 0.0,
                      **extra)  # type: ignore[arg-type]

    def _constraint_for(self, request: GenerationRequest) -> TokenConstraint | None:
        """This run's matcher of the request's constraint: built here, per run, so the request stays a value that can
        run again (after a cache reset, or as another choice)."""
        if request.constraint is None:
            return None
        if self._constraints is None:
            raise RuntimeError("this engine was built without a constraint builder (see server.app.runtime.build_engine)")
        return self._constraints(request.constraint)

    def _generate(self, handle: RequestHandle) -> None:
        """prefill -> decode steps -> the stop reason, then the held-back text and the Finish."""
        graph = self.graph
        assert graph is not None
        request = handle.request
        handle.started = time.monotonic()
        deadline = self._deadline(handle)
        ids = list(request.prompt_ids)
        if time.monotonic() > deadline:  # it ran out between two watchdog sweeps of the queue
            self._expire(handle)
            return
        logits, reused, prefill_calls = self._prompt_logits(handle, ids)
        if logits is None:
            handle.publish(self._finish(handle, "cancelled", len(ids), 0, reused_tokens=reused,
                                        prefill_calls=prefill_calls))
            return

        constraint = self._constraint_for(request)
        sampler = Sampler(request.sampling, graph.vocab_size, ids, graph.host_softcap, constraint=constraint,
                          stop_ids=sorted(self.eos_token_ids), min_tokens=request.min_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=request.skip_special_tokens)
        stops = StopMatcher(request.stop)
        budget = min(request.max_new_tokens, graph.max_total - len(ids))
        generated = 0
        ttft: float | None = None
        error: str | None = None
        grammar_done = False  # ended by a finished constraint: what the detokenizer holds is still to be released
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
            if constraint is not None and not constraint.accept(token):
                # The mask allowed nothing the grammar accepts (an llguidance error state): end, never emit it.
                error = f"the output constraint rejected token {token}"
                reason = "error"
                break
            if token in self.eos_token_ids and not request.ignore_eos:
                handle.publish(Delta("", token, logprob))
                reason = "stop"
                break
            text, hit = stops.push(detok.push(token))
            delta = Delta(text, token, logprob)
            grammar_done = not hit and constraint is not None and constraint.is_finished
            # A finished grammar allows only a stop id: no device step to sample it.
            reason = "stop" if hit or grammar_done else self._stop_reason(handle, generated, budget, deadline)
            if reason is not None:
                handle.publish(delta)
                break
            # The event goes out when the graph submits the next step (see graphs.base): published here, the
            # event loop would take the GIL from this thread while it still builds that step's inputs.
            embeds = self.embedding.lookup([token])  # [1, 1, H]
            logits = self._call(embeds, self._positions[len(self._cached)], last_only=True,
                                publish=functools.partial(handle.publish, delta))
            self._cached.append(token)

        if error is not None:
            log.error("request %s: %s", request.request_id, error)
            handle.publish(self._finish(handle, "error", len(ids), generated, reused_tokens=reused,
                                        prefill_calls=prefill_calls, ttft_s=ttft, error=error))
            return
        timed_out = reason == "timeout"
        if timed_out:
            reason = "length"
        if reason != "stop" or grammar_done:
            # Release what the detokenizer and the stop matcher were holding back for a continuation.
            tail, hit = stops.push(detok.flush())
            if hit:
                reason = "stop"
            else:
                tail += stops.flush()
            if tail:
                handle.publish(Delta(tail))
        handle.publish(self._finish(handle, reason, len(ids), generated, reused_tokens=reused,
                                    prefill_calls=prefill_calls, ttft_s=ttft, timed_out=timed_out))

    def _prompt_logits(self, handle: RequestHandle, ids: list[int]) -> tuple[torch.Tensor | None, int, int]:
        """The logits the first token is sampled from: (logits [1, 1, V] or None if cancelled, reused, prefill calls).

        The same prompt as the last one (the 2nd..nth choice of a request, a regenerated answer) with its KV still in
        the cache costs no graph call: the last prefill's logits were kept (one [V] copy, 1 MB)."""
        assert self.graph is not None
        kept = self._kept
        if kept is not None and self.prefix_reuse and kept[0] == ids and self._cached[:len(ids)] == ids:
            start = self.graph.rewind(len(ids))
            del self._cached[start:]
            if start == len(ids):
                return kept[1], start, 0  # Sampler.sample never modifies its input: the kept copy stays as it was
        reused = self._rewind_to_common_prefix(ids)
        logits, calls = self._prefill(handle, ids, reused)
        # A copy: a graph may hand back a view of an output buffer its next call overwrites.
        self._kept = (list(ids), logits.clone()) if logits is not None else None
        return logits, reused, calls

    def _rewind_to_common_prefix(self, ids: list[int]) -> int:
        """Keep what the cache already holds of this prompt, but always recompute the last prompt token: its logits
        are what the first sampled token comes from. Returns the position prefill starts at."""
        assert self.graph is not None
        common = 0
        for cached, wanted in zip(self._cached if self.prefix_reuse else (), ids[:-1], strict=False):
            if cached != wanted:
                break
            common += 1
        start = self.graph.rewind(common)
        del self._cached[start:]
        return start

    def _prefill(self, handle: RequestHandle, ids: list[int], start: int) -> tuple[torch.Tensor | None, int]:
        """ids[start:] in chunks the graph's buckets cover with the fewest calls, then the least padding (see
        server.engine.buckets): (the last position's logits [1, 1, V] or None if cancelled, calls)."""
        assert self.graph is not None
        logits: torch.Tensor | None = None
        calls = 0
        for begin, end in chunk_spans(start, len(ids), buckets_of(self.graph)):
            if handle.cancelled.is_set():
                return None, calls
            chunk = ids[begin:end]
            embeds = self.embedding.lookup(chunk)  # [1, T, H]
            positions = torch.arange(begin, end).unsqueeze(0)  # [1, T]
            logits = self._call(embeds, positions, last_only=end >= len(ids))
            self._cached.extend(chunk)
            calls += 1
        assert logits is not None
        return logits, calls

    def _stop_reason(self, handle: RequestHandle, generated: int, budget: int, deadline: float) -> str | None:
        """Why decoding ends after this token ("length" | "timeout" | "cancelled"), or None to go on."""
        if generated >= budget:
            return "length"
        if time.monotonic() > deadline:
            log.warning("request %s hit its %g s wall-clock limit after %d tokens",
                        handle.request.request_id, deadline - handle.submitted, generated)
            return "timeout"
        return "cancelled" if handle.cancelled.is_set() else None
