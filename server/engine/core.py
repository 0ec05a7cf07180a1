"""The engine core: every request's one record (`Sequence`, with its state) and `step()`, which admits waiting requests
into free KV slots, asks the scheduler for the next step, runs that one graph call and postprocesses it. Synchronous
and thread-free, so a test walks it one graph call at a time; the front (server.engine.engine) drives it from the
device-owner thread and adds the lifecycle, the queue bound and the watchdog.

- Admission is first come, first served. The choices of one request (n > 1: the same prompt) run side by side when
  the graph copies slots: admitted together, one prefills the prompt, its slot is copied into the others' and each
  samples its first token from the same logits (its own sampler and seed), so they decode in one batch. Else (or past
  the free slots) a choice is admitted once the one before it ended and finds the prompt, and its logits, still in
  that slot's cache: no prefill either.
- Held tokens: a sampled token's Delta waits for the next graph call and goes out when that call submits its device
  work, whatever the call is (a decode step or another sequence's prefill chunk): server.graphs.base `on_submit`.
- `_retire` is the one way a request ends: its record is marked finished before its Finish is published, so a caller
  holding a Finish never reads a count that still includes its request. The lock (the front's) guards the records'
  states against the front's other threads; graph calls run outside it.
- A graph call that raises ends the requests of that step with an error and resets their slots; the others go on.
- KV lent by need (a graph's `pool`: a v4 build): a request waits until its prompt's KV fits (the scheduler's `fits`),
  and a step whose rows would run the pool short first evicts idle slots' KV, then preempts the youngest running
  request (latest submitted), which waits to be admitted again and resumes its stream (`_resume`). A prompt longer
  than one slot's reach of the pool (or the context) is refused at once, in the API's wording (server.errors).
- Prompt logprobs (a request's `prompt_logprobs`) come from each prefill chunk's logits at every position, soft-capped
  as the sampler's, published as one `PromptLogprobs` event after the last chunk. Any other chunk hands back its last
  position's logits only: nothing else of them is read.
- Host work runs on host workers (server.engine.workers), never on the device thread, which only runs graph calls and
  the sampler: a host vision encoder's image encodes are submitted at admission (the sequence is `preparing` until
  they are done); a scored chunk's log-softmax/gather over its [T, V] logits is submitted once the chunk returns (a
  graph's logits are its own tensor until dropped: every graph here hands back a fresh one a call, or a read-only
  view), and the prompt's last logits wait in `held_logits` until every chunk is scored, so the PromptLogprobs event
  still comes before the first token. A failed piece of host work ends its request with the error.
"""

from __future__ import annotations

import collections.abc
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from server.engine.kv import KVSlots
from server.engine.runner import Abandoned, DeviceWatch, Runner
from server.engine.scheduler import DecodeStep, Policy, PrefillStep, Scheduler, Step
from server.engine.sequence import Sequence, State, finish_event
from server.engine.types import (
    Delta,
    Event,
    Finish,
    PromptLogprobs,
    RequestHandle,
    TokenLogprob,
    completion_budget,
    prompt_keys,
)
from server.engine.workers import SCORING, VISION, HostWorkers
from server.errors import context_overflow
from server.graphs.base import kv_pool
from server.model.detok import IncrementalDetokenizer, StopMatcher
from server.sampling.primitives import prompt_logprobs
from server.sampling.sampler import Sampler, sample_rows

if TYPE_CHECKING:
    from server.constraints.factory import ConstraintFactory
    from server.engine.types import Tokenizer
    from server.graphs.base import Graph, VisionEncoder
    from server.model.embedding import HostEmbedding

log = logging.getLogger(__name__)

RUNNING = (State.PREPARING, State.PREFILLING, State.DECODING)


class EngineCore:
    """The records and the step (module docs). `capacity`: sequences at once; `request_timeout_s`: a request's default
    wall-clock limit, counted from submission."""

    def __init__(self, graph: Graph, embedding: HostEmbedding, tokenizer: Tokenizer, eos_ids: frozenset[int], *,
                 constraints: ConstraintFactory, capacity: int, request_timeout_s: float, lock: threading.Condition,
                 watch: DeviceWatch, vision: VisionEncoder | None = None, prefix_reuse: bool = True,
                 policy: Policy | None = None, workers: HostWorkers | None = None) -> None:
        self.graph = graph
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.constraints = constraints  # a request's constraint values -> this run's matcher
        self.request_timeout_s = request_timeout_s
        self.runner = Runner(graph, embedding, lock, watch, vision)
        self.workers = workers or HostWorkers.inline()  # inline: a test stepping the core sees every result at once
        # A cache that one prefill call rebuilds is cheap to evict (server.engine.kv: probes spare an agent's prefix).
        slots = KVSlots(graph.rewind_slot, capacity, short=max(graph.prefill_buckets))
        pool = kv_pool(graph)
        self.scheduler = Scheduler(graph.prefill_buckets, slots, capacity, prefix_reuse=prefix_reuse, policy=policy,
                                   pool=pool)
        # positions one request may use: the build's context, within one slot's reach of a pool
        self.context = graph.max_total if pool is None else min(graph.max_total, pool.reach)
        self.records: dict[RequestHandle, Sequence] = {}  # every request until its caller has its Finish, in order
        self._lock = lock
        self._watch = watch

    # ----------------------------------------------------------------- the records (any thread, under the lock)

    def add(self, handles: collections.abc.Sequence[RequestHandle]) -> list[Sequence]:
        """New requests, waiting in submission order. Among them, one with the prompt of one before it (the choices of
        one request) runs after that one; requests submitted apart run side by side, whatever their prompts."""
        with self._lock:
            for handle in [h for h, seq in self.records.items() if seq.finished and h.delivered]:
                del self.records[handle]
            last: dict[tuple[int, ...], Sequence] = {}
            added = []
            for handle in handles:
                request, key = handle.request, prompt_keys(handle.request)  # the images' content too
                deadline = handle.submitted + (request.timeout_s or self.request_timeout_s)
                budget = completion_budget(self.context, len(request.prompt_ids), request.max_new_tokens)
                seq = last[key] = Sequence(handle, eos_ids=self.eos_ids, budget=max(budget, 0), deadline=deadline,
                                           after=last.get(key))
                self.records[handle] = seq
                added.append(seq)
                overflow = context_overflow(len(request.prompt_ids), self.context, None)
                if overflow is not None:  # it could never run (the API refuses it first: server.app's max_total)
                    self._retire(seq, self._unrun(seq, "error", error=overflow.message))
            return added

    def count(self, *states: State) -> int:
        with self._lock:
            return sum(seq.state in states for seq in self.records.values())

    @property
    def live(self) -> int:
        """Requests admitted to the engine and not finished: waiting or running (what --max-queue bounds)."""
        return self.count(State.WAITING, *RUNNING)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def admissible(self) -> bool:
        """A waiting request could take a slot now."""
        return self.scheduler.has_room and self._first_admissible() is not None

    def _waiting(self) -> list[Sequence]:
        """The waiting requests, in submission order (a snapshot: the API's threads add to `records`)."""
        with self._lock:
            return [seq for seq in self.records.values() if seq.state is State.WAITING]

    def _first_admissible(self) -> Sequence | None:
        """The first waiting request that may start now; None when it must wait (for another's end, or for KV: first
        come, first served, so no later one overtakes it)."""
        seq = next((seq for seq in self._waiting()
                    if seq.after is None or seq.after.finished or self._copy_source(seq) is not None), None)
        return seq if seq is None or self.scheduler.fits(seq) else None

    def _copy_source(self, seq: Sequence) -> Sequence | None:
        """n > 1: the running choice whose prompt `seq` copies: once it is prefilled, or now when the source's slot holds
        exactly that prompt (it was all in the cache, or its last chunk just ran) and nothing decoded past it yet.
        None: it waits for the choice before it to end, as on a graph that cannot copy slots. (Not a slot that has
        decoded on: a copy rewound to the prompt would miss the sliding layers' ring entries its tokens overwrote.)"""
        after = seq.after
        if after is None or not self.graph.copies_slots or seq.prompt_logprobs is not None:
            return None
        source = after.source or after  # the choice before it may be a copy itself: then its source
        if source not in self.scheduler.active:
            return None
        return source if source.chunks or self._holds_prompt(source) else None

    @staticmethod
    def _holds_prompt(source: Sequence) -> bool:
        """`source`'s slot holds its whole prompt, no more, with the logits its first token came from."""
        kv = source.kv
        return (kv is not None and source.held_logits is None and not source.scoring
                and kv.kept_logits(source.prompt_keys) is not None and len(kv.tokens) == len(source.prompt_keys))

    def expire_waiting(self, now: float) -> None:
        """Waiting requests past their wall-clock limit end now (the watchdog's, even while the device is stuck)."""
        for seq in self._waiting():
            if now > seq.deadline:
                self._expire(seq)

    def cancel_waiting(self) -> None:
        """Every waiting request ends, cancelled: nobody may wait forever on a request the engine will never run."""
        for seq in self._waiting():
            self._drop_waiting(seq, "cancelled")

    # ----------------------------------------------------------------- the step (the device-owner thread)

    def step(self, admit: bool = True) -> Step | None:
        """admit -> schedule -> one graph call -> postprocess. Returns the step that ran (None: nothing could run)."""
        if admit:
            while self.scheduler.has_room and (seq := self._take_waiting()) is not None:
                self._start(seq)
        self._sweep()
        self._release_scored()
        step = self.scheduler.schedule()
        if step is not None and self.scheduler.pool is not None:  # KV lent by need: the step's blocks first
            step = self._room_for(step)
        if step is not None:
            self._run(step)
        return step

    def _room_for(self, step: Step) -> Step | None:
        """`step` once its rows' KV fits: idle slots' KV evicted, then the youngest running requests preempted (the
        step without them; None: nothing of it is left to run now)."""
        scheduler = self.scheduler
        while not scheduler.room_for(scheduler.step_needs(step)):
            active = scheduler.active
            victim = max(active, key=lambda seq: (seq.handle.submitted, active.index(seq)))
            log.info("request %s preempted: the KV pool is short (it resumes once admitted again)",
                     victim.handle.request.request_id)
            with self._lock:
                scheduler.preempt(victim)
            if isinstance(step, PrefillStep):
                if step.seq is victim:
                    return None
            else:
                rows = tuple(seq for seq in step.rows if seq is not victim)
                if not rows:
                    return None
                step = DecodeStep(rows)
        return step

    def _take_waiting(self) -> Sequence | None:
        with self._lock:
            seq = self._first_admissible()
            if seq is not None:
                seq.source = self._copy_source(seq)
                seq.state, seq.after = State.PREPARING, None  # out of the watchdog's reach, the choice link let go
            return seq

    def _start(self, seq: Sequence) -> None:
        """Admit `seq` to the device: its run parts, its slot (what the cache already holds of its prompt), its plan."""
        handle = seq.handle
        now = time.monotonic()
        if handle.cancelled.is_set():
            if not seq.preemptions:
                handle.started = now
            self._drop_waiting(seq, "cancelled", prompt=0)
            return
        if now > seq.deadline:  # it ran out between two watchdog sweeps of the waiting requests
            self._expire(seq)
            return
        if seq.preemptions:
            self._resume(seq)
            return
        handle.started = now
        try:
            self._build(seq)
        except Exception as exc:  # noqa: BLE001 - e.g. a constraint's grammar compiled again: this request's fault, not
            # the device's, so the cache (and the next request's prefix) stays as it is
            log.exception("request %s could not start", handle.request.request_id)
            self._retire(seq, self._unrun(seq, "error", error=f"{type(exc).__name__}: {exc}"))
            return
        if seq.budget == 0 and seq.prompt_logprobs is None:  # the prompt alone (echo, max_tokens 0): nothing to compute
            seq.reason = "length"
            self._end(seq)
            return
        if seq.source is not None:  # its prompt is copied from its source's slot once prefilled
            source = seq.source
            self.scheduler.add_copy(seq, source)
            if not source.chunks:  # the source's slot holds the prompt already (`_copy_source`): copy it now
                self._copy_now(source, seq)
            return
        kept = self.scheduler.add(seq)
        vision = self.runner.vision
        if vision is not None and vision.on_host:  # images still to prefill are encoded on a worker meanwhile
            for image in seq.handle.request.images:
                if image.offset >= seq.reused_tokens:
                    seq.encoded[image.offset] = work = self.workers.submit(VISION, self.runner.encode, image)
                    seq.preparing.append(work)
        if kept is not None:  # the same prompt as this slot's last one, all of it still in the cache: no prefill at all
            self._postprocess((seq,), kept.reshape(1, -1))  # [1, V]

    def _resume(self, seq: Sequence) -> None:
        """A preempted `seq` admitted again: its run parts as they were, its slot to hold what it had (prompt and
        generated tokens; what the slot still keeps is not prefilled again), its next token from the last chunk."""
        kept = self.scheduler.add(seq)
        if kept is not None:
            self._postprocess((seq,), kept.reshape(1, -1))  # [1, V]

    def _copy_now(self, source: Sequence, seq: Sequence) -> None:
        """n > 1: `seq`'s slot takes a copy of `source`'s, which holds their prompt and its kept logits, and `seq`
        samples its first token from those logits (no prefill of its own)."""
        assert source.kv is not None
        kept = source.kv.kept_logits(source.prompt_keys)
        assert kept is not None  # `_holds_prompt` said so, and no step ran since
        logits = kept.reshape(1, -1)  # [1, V]
        if self._copy_prompt(source, seq, logits):
            self._postprocess((seq,), logits)

    def _drop_waiting(self, seq: Sequence, reason: str, prompt: int | None = None) -> None:
        """A waiting request ends unrun; one preempted earlier ends as a running one would (its tokens counted, its
        held-back text released)."""
        if not seq.preemptions:
            self._retire(seq, self._unrun(seq, reason, prompt=prompt, timed_out=reason == "length"))
            return
        seq.reason = "timeout" if reason == "length" else reason
        self._end(seq)

    def _build(self, seq: Sequence) -> None:
        """`seq`'s run parts: its sampler, detokenizer, stop matcher and constraint (a fresh matcher for this run)."""
        graph, request = self.graph, seq.handle.request
        longest = self.scheduler.buckets[-1]
        if any(image.soft_tokens > longest for image in request.images):  # one image is one prefill call
            raise ValueError(f"an image of more soft tokens than the largest prefill chunk ({longest})")
        if request.images and (self.runner.vision is None or not graph.image_blocks):
            raise ValueError("this engine has no vision encoder and image-block graph for the request's images")
        constraint = self.constraints(request.constraint, request.thought_budget)
        sampler = Sampler(request.sampling, graph.vocab_size, request.prompt_ids, graph.host_softcap,
                          constraint=constraint, stop_ids=sorted(self.eos_ids), min_tokens=request.min_tokens)
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=request.skip_special_tokens)
        seq.start(sampler, detok, StopMatcher(request.stop), constraint)

    def _sweep(self) -> None:
        """A prefilling sequence that was cancelled, or whose host work failed, ends now, not when its chunk comes up:
        checked between any two graph calls, so its slot is free within one step."""
        # (choices waiting for a copy of another's prompt too: a cancelled one frees its slot now)
        for seq in [seq for seq in self.scheduler.active
                    if seq.chunks or seq.held_logits is not None or seq.source is not None]:
            failed = seq.host_failure
            if seq.handle.cancelled.is_set():
                seq.reason = "cancelled"
            elif failed is not None:
                seq.reason, seq.error = "error", f"{type(failed).__name__}: {failed}"
            else:
                continue
            self._end(seq)

    def _run(self, step: Step) -> None:
        """One graph call, then its postprocess. A fault ends the step's requests (their slots reset); the others go on."""
        rows = step.rows
        try:
            if isinstance(step, DecodeStep):
                logits: torch.Tensor | None = self.runner.decode(rows, on_submit=self._publish_held)  # [B, V]
            else:
                logits = self._prefill(step)  # [1, V], or None: no token to sample now
        except Abandoned:  # the watchdog already ended these requests
            self._fail(rows, None)
            return
        except Exception as exc:  # noqa: BLE001 - this step's requests fail, the engine keeps serving
            log.exception("request %s failed in the graph", ", ".join(seq.handle.request.request_id for seq in rows))
            self._fail(rows, f"{type(exc).__name__}: {exc}")
            return
        if logits is not None:
            if isinstance(step, PrefillStep):
                rows, logits = self._share_prompt(step.seq, logits)
            self._postprocess(rows, logits)

    def _release_scored(self) -> None:
        """A scored prompt whose every chunk is scored now: its PromptLogprobs, then its first token."""
        for seq in self.scheduler.active[:]:  # (a copy: a sequence that ends leaves the list)
            logits = seq.held_logits
            if logits is None or not all(work.done() for work in seq.scoring):
                continue
            seq.held_logits = None
            try:
                first = self._after_prompt(seq, logits)
            except Exception as exc:  # noqa: BLE001 - the sweep saw no failure yet: one can land between the two
                self._fail((seq,), f"{type(exc).__name__}: {exc}")
                continue
            if first is not None:
                rows, first = self._share_prompt(seq, first)  # n > 1: the choices waiting for this prompt too
                self._postprocess(rows, first)

    def _share_prompt(self, seq: Sequence, logits: torch.Tensor) -> tuple[tuple[Sequence, ...], torch.Tensor]:
        """`seq`'s prompt is prefilled: its slot copied into each choice waiting for it, which reuse its logits [1, V].
        The rows to sample and their logits [B, V] (a view: every row the same)."""
        rows = (seq, *(choice for choice in self.scheduler.copies_of(seq) if self._copy_prompt(seq, choice, logits)))
        return rows, logits.expand(len(rows), -1)

    def _copy_prompt(self, source: Sequence, choice: Sequence, logits: torch.Tensor) -> bool:
        """`choice`'s slot takes a copy of `source`'s prefilled prompt and keeps its last logits [1, V] (the same prompt
        again needs no call). False: the copy failed, and `choice` with it (its source and the others go on)."""
        try:
            self.runner.copy_slot(source, choice)
        except Exception as exc:  # noqa: BLE001 - that choice fails, the others go on
            log.exception("request %s: its slot copy failed", choice.handle.request.request_id)
            self._fail([choice], f"{type(exc).__name__}: {exc}")
            return False
        self.scheduler.copied(choice)
        assert choice.kv is not None
        choice.kv.keep(choice.prompt_keys, logits[:, None])  # [1, 1, V]
        return True

    def _publish_held(self) -> None:
        for seq in self.scheduler.decoding:
            seq.publish_pending()

    def _prefill(self, step: PrefillStep) -> torch.Tensor | None:
        """One chunk of a prompt; after its last, the logits [1, V] its first token is sampled from (None: no token to
        sample now)."""
        seq = step.seq
        scored = seq.prompt_logprobs is not None
        # [1, T, V] when the prompt is scored, else [1, 1, V] of the chunk's last position
        logits = self.runner.prefill(seq, step.begin, step.end, last_only=not scored, on_submit=self._publish_held)
        seq.prefill_calls += 1
        if scored:
            seq.scoring.append(self._score_prompt(seq, step.begin, step.end, logits))
        if not step.last:
            return None
        logits = logits[:, -1:]  # [1, 1, V]
        assert seq.kv is not None
        seq.kv.keep(seq.prompt_keys, logits)  # [1, 1, V]
        if not all(work.done() for work in seq.scoring):  # its first token after its PromptLogprobs (_release_scored)
            seq.held_logits = logits
            return None
        return self._after_prompt(seq, logits)

    def _after_prompt(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
        """The whole prompt is in the cache (and scored, if asked): its PromptLogprobs out, and the logits [1, V] its
        first token is sampled from (None: no token to sample)."""
        if seq.prompt_logprobs is not None:
            for work in seq.scoring:
                seq.prompt_logprobs += work.result()  # a worker's error is raised here: this request's
            seq.handle.publish(PromptLogprobs(seq.token_ids[0], tuple(seq.prompt_logprobs)))
        if seq.budget == 0:  # the prompt was all it asked for (max_tokens 0): no token is sampled
            seq.reason = "length"
            self._end(seq)
            return None
        return logits.reshape(1, -1)  # [1, V]

    def _score_prompt(self, seq: Sequence, begin: int, end: int, logits: torch.Tensor) -> Future[list[TokenLogprob]]:
        """The logprobs of prompt tokens begin+1..end (those the chunk's positions predict; the prompt's last position
        predicts the first generated token instead) from the chunk's logits [1, T, V], soft-capped as the sampler's:
        checked here, computed on a scoring worker."""
        if logits.shape[1] != end - begin:  # a graph that hands back fewer positions than it was given
            raise RuntimeError(f"the {self.graph.name} graph returned logits for {logits.shape[1]} of {end - begin} "
                               "positions: prompt logprobs need every position's")
        targets = seq.token_ids[begin + 1 : min(end + 1, seq.num_prompt_tokens)]  # position p predicts token p + 1
        return self.workers.submit(SCORING, _scored, logits[0, : len(targets)], targets,  # [T', V]
                                   seq.handle.request.prompt_logprobs or 0, self.graph.host_softcap)

    def _postprocess(self, rows: collections.abc.Sequence[Sequence], logits: torch.Tensor) -> None:
        """Each row's next token from its row of `logits` [B, V]: the sequence ends there, or its Delta is held until
        the next graph call submits."""
        for seq, result in zip(rows, sample_rows([seq.sampler for seq in rows], logits), strict=True):
            delta = seq.append(result)
            if seq.reason is None:
                seq.pending, seq.state = delta, State.DECODING
            else:
                self._end(seq, delta)

    # ----------------------------------------------------------------- how a request ends (any thread)

    def _fail(self, rows: collections.abc.Sequence[Sequence], error: str | None) -> None:
        """A step failed: its requests end with `error` (None: already ended by the watchdog), their slots reset (the
        cache's contents are no longer trusted). An abandoned call has returned (or raised): the device answers again."""
        with self._lock:
            self._watch.recovered()
        for seq in rows:
            if seq.kv is not None:
                seq.kv.reset()
            self.scheduler.remove(seq)
            seq.publish_pending()
            if error is not None:
                seq.reason, seq.error = "error", error
                self._retire(seq, seq.finish()[1])

    def _end(self, seq: Sequence, last: Delta | None = None) -> None:
        """`seq` ended (its reason set): its slot freed, its last token's Delta (out first: a failing flush cannot lose
        it), the held-back text, then the Finish."""
        self.scheduler.remove(seq)
        if last is not None:
            seq.handle.publish(last)
        tail, finish = seq.finish()
        self._retire(seq, *(delta for delta in (tail,) if delta is not None), finish)

    def abandon(self, rows: collections.abc.Sequence[Sequence], message: str) -> None:
        """The watchdog gave up on the graph call of `rows` (it holds the lock; the worker is inside the call and
        touches them again only after reading `abandoned` under it): they end with `message` now."""
        for seq in rows:
            seq.reason, seq.error = "error", message
            self._retire(seq, seq.finish()[1])

    def _expire(self, seq: Sequence) -> None:
        """End a request whose limit ran out before it reached the device: no work nobody can wait for."""
        log.warning("request %s hit its wall-clock limit while queued", seq.handle.request.request_id)
        self._drop_waiting(seq, "length")

    @staticmethod
    def _unrun(seq: Sequence, reason: str, prompt: int | None = None, **extra: Any) -> Finish:
        """The Finish of a request that never ran: no completion tokens, no graph calls, `prompt` the prompt's length
        unless given."""
        return finish_event(seq.handle, reason, seq.num_prompt_tokens if prompt is None else prompt, 0, **extra)

    def _retire(self, seq: Sequence, *events: Event) -> None:
        """The one way a request ends: its record finished, then its last events, the Finish last. A request that
        already ended (the watchdog abandoned it while its call ran) gets nothing more."""
        with self._lock:
            if seq.finished:
                return
            seq.state = State.FINISHED
        seq.drop_host_work()
        for event in events:
            seq.handle.publish(event)


def _scored(rows: torch.Tensor, targets: list[int], top: int, softcap: float | None) -> list[TokenLogprob]:
    """A chunk's prompt logprobs (a scoring worker's): rows [T', V] predict `targets`."""
    scored = prompt_logprobs(rows, targets, top, softcap)
    return [TokenLogprob(token, logprob, tuple(best)) for token, (logprob, best) in zip(targets, scored, strict=True)]
