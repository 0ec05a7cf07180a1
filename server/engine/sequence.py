"""`Sequence`: the engine's one record of a request, from submission to its Finish: its `state` (waiting, preparing,
prefilling, decoding, finished) and the verbs that advance it token by token (`append`, then `finish` once `reason`
is set). It never calls the graph. Where it runs (its KV slot, the prefill chunks still to run) is the scheduler's
(server.engine.scheduler), recorded here so one value says it all. Its run parts (sampler, detokenizer, stop matcher,
constraint) are built when it is admitted (`start`), on the device thread, so a request stays a value until then.

- A token a constraint rejects is never emitted (an llguidance error state: the mask allowed nothing it accepts).
- A stop id is emitted as an empty Delta (its id, no text); a stop string's text is cut where the stop begins.
- A grammar that finished allows only a stop id: the sequence ends there, with no device step to sample it.
- What the detokenizer and the stop matcher hold back for a continuation is released at the end, unless a stop
  id or string ended the text (then the held text was the start of the stop, or nothing) or an error did.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from server.engine.types import Delta, Finish, RequestHandle, TokenLogprob, prompt_keys

if TYPE_CHECKING:  # only their types: this module imports no torch (its parts are built by the engine)
    import torch

    from server.engine.kv import KVSlot
    from server.model.detok import IncrementalDetokenizer, StopMatcher
    from server.sampling.params import TokenConstraint
    from server.sampling.sampler import Sampler, SampleResult

log = logging.getLogger(__name__)

SCORING_AHEAD = 2  # scored chunks of one prompt awaiting their worker before its next chunk waits (Sequence.ready)


def finish_event(handle: RequestHandle, reason: str, prompt_tokens: int, completion_tokens: int, *,
                 graph_calls: int = 0, device_s: float = 0.0, **extra: object) -> Finish:
    """The Finish of `handle`'s request now, its queue wait counted up to its start (or now, if it never started)."""
    now = time.monotonic()
    started = handle.started or now
    return Finish(reason=reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                  queue_wait_s=started - handle.submitted, total_s=now - handle.submitted,
                  graph_calls=graph_calls, device_s=device_s, **extra)  # type: ignore[arg-type]


class State(enum.Enum):
    WAITING = "waiting"  # submitted, not admitted yet
    PREPARING = "preparing"  # admitted to a slot; host work (`preparing`) may still run before its first graph call
    PREFILLING = "prefilling"  # its prompt's chunks are running
    DECODING = "decoding"  # its prompt is in the cache and a token sampled: its next step is a decode
    FINISHED = "finished"  # its Finish is published (or on its way)


class Sequence:
    """One request: ids, sampler, detokenizer, stop matcher, constraint, budget, counters, deadline, state."""

    __slots__ = ("handle", "state", "after", "preparing", "token_ids", "prompt_keys", "num_prompt_tokens", "sampler",
                 "constraint", "budget", "deadline", "generated", "ttft_s", "reused_tokens", "prefill_calls",
                 "graph_calls", "device_s", "pending", "reason", "error", "grammar_done", "kv", "chunks",
                 "source", "prompt_logprobs", "encoded", "scoring", "held_logits", "preemptions", "_detok", "_stops", "_eos_ids",
                 "_ignore_eos")

    # Built by `start` once the sequence is admitted (the engine's parts for one run of the request).
    sampler: Sampler
    constraint: TokenConstraint | None
    _detok: IncrementalDetokenizer
    _stops: StopMatcher

    def __init__(self, handle: RequestHandle, *, eos_ids: frozenset[int], budget: int, deadline: float,
                 after: Sequence | None = None) -> None:
        request = handle.request
        self.handle = handle
        self.state = State.WAITING
        self.after = after  # a choice of the same prompt admitted only once this one ended: it finds the prompt cached
        # Host work that must finish before the first graph call (an image encode, a restored prefix): the scheduler
        # skips the sequence until every future is done; one that failed ends it with its error.
        self.preparing: list[Future[Any]] = []
        self.encoded: dict[int, Future[torch.Tensor]] = {}  # an image's soft tokens [N, H] by its offset, from a worker
        # Each scored chunk's prompt logprobs, in prompt order, from a worker (server.engine.core); the last chunk's
        # logits [1, 1, V] wait in `held_logits` until all are in: the PromptLogprobs event precedes the first token.
        self.scoring: list[Future[list[TokenLogprob]]] = []
        self.held_logits: torch.Tensor | None = None
        self.token_ids = list(request.prompt_ids)  # the prompt, then each generated token
        self.num_prompt_tokens = len(self.token_ids)
        # What the KV cache holds at each prompt position: token ids, and at an image's soft tokens its content key
        # (server.engine.types.prompt_keys): prefix reuse compares these, never the placeholder ids alone.
        self.prompt_keys = prompt_keys(request)
        self.budget = budget  # max new tokens, within the context
        self.deadline = deadline  # monotonic wall-clock limit, counted from submission
        self.generated = 0
        self.ttft_s: float | None = None  # submission -> first token
        self.reused_tokens = 0  # prompt positions found in the KV cache
        self.prefill_calls = 0
        self.graph_calls = 0  # every call this sequence took part in (a batched decode step counts for each row)
        self.device_s = 0.0  # time inside those calls
        self.kv: KVSlot | None = None  # its slot while it runs (the scheduler's)
        self.chunks: collections.deque[tuple[int, int]] = collections.deque()  # prompt spans still to prefill
        # n > 1: the choice of the same prompt whose slot this one copies once that prompt is prefilled (the scheduler's)
        self.source: Sequence | None = None
        self.pending: Delta | None = None  # the last token's Delta, out when the next graph call submits
        self.reason: str | None = None  # set once the sequence ends: stop | length | timeout | cancelled | error
        self.error: str | None = None
        self.grammar_done = False  # ended by a finished constraint: what the detokenizer holds is still to be released
        # The logprobs of the prompt's 2nd..last tokens, chunk by chunk while it prefills (None: not asked for).
        self.prompt_logprobs: list[TokenLogprob] | None = None if request.prompt_logprobs is None else []
        self.preemptions = 0  # times it gave its KV back to let others run (the scheduler's `preempt`)
        self._eos_ids = eos_ids
        self._ignore_eos = request.ignore_eos

    def start(self, sampler: Sampler, detok: IncrementalDetokenizer, stops: StopMatcher,
              constraint: TokenConstraint | None) -> None:
        """Admitted: the parts that run it."""
        self.sampler, self._detok, self._stops, self.constraint = sampler, detok, stops, constraint

    def suspend(self) -> None:
        """Preempted: waiting again, its run parts kept. Admitted again, its slot is to hold its prompt and every token
        generated so far (`prompt_keys` grows by them: the last one's logits give the next token, as a decode step's
        would), its held token out now. A scored prompt preempted before its PromptLogprobs is scored again."""
        self.publish_pending()
        self.state = State.WAITING
        self.preemptions += 1
        if self.generated:
            self.prompt_keys = self.prompt_keys + tuple(self.token_ids[len(self.prompt_keys):])
            self.prompt_logprobs = None  # published before its first token
        elif self.prompt_logprobs is not None:
            for work in self.scoring:
                work.cancel()
            self.prompt_logprobs, self.scoring, self.held_logits = [], [], None

    @property
    def ready(self) -> bool:
        """Its host work is done: the scheduler may give it graph calls. A scored prompt also waits while SCORING_AHEAD
        of its chunks are still being scored: each holds its [T, V] logits, and host memory is the budget."""
        return (all(work.done() for work in self.preparing)
                and sum(not work.done() for work in self.scoring) < SCORING_AHEAD)

    @property
    def host_failure(self) -> BaseException | None:
        """The error of a piece of its host work that failed (None: none did, so far)."""
        for work in (*self.preparing, *self.scoring):
            if work.done() and not work.cancelled() and (error := work.exception()) is not None:
                return error
        return None

    def drop_host_work(self) -> None:
        """It ended: host work not started yet never starts (a worker is not held up by a request nobody waits for)."""
        for work in (*self.preparing, *self.scoring):
            work.cancel()
        self.held_logits = None

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    def append(self, result: SampleResult) -> Delta | None:
        """Advance everything by one sampled token: its Delta (None when it must not be emitted); sets `reason`
        when the sequence ends with it."""
        token = result.token_id
        self.sampler.accept(token)
        self.token_ids.append(token)
        self.generated += 1
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.handle.submitted
        logprob = TokenLogprob(token, result.logprob, result.top_logprobs) if result.logprob is not None else None
        constraint = self.constraint
        if constraint is not None and not constraint.accept(token):
            self.reason, self.error = "error", f"the output constraint rejected token {token}"
            return None
        if token in self._eos_ids and not self._ignore_eos:
            self.reason = "stop"
            return Delta("", token, logprob)
        text, hit = self._stops.push(self._detok.push(token))
        self.grammar_done = not hit and constraint is not None and constraint.is_finished
        self.reason = "stop" if hit or self.grammar_done else self.stop_reason()
        return Delta(text, token, logprob)

    def stop_reason(self) -> str | None:
        """Why decoding ends after this token ("length" | "timeout" | "cancelled"), or None to go on."""
        if self.generated >= self.budget:
            return "length"
        if time.monotonic() > self.deadline:
            log.warning("request %s hit its %g s wall-clock limit after %d tokens",
                        self.handle.request.request_id, self.deadline - self.handle.submitted, self.generated)
            return "timeout"
        return "cancelled" if self.handle.cancelled.is_set() else None

    def publish_pending(self) -> None:
        """The held Delta out to the caller (the runner calls this when the next graph call submits)."""
        delta, self.pending = self.pending, None
        if delta is not None:
            self.handle.publish(delta)

    @property
    def image_blocks(self) -> list[tuple[int, int]]:
        """Prompt spans [begin, end) that one prefill call must hold whole: the images' soft tokens."""
        return [image.span for image in self.handle.request.images]

    def finish(self) -> tuple[Delta | None, Finish]:
        """Once `reason` is set: (the held-back text released, if any, and the Finish). Publishes nothing."""
        reason, timed_out = self.reason, self.reason == "timeout"
        assert reason is not None, "finish() after the sequence ended"
        tail: Delta | None = None
        if reason == "error":
            log.error("request %s: %s", self.handle.request.request_id, self.error)
        elif reason != "stop" or self.grammar_done:  # release what the detokenizer and the stop matcher held back
            text, hit = self._stops.push(self._detok.flush())
            if not hit:
                text += self._stops.flush()
            reason = "stop" if hit else "length" if timed_out else reason  # a timeout is reported as "length"
            tail = Delta(text) if text else None
        return tail, finish_event(self.handle, reason, self.num_prompt_tokens, self.generated,
                                  graph_calls=self.graph_calls, device_s=self.device_s, reused_tokens=self.reused_tokens,
                                  prefill_calls=self.prefill_calls, ttft_s=self.ttft_s, error=self.error, timed_out=timed_out,
                                  stop_sequence=self._stops.matched if reason == "stop" else None)
