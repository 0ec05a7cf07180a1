"""What the HTTP layer and the engine exchange, torch-free: requests, events, the engine's own errors, the tokenizer.

- Requests are built by keyword only, so a new optional field (`constraint`, `min_tokens`, ...) never shifts another.
- The engine's errors carry what a caller needs (the state, a retry-after) and no HTTP: `api/` maps them to statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from server.sampling.params import SamplingParams

if TYPE_CHECKING:
    import tokenizers

    from server.constraints.constraint import ConstraintSpec
    from server.constraints.thought import ThoughtBudget


class Tokenizer(Protocol):
    """The tokenizer as the API and the engine call it (server.model.tokenizer.HostTokenizer is one): the API renders,
    encodes and decodes; the engine's detokenizer decodes with the Rust tokenizer itself (`backend_tokenizer`)."""

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def convert_ids_to_tokens(self, token_id: int) -> str | None: ...
    # `messages` and the template variables are the template's JSON, whatever the chat format puts there.
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            **kwargs: Any) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageInput:
    """One image of a prompt, as the image processor prepared it for the vision encoder (server.vision), torch-free:
    its soft tokens sit at prompt positions [offset, offset + soft_tokens), ids the model's image token. `digest` is
    the content hash of exactly what the encoder reads (pixels, patch positions, budget): the KV cache's key for
    those positions, so the same image re-sent reuses its KV and another image behind the same ids never does."""

    digest: bytes
    budget: int  # the processor's max_soft_tokens for it
    soft_tokens: int  # the processor's count for this image (it depends on the aspect ratio)
    pixel_values: Any = field(compare=False, repr=False)  # numpy float32 [P, D] patches (P = budget * k^2, padded)
    position_ids: Any = field(compare=False, repr=False)  # numpy int64 [P, 2] patch (x, y); (-1, -1) on padding
    offset: int = 0  # the prompt position of its first soft token (set once the prompt is tokenized)

    @property
    def span(self) -> tuple[int, int]:
        return self.offset, self.offset + self.soft_tokens


def image_key(digest: bytes, index: int) -> int:
    """The KV cache's key for soft token `index` of an image: a negative int, so it never equals a token id."""
    return -((int.from_bytes(digest[:8], "big") << 12) | index) - 1


def prompt_keys(request: GenerationRequest) -> tuple[int, ...]:
    """What the KV cache holds at each prompt position: the token id, or an image's key at its soft tokens."""
    if not request.images:
        return request.prompt_ids
    keys = list(request.prompt_ids)
    for image in request.images:
        begin, end = image.span
        keys[begin:end] = [image_key(image.digest, i) for i in range(end - begin)]
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class KVUsage:
    """The KV cache as a prefix-aware router reads it (server.api.metrics at scrape time), torch-free.

    A slot is in use while a request runs in it; an idle slot that still holds tokens is a cached prefix: the
    conversation whose next turn would skip prefilling them here (KVSlots.choose sends it back to that slot). An
    idle slot is also what a newcomer takes, so cached prefixes are kept only until the slots are needed.
    """

    slots: int = 0  # KV slots the engine schedules (0 while the graph loads)
    slots_in_use: int = 0  # held by a running request
    tokens_capacity: int = 0  # positions the slots can hold: slots * the build's context (max_total), or the pool's
    tokens_in_use: int = 0  # positions written by running requests (their prompt so far and what they generated)
    cached_prefixes: int = 0  # idle slots holding KV for reuse
    cached_tokens: int = 0  # the positions those idle slots hold
    # KV lent by need (a v4 build's pool of blocks; 0 without one): blocks it lends, and those lent now (to running
    # requests and to idle slots' cached prefixes alike)
    blocks: int = 0
    blocks_in_use: int = 0


def completion_budget(max_total: int, prompt_tokens: int, requested: int | None) -> int:
    """The tokens a completion may have: `requested` (None: as many as fit), capped by what the context leaves after
    the prompt. The one rule for it, applied by the API (which refuses a prompt that leaves less than one) and by the
    engine (which holds every request to it)."""
    room = max_total - prompt_tokens
    return room if requested is None else min(requested, room)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    timeout_s: float | None = None  # wall-clock limit from submission; None = the engine's default
    skip_special_tokens: bool = True
    # What the output may be (a grammar, banned ids, ...; None = free text, zero cost): a value, from which each run
    # gets a fresh matcher (Engine._constraint_for), applied as a vocabulary mask and advanced with every token.
    constraint: ConstraintSpec | None = None
    ignore_eos: bool = False  # stop ids do not end the generation (only max_tokens, stop strings, the context do)
    min_tokens: int = 0  # stop ids are masked out until this many tokens were generated
    # A cap on the thought channel's tokens (None = none): the closing marker is forced there. Applied around
    # `constraint` by each run's matcher (Engine._constraint_for); it needs no grammar vocabulary.
    thought_budget: ThoughtBudget | None = None
    # The prompt's own token logprobs (vLLM's `prompt_logprobs`): None = off; k = each prompt token's logprob and its
    # k best alternatives, from the prefill's logits at every prompt position. Such a request prefills its whole
    # prompt (a cached prefix has no logits to give); max_new_tokens may then be 0 (the prompt alone is scored).
    prompt_logprobs: int | None = None
    images: tuple[ImageInput, ...] = ()  # in prompt order, their spans inside prompt_ids (the engine encodes them)


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
class PromptLogprobs:
    """The prompt's token logprobs (a request's `prompt_logprobs`), once its prefill ended, before its first Delta:
    the first token (which nothing predicts: it has none), then each later token's, in order."""

    first_token: int
    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
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
    stop_sequence: str | None = None  # the stop string that ended it (its text is cut from the output), else None


Event = Delta | PromptLogprobs | Finish


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: its text, its deltas, its token ids (eos included when it stopped there), how it ended."""

    text: str
    token_ids: list[int]
    finish: Finish
    deltas: list[Delta] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them


class EngineError(Exception):
    """A request the engine will not take now; `retry_after_s` says when trying again makes sense."""

    retry_after_s = 1


class EngineNotReady(EngineError):
    """Loading, failed (load error or a stalled device) or draining: `state` and `reason` say which."""

    retry_after_s = 5

    def __init__(self, state: str, reason: str = "") -> None:
        super().__init__(f"The model is not ready: {state}{': ' + reason if reason else ''}")
        self.state = state
        self.reason = reason


class QueueFull(EngineError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The server is busy: {limit} requests are already admitted. Retry shortly.")
        self.limit = limit


class RequestHandle:
    """One request: the caller's side (an async stream of events, `cancel()`) and the worker's (`publish`)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.submitted = time.monotonic()
        self.started: float | None = None
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.delivered = False  # set on the caller's side once the Finish was received

    def publish(self, event: Event) -> None:
        """The worker side: hand one event to the caller's event loop (thread-safe)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()

    async def events(self) -> AsyncIterator[Event]:
        while not isinstance(event := await self._events.get(), Finish):
            yield event
        self.delivered = True
        yield event

    async def result(self) -> Completion:
        """Wait for the whole generation (non-streaming callers)."""
        return await collect(self.events())


async def collect(events: AsyncIterator[Event]) -> Completion:
    """An event stream gathered into one Completion."""
    deltas: list[Delta] = []
    prompt: PromptLogprobs | None = None
    async for event in events:
        if isinstance(event, Finish):
            ids = [d.token_id for d in deltas if d.token_id is not None]
            return Completion("".join(d.text for d in deltas), ids, event, deltas, prompt)
        if isinstance(event, PromptLogprobs):
            prompt = event
        else:
            deltas.append(event)
    raise AssertionError("the event stream ended without a Finish")
