"""The device owner: one worker thread runs the loop admit -> schedule -> run one step -> postprocess, a bounded FIFO
feeds it, asyncio queues carry small events back (the HTTP layer formats them). Here: lifecycle, admission, the
watchdog, and how a request ends; which step runs next is the scheduler's (server.engine.scheduler).

- Continuous batching: the queue's oldest request takes a free KV slot as soon as there is one (up to the graph's
  slots and --max-batch); the scheduler interleaves newcomers' prefill chunks with decode steps over every running
  sequence. A one-slot graph runs one request at a time, as before: the next starts once the running one ended.
- The choices of one request (n > 1: the same prompt, admitted together) run one after another in the same slot,
  so each finds its prompt, and its logits, still in the cache: no prefill. The graph protocol has no slot copy.
- `_retire` is the one way a request ends: it settles `admitted` and `running` before publishing the Finish, so a
  caller holding a Finish never reads a count that still includes its request.
- A graph call that raises ends the requests of that step with an error and resets their slots; the other running
  requests and the next ones run. One that stalls past `step_timeout_s` is abandoned by the watchdog: its requests
  get an error at once, and the engine reports `error` until the call returns (Python cannot interrupt it).
- The request stays a value: each run's Sequence and constraint matcher are built here (`_sequence`, `_constraint_for`).
- Prompt logprobs (a request's `prompt_logprobs`) come from each prefill chunk's logits at every position, soft-capped
  as the sampler's (`_score_prompt`), published as one `PromptLogprobs` event after the last chunk; such a prompt is
  prefilled whole (the scheduler reuses no cached prefix for it). Decode steps are untouched: only prefill scores.
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from server.constraints.thought import BudgetedThought
from server.engine.buckets import buckets_of
from server.engine.kv import KVSlots
from server.engine.runner import Abandoned, DeviceWatch, Runner, slot_graph
from server.engine.scheduler import DecodeStep, Scheduler, Step
from server.engine.sequence import Sequence, finish_event
from server.engine.types import (
    Delta,
    EngineNotReady,
    Event,
    Finish,
    GenerationRequest,
    PromptLogprobs,
    QueueFull,
    RequestHandle,
    Tokenizer,
    TokenLogprob,
    prompt_keys,
)
from server.graphs.base import Graph, VisionEncoder
from server.model.detok import IncrementalDetokenizer, StopMatcher
from server.model.embedding import HostEmbedding
from server.sampling.params import TokenConstraint
from server.sampling.primitives import prompt_logprobs
from server.sampling.sampler import Sampler, sample_rows

if TYPE_CHECKING:
    from server.constraints.constraint import ConstraintSpec

log = logging.getLogger(__name__)


class Engine:
    """Owns the graph. `start()` loads it on the worker thread (HTTP can listen meanwhile), then serves."""

    # Made by `_load` once the graph is in; only the worker thread uses them, and only after that.
    _runner: Runner
    _scheduler: Scheduler

    def __init__(self, embedding: HostEmbedding, tokenizer: Tokenizer, eos_token_ids: collections.abc.Sequence[int],
                 load_graph: Callable[[], Graph], *, max_queue: int = 16, request_timeout_s: float = 600.0,
                 step_timeout_s: float = 120.0, prefix_reuse: bool = True, on_loaded: Callable[[], None] | None = None,
                 constraints: Callable[[ConstraintSpec], TokenConstraint] | None = None, max_batch: int = 0,
                 load_vision: Callable[[], VisionEncoder] | None = None) -> None:
        self.embedding = embedding
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._load_graph = load_graph
        self._load_vision = load_vision  # the image encoder (None: a text-only server), loaded with the graph
        self._on_loaded = on_loaded  # process-wide policy once the graph is in (see server.app.process)
        self._constraints = constraints  # a request's constraint (a value) -> a fresh matcher for one run
        self.graph: Graph | None = None
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.step_timeout_s = step_timeout_s
        self.prefix_reuse = prefix_reuse  # off only to measure what it saves
        self.max_batch = max_batch  # most sequences at once (0: as many as the graph holds)
        self.capacity = 0  # how many run at once, known once the graph is in

        # What /health reports is derived from these, so no transition can undo another (a stall that
        # recovers during a drain must leave the server draining).
        self._loaded = False
        self._load_error: str | None = None
        self._settled = threading.Event()  # loaded or failed: what wait_ready waits for
        self._draining = False
        self._stopping = False
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._cond = threading.Condition()  # guards _queue, _live, _submitted, _stopping and _watch
        self._live: set[RequestHandle] = set()  # queued + running until their Finish: what --max-queue bounds
        self._running: set[RequestHandle] = set()  # admitted to a slot, until their Finish
        self._after: dict[RequestHandle, RequestHandle] = {}  # a queued choice -> the one it runs after (same prompt)
        self._submitted: dict[RequestHandle, None] = {}  # in submission order, until the caller has the Finish
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

    def in_flight(self) -> list[RequestHandle]:
        """Requests submitted whose caller has not received their Finish yet, oldest first."""
        with self._cond:
            for handle in [h for h in self._submitted if h.delivered]:
                del self._submitted[handle]
            return list(self._submitted)

    def cancel_all(self) -> None:
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
        return "error" if self._watch.stall is not None else "ok"

    @property
    def state_reason(self) -> str:
        state = self.state
        if state == "error":
            return self._load_error or self._watch.stall or ""
        return "shutting down" if state == "draining" else ""

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def step_batches(self) -> dict[int, int]:
        """Rows per graph call -> how many calls had that many (prefill chunks are calls of one row)."""
        with self._cond:
            return dict(self._watch.steps)

    def device_totals(self) -> tuple[int, float]:
        """(graph calls, seconds inside them) since the engine started: the rest of the worker's time is the host's."""
        with self._cond:
            return self._watch.calls, self._watch.device_s

    @property
    def admitted(self) -> int:
        return len(self._live)

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._live

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
        assert all(0 < len(r.prompt_ids) < self.graph.max_total for r in requests), "the HTTP layer checks the budget"
        loop = asyncio.get_running_loop()
        handles = [RequestHandle(request, loop) for request in requests]
        last: dict[tuple[int, ...], RequestHandle] = {}
        after = {}
        for handle in handles:
            key = prompt_keys(handle.request)  # the images' content too: the same ids with other images differ
            before = last.get(key)
            if before is not None:
                after[handle] = before
            last[key] = handle
        with self._cond:
            if len(self._live) + len(handles) > self.max_queue:
                raise QueueFull(self.max_queue)
            self._after.update(after)
            self._live.update(handles)
            self._queue.extend(handles)
            self._submitted.update(dict.fromkeys(handles))
            self._cond.notify()
        return handles

    # ----------------------------------------------------------------- how a request ends (any thread)

    def _finish(self, handle: RequestHandle, reason: str, prompt: int | None = None, **extra: object) -> Finish:
        """A Finish built outside a sequence (the request never ran): no completion tokens, no graph calls, `prompt`
        the prompt's length unless given."""
        prompt = len(handle.request.prompt_ids) if prompt is None else prompt
        return finish_event(handle, reason, prompt, 0, **extra)

    def _retire(self, handle: RequestHandle, *events: Event) -> None:
        """The one way a request ends: its counts settled, then its last events, the Finish last. A request that
        already ended (the watchdog abandoned it while its call ran) gets nothing more."""
        with self._cond:
            if handle not in self._live:
                return
            self._live.discard(handle)
            self._running.discard(handle)
            self._after.pop(handle, None)
        for event in events:
            handle.publish(event)

    def _deadline(self, handle: RequestHandle) -> float:
        """The request's wall-clock limit, counted from submission (queue time included)."""
        return handle.submitted + (handle.request.timeout_s or self.request_timeout_s)

    def _expire(self, handle: RequestHandle) -> None:
        """End a request whose limit ran out before it reached the device: no work nobody can wait for."""
        log.warning("request %s hit its wall-clock limit while queued", handle.request.request_id)
        self._retire(handle, self._finish(handle, "length", timed_out=True))

    # ----------------------------------------------------------------- watchdog thread

    def _watchdog(self) -> None:
        while not self._stopping:
            time.sleep(min(0.25, self.step_timeout_s / 4))
            self._expire_queued()
            self._abandon_stalled()

    def _expire_queued(self) -> None:
        """Queued requests past their wall-clock limit end now, even while the device is stuck on another."""
        now = time.monotonic()
        with self._cond:
            expired = [h for h in self._queue if now > self._deadline(h)]
            for handle in expired:
                self._queue.remove(handle)
        for handle in expired:
            self._expire(handle)

    def _abandon_stalled(self) -> None:
        """A graph call past the step timeout: its requests end with an error now; the engine reports the stall."""
        watch = self._watch
        with self._cond:
            rows, started = watch.rows, watch.step_started
            if not rows or started is None or watch.abandoned or time.monotonic() - started <= self.step_timeout_s:
                return
            message = f"graph call exceeded the {self.step_timeout_s:g} s step timeout"
            watch.abandoned, watch.stall = True, message
            # The worker is inside the call (it reads `abandoned` under this lock before touching these sequences
            # again): what they hold is theirs to read here.
            finishes = []
            for seq in rows:
                seq.reason, seq.error = "error", message
                finishes.append((seq, seq.finish()[1]))
        log.error("%s; the device is marked unhealthy until it returns", message)
        for seq, finish in finishes:
            self._retire(seq.handle, finish)

    # ----------------------------------------------------------------- worker thread

    def _worker(self) -> None:
        if self._load():
            while self._admit():
                self._sweep()
                step = self._scheduler.schedule()
                if step is not None:
                    self._step(step)

    def _load(self) -> bool:
        """Load the graph and what drives it; a failure is reported on /health, never raised into the void."""
        try:
            self.graph = graph = self._load_graph()
            vision = self._load_vision() if self._load_vision is not None else None
            if self._on_loaded is not None:
                self._on_loaded()
            slots = slot_graph(graph)
        except Exception as exc:  # noqa: BLE001 - reported by `state`
            log.exception("graph failed to load")
            self._load_error = f"graph failed to load: {type(exc).__name__}: {exc}"
            self._settled.set()
            return False
        self.capacity = min(slots.slots, max(slots.decode_batches), self.max_batch or slots.slots)
        self._runner = Runner(slots, self.embedding, self._cond, self._watch, graph.max_total, vision)
        self._scheduler = Scheduler(buckets_of(graph), KVSlots(slots.rewind_slot, self.capacity), self.capacity,
                                    prefix_reuse=self.prefix_reuse)
        self._loaded = True
        self._settled.set()
        log.info("graph ready: %s, max_total=%d, bucket=%d, %d at once (%d KV slots, decode batches %s)", graph.name,
                 graph.max_total, graph.prefill_bucket, self.capacity, slots.slots, list(slots.decode_batches))
        return True

    def _admit(self) -> bool:
        """Move queued requests into free slots (oldest first); wait for one while nothing runs. False once stopping
        and nothing runs any more (the queue ended)."""
        while True:
            with self._cond:
                while True:
                    handle = None if self._stopping else self._admissible()
                    if handle is not None or self._scheduler.busy or self._stopping:
                        break
                    self._cond.wait()
                if handle is None:
                    if self._stopping and not self._scheduler.busy:
                        queued = list(self._queue)
                        self._queue.clear()
                        break
                    return True
                self._queue.remove(handle)
                self._running.add(handle)
            self._start(handle)
        for handle in queued:  # nobody may wait forever on a request the engine will never run
            self._retire(handle, self._finish(handle, "cancelled"))
        return False

    def _admissible(self) -> RequestHandle | None:
        """The oldest queued request that may take a slot now (under the lock): none while the slots are full; a
        choice waits for the one before it (the same prompt), which leaves its slot with the prompt cached."""
        if not self._scheduler.has_room:
            return None
        for handle in self._queue:
            before = self._after.get(handle)
            if before is None or before not in self._live:
                self._after.pop(handle, None)
                return handle
        return None

    def _start(self, handle: RequestHandle) -> None:
        """Admit `handle` to the device: its Sequence, its slot (what the cache already holds of its prompt), its
        prefill plan."""
        handle.started = time.monotonic()
        if handle.cancelled.is_set():
            self._retire(handle, self._finish(handle, "cancelled", prompt=0))
            return
        if handle.started > self._deadline(handle):  # it ran out between two watchdog sweeps of the queue
            self._expire(handle)
            return
        try:
            seq = self._sequence(handle)
        except Exception as exc:  # noqa: BLE001 - e.g. a constraint's grammar compiled again: this request's fault, not
            # the device's, so the cache (and the next request's prefix) stays as it is
            log.exception("request %s could not start", handle.request.request_id)
            self._retire(handle, self._finish(handle, "error", error=f"{type(exc).__name__}: {exc}"))
            return
        if seq.budget == 0 and seq.prompt_logprobs is None:  # the prompt alone (echo, max_tokens 0): nothing to compute
            seq.reason = "length"
            self._end(seq)
            return
        kept = self._scheduler.add(seq)
        if kept is not None:  # the same prompt as this slot's last one, all of it still in the cache: no prefill at all
            self._postprocess((seq,), kept.reshape(1, -1))  # [1, V]

    def _sequence(self, handle: RequestHandle) -> Sequence:
        """What runs `handle`'s request: its sampler, detokenizer, stop matcher, constraint, budget and deadline."""
        graph = self.graph
        assert graph is not None
        request = handle.request
        longest = max(self._scheduler.buckets)
        if any(image.soft_tokens > longest for image in request.images):  # one image is one prefill call
            raise ValueError(f"an image of more soft tokens than the largest prefill chunk ({longest})")
        if request.images and self._runner.vision is None:
            raise ValueError("this engine has no vision encoder for the request's images")
        constraint = self._constraint_for(request)
        sampler = Sampler(request.sampling, graph.vocab_size, request.prompt_ids, graph.host_softcap,
                          constraint=constraint, stop_ids=sorted(self.eos_token_ids), min_tokens=request.min_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=request.skip_special_tokens)
        budget = min(request.max_new_tokens, graph.max_total - len(request.prompt_ids))
        return Sequence(handle, sampler, detok, StopMatcher(request.stop), constraint=constraint,
                        eos_ids=self.eos_token_ids, budget=budget, deadline=self._deadline(handle))

    def _constraint_for(self, request: GenerationRequest) -> TokenConstraint | None:
        """This run's matcher of the request's constraint (None: free text), inside its thinking budget if it has one:
        built here, per run, so the request stays a value that can run again (after a cache reset, or as another
        choice)."""
        inner = None
        if request.constraint is not None:
            if self._constraints is None:
                raise RuntimeError("this engine was built without a constraint builder (see "
                                   "server.app.runtime.build_engine)")
            inner = self._constraints(request.constraint)
        if request.thought_budget is None:
            return inner
        assert self.graph is not None
        return BudgetedThought(request.thought_budget, inner, (self.graph.vocab_size + 31) // 32)

    def _sweep(self) -> None:
        """A sequence still waiting for its prompt's next chunk that was cancelled ends now, not when its chunk comes
        up: checked between any two graph calls, so its slot is free within one step."""
        for seq in [seq for seq in self._scheduler.prefilling if seq.handle.cancelled.is_set()]:
            seq.reason = "cancelled"
            self._end(seq)

    def _step(self, step: Step) -> None:
        """Run one step, then postprocess: a decode step over its rows, or a prefill chunk (the prompt's last samples
        its first token). A fault ends the step's requests (their slots reset); the others go on."""
        rows = step.rows
        try:
            if isinstance(step, DecodeStep):
                # The held Deltas go out when the graph submits this step (server.engine.runner: publish on submit).
                logits = self._runner.decode(rows, on_submit=lambda: [seq.publish_pending() for seq in rows])  # [B, V]
            else:
                seq = step.seq
                scored = seq.prompt_logprobs is not None
                # [1, T, V]; [1, 1, V] of the last position for the prompt's last chunk, unless the prompt is scored
                logits = self._runner.prefill(seq, step.begin, step.end, last=step.last and not scored)
                seq.prefill_calls += 1
                if scored:
                    self._score_prompt(seq, step.begin, step.end, logits)
                if not step.last:
                    return
                logits = logits[:, -1:]  # [1, 1, V]
                assert seq.kv is not None
                seq.kv.keep(seq.prompt_keys, logits)  # [1, 1, V]
                logits = logits.reshape(1, -1)  # [1, V]
                if seq.prompt_logprobs is not None:
                    seq.handle.publish(PromptLogprobs(seq.token_ids[0], tuple(seq.prompt_logprobs)))
                if seq.budget == 0:  # the prompt was all it asked for (max_tokens 0): no token is sampled
                    seq.reason = "length"
                    self._end(seq)
                    return
        except Abandoned:  # the watchdog already ended these requests
            self._fail(rows, None)
            return
        except Exception as exc:  # noqa: BLE001 - this step's requests fail, the engine keeps serving
            log.exception("request %s failed in the graph", ", ".join(seq.handle.request.request_id for seq in rows))
            self._fail(rows, f"{type(exc).__name__}: {exc}")
            return
        self._postprocess(rows, logits)

    def _score_prompt(self, seq: Sequence, begin: int, end: int, logits: torch.Tensor) -> None:
        """The logprobs of prompt tokens begin+1..end (those the chunk's positions predict; the prompt's last position
        predicts the first generated token instead) from the chunk's logits [1, T, V], soft-capped as the sampler's."""
        assert seq.prompt_logprobs is not None and self.graph is not None
        if logits.shape[1] != end - begin:  # a graph that hands back fewer positions than it was given
            raise RuntimeError(f"the {self.graph.name} graph returned logits for {logits.shape[1]} of {end - begin} "
                               "positions: prompt logprobs need every position's")
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        targets = prompt[begin + 1 : end + 1]  # position p predicts token p + 1
        top = seq.handle.request.prompt_logprobs or 0
        rows = logits[0, : len(targets)]  # [T', V]
        for token, (logprob, best) in zip(targets, prompt_logprobs(rows, targets, top, self.graph.host_softcap),
                                          strict=True):
            seq.prompt_logprobs.append(TokenLogprob(token, logprob, tuple(best)))

    def _fail(self, rows: collections.abc.Sequence[Sequence], error: str | None) -> None:
        """A step failed: its requests end with `error` (None: already ended by the watchdog), their slots reset (the
        cache's contents are no longer trusted). An abandoned call has returned (or raised): the device answers again."""
        with self._cond:
            self._watch.recovered()
        for seq in rows:
            if seq.kv is not None:
                seq.kv.reset()
            self._scheduler.remove(seq)
            seq.publish_pending()
            if error is not None:
                seq.reason, seq.error = "error", error
                self._retire(seq.handle, seq.finish()[1])

    def _postprocess(self, rows: collections.abc.Sequence[Sequence], logits: torch.Tensor) -> None:
        """Each row's next token from its row of `logits` [B, V]: the sequence ends there, or its Delta waits for the
        next step."""
        for seq, result in zip(rows, sample_rows([seq.sampler for seq in rows], logits), strict=True):
            delta = seq.append(result)
            if seq.reason is None:
                seq.pending = delta
                self._scheduler.decodes(seq)
            else:
                self._end(seq, delta)

    def _end(self, seq: Sequence, last: Delta | None = None) -> None:
        """`seq` ended (its reason set): its slot freed, its last token's Delta (out first: a failing flush cannot lose
        it), the held-back text, then the Finish."""
        self._scheduler.remove(seq)
        if last is not None:
            seq.handle.publish(last)
        tail, finish = seq.finish()
        self._retire(seq.handle, *(delta for delta in (tail,) if delta is not None), finish)
