"""The generation routes: OpenAI's chat and legacy completions, the seed server's `/generate`, and vLLM's
`/tokenize` / `/detokenize` and `/v1/models`.

Each route reads and validates the whole request, tokenizes it, checks the context budget, builds the
`GenerationRequest` and submits it to the engine *before* any response starts: every client mistake, a full
queue (429) and a server that is not ready (503) are real HTTP statuses. Only what happens after the headers
of a stream are sent (a generation error, a cancellation at shutdown) travels in-band, as vLLM does:
`data: {"error": {...}}` then `data: [DONE]`.

Deliberate choices:
- `max_tokens` beyond what the context leaves is capped, not rejected (finish_reason says "length"): with a
  512-token graph, clients that send max_tokens=1024 should still get an answer.
- Unset sampling fields take the model's generation_config.json defaults, then OpenAI's.
- Completions logprobs with `echo` are rejected: the engine computes no prompt logprobs.
- `n > 1` and a list of prompts: the choices are admitted together (all or none) and run one after another on the
  batch-1 device; the 2nd..nth choice of a prompt finds it in the cache and runs no prefill. A stream sends each
  choice's chunks in turn, every chunk naming its `index`. `best_of` is refused: it would generate choices nobody
  sees.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from server.api.chat.constraints import OutputConstraints
from server.api.chat.plan import Prompts
from server.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    Message,
    SamplingFields,
    TokenizeRequest,
    parse,
)
from server.api.service import ClientGone, Service
from server.api.sse import DONE, GenerationStream, frame
from server.constraints.constraint import ConstraintSpec
from server.engine.types import (
    Delta,
    Finish,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenLogprob,
)
from server.errors import APIError
from server.protocol import OutputParser, ParsedDelta, PromptInputs, ToolCallDelta, collect
from server.protocol.base import PlainParser

log = logging.getLogger("server.api")

_LOGPROB_FLOOR = -9999.0  # vLLM's floor: JSON has no -inf


def _lp(value: float) -> float:
    return value if math.isfinite(value) and value > _LOGPROB_FLOOR else _LOGPROB_FLOOR


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The raw body, refusing more than `limit` bytes both by Content-Length and as it streams in (413), and a body
    that takes longer than `timeout_s` to arrive (408)."""
    too_large = APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, "Invalid Content-Length header.", code="invalid_request")
        if int(declared) > limit:
            raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:  # gone before the body was complete: nobody to answer, and not a server error
        raise APIError(499, "The client closed the connection before the request body was complete.",
                       code="client_closed_request") from None
    return bytes(body)


# ----------------------------------------------------------------------------------------------------------
# Response formats: what differs between chat and legacy completions


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares: its id, model and creation time."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def usage(finishes: Sequence[Finish], n: int) -> dict[str, int]:
    """OpenAI's usage over a request's choices, `n` per prompt: each prompt counted once, every completion."""
    prompt = sum(finish.prompt_tokens for finish in finishes[::n])
    completion = sum(finish.completion_tokens for finish in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Format:
    """Builds one choice's parts of the response (its stream chunks, its entry in the body) from engine events.

    Each format adds: opening() -> chunks before the first token; chunk(Delta) -> a chunk or None;
    final_chunks(reason); choice(text, deltas, finish) -> its entry in the non-stream body's `choices`."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, prompts: Prompts, envelope: Envelope, index: int, logprobs: bool) -> None:
        self.prompts = prompts
        self.envelope = envelope
        self.index = index
        self.logprobs = logprobs


class ChatFormat(_Format):
    """Chat responses: the generated text goes through the protocol's parser, which splits it into content, the
    thought channel (`reasoning_content`) and tool calls (`tool_calls`, finish_reason "tool_calls")."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, prompts: Prompts, envelope: Envelope, index: int, logprobs: bool,
                 parser: OutputParser | None = None) -> None:
        super().__init__(prompts, envelope, index, logprobs)
        self.parser = parser or PlainParser()

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.prompts.token_info(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": raw}

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for d in deltas:
            if d.logprob is not None:
                entry = self._entry(d.logprob.token_id, d.logprob.logprob)
                entry["top_logprobs"] = [self._entry(t, lp) for t, lp in d.logprob.top]
                content.append(entry)
        return {"content": content}

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self.envelope.wrap(self.chunk_object_name, [choice])

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    @staticmethod
    def _delta_fields(parsed: ParsedDelta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if parsed.reasoning:
            fields["reasoning_content"] = parsed.reasoning
        if parsed.content:
            fields["content"] = parsed.content
        if parsed.tool_calls:
            fields["tool_calls"] = [_tool_call(call, index=True) for call in parsed.tool_calls]
        return fields

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        fields = self._delta_fields(self.parser.feed(delta.text)) if delta.text else {}
        if fields or (self.logprobs and delta.logprob is not None):
            return self._chunk(fields or {"content": ""}, self._logprobs([delta]), None)
        return None

    def final_chunks(self, reason: str) -> list[dict[str, Any]]:
        end = self.parser.finish()
        fields = self._delta_fields(end.delta)
        chunks = [self._chunk(fields, None, None)] if fields else []
        return [*chunks, self._chunk({}, None, _reason(reason, end.called_tools))]

    def choice(self, text: str, deltas: Sequence[Delta], finish: Finish) -> dict[str, Any]:
        parsed = collect(self.parser, text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
            message["content"] = parsed.content or None
        return {"index": self.index, "message": message, "logprobs": self._logprobs(deltas),
                "finish_reason": _reason(finish.reason, parsed.called_tools)}


def _reason(engine_reason: str, called_tools: bool) -> str:
    """A stop after complete calls is "tool_calls"; a cut ("length") stays what it is."""
    return "tool_calls" if called_tools and engine_reason == "stop" else engine_reason


def _tool_call(call: ToolCallDelta, index: bool = False) -> dict[str, Any]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **entry} if index else entry


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, prompts: Prompts, envelope: Envelope, index: int, logprobs: bool, echo: str = "") -> None:
        super().__init__(prompts, envelope, index, logprobs)
        self.echo = echo
        self.offset = len(echo)  # text_offset of the next token

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        """OpenAI's legacy shape; the chosen token is always among top_logprobs (as vLLM does)."""
        if not self.logprobs:
            return None
        tokens: list[str] = []
        token_logprobs: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for d in deltas:
            lp: TokenLogprob | None = d.logprob
            if lp is None:
                continue
            text = self.prompts.token_info(lp.token_id)[0]
            tokens.append(text)
            token_logprobs.append(_lp(lp.logprob))
            top = {self.prompts.token_info(t)[0]: _lp(v) for t, v in lp.top}
            top.setdefault(text, _lp(lp.logprob))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chunk(self, text: str, logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        return self.envelope.wrap(self.chunk_object_name,
                                  [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}])

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(self.echo, None, None)] if self.echo else []

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        if delta.text or (self.logprobs and delta.logprob is not None):
            return self._chunk(delta.text, self._logprobs([delta]), None)
        return None

    def final_chunks(self, reason: str) -> list[dict[str, Any]]:
        return [self._chunk("", None, reason)]

    def choice(self, text: str, deltas: Sequence[Delta], finish: Finish) -> dict[str, Any]:
        return {"index": self.index, "text": self.echo + text, "logprobs": self._logprobs(deltas),
                "finish_reason": finish.reason}


Format = ChatFormat | CompletionFormat


@dataclass(frozen=True)
class ChatPlan:
    """A chat request checked, rendered and compiled: what each of its choices submits, and how its output parses.
    The one path from a chat-shaped request to the engine (chat completions, and the Responses API through it)."""

    model: str
    ids: list[int]
    inputs: PromptInputs
    sampling: SamplingParams
    constraint: ConstraintSpec | None  # a value, shared by the choices: the engine builds each run's matcher
    new_parser: Callable[[], OutputParser]
    keep_special_tokens: bool


# ----------------------------------------------------------------------------------------------------------
# Routes


class OpenAIRoutes:
    def __init__(self, service: Service, prompts: Prompts, constraints: OutputConstraints) -> None:
        self.service = service
        self.prompts = prompts
        self.constraints = constraints
        self.settings = service.settings

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)

    def _sampling(self, body: SamplingFields, top_logprobs: int | None) -> SamplingParams:
        """`top_logprobs` None = no logprobs. Unset fields: the model's defaults, then OpenAI's."""
        defaults = self.prompts.model.generation_defaults

        def pick(value: float | None, name: str, fallback: float) -> float:
            return float(value if value is not None else defaults.get(name, fallback))

        bias = tuple((int(key), float(value)) for key, value in (body.logit_bias or {}).items())
        self.prompts.check_token_ids([token for token, _ in bias], "logit_bias")
        return SamplingParams(
            temperature=pick(body.temperature, "temperature", 1.0),
            top_k=max(0, int(pick(body.top_k, "top_k", 0))),
            top_p=pick(body.top_p, "top_p", 1.0),
            min_p=pick(body.min_p, "min_p", 0.0),
            repetition_penalty=pick(body.repetition_penalty, "repetition_penalty", 1.0),
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=body.seed,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
        )

    def check_choices(self, choices: int, param: str = "n") -> None:
        """A request's choices (n, times its prompts) are admitted together: bounded by --max-n and --max-queue."""
        limit = min(self.settings.max_n, self.settings.max_queue)
        if choices > limit:
            which = "--max-n" if limit == self.settings.max_n else "--max-queue"
            raise APIError(400, f"{param}: this request asks for {choices} choices; this server generates at most "
                           f"{limit} per request ({which})", param=param, code="invalid_value")

    def submit(self, prompts: Sequence[Sequence[int]], limit: int | None, param: str, n: int, *,
               sampling: SamplingParams, request_id: str, constraint: ConstraintSpec | None = None,
               **fields: Any) -> list[RequestHandle]:
        """The one place GenerationRequests are built from a parsed body: `n` choices per prompt, each prompt with its
        budget, then `fields`. Choice i (prompt-major, OpenAI's index) draws with seed + i, so a seeded request is
        reproducible and its choices differ; every choice carries the same `constraint` (a value)."""
        requests = []
        for p, ids in enumerate(prompts):
            budget = self.prompts.budget(len(ids), limit, param)
            for j in range(n):
                index = p * n + j
                seed = None if sampling.seed is None else sampling.seed + index
                requests.append(GenerationRequest(
                    prompt_ids=tuple(ids), max_new_tokens=budget, sampling=replace(sampling, seed=seed),
                    request_id=request_id if len(prompts) * n == 1 else f"{request_id}-{index}",
                    constraint=constraint, **fields))
        return self.service.submit(requests)

    async def _respond(self, request: Request, handles: Sequence[RequestHandle], fmts: Sequence[Format], n: int,
                       stream: bool, include_usage: bool) -> Response:
        if stream:
            def release() -> None:
                for handle in handles:
                    self.service.release(handle)

            return GenerationStream(self._stream(handles, fmts, n, include_usage), release,
                                    ping_s=self.settings.sse_ping_s)
        try:
            done = await self.service.collect(request, handles)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        choices = [fmt.choice(c.text, c.deltas, c.finish) for fmt, c in zip(fmts, done, strict=True)]
        envelope = fmts[0].envelope
        return JSONResponse({**envelope.wrap(fmts[0].object_name, choices),
                             "usage": usage([c.finish for c in done], n)})

    async def _stream(self, handles: Sequence[RequestHandle], fmts: Sequence[Format], n: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        """The choices one after another (they run so on the device), each chunk naming its choice's index."""
        envelope = fmts[0].envelope
        try:
            for fmt in fmts:
                for payload in fmt.opening():
                    yield frame(payload)
            finishes: list[Finish] = []
            for handle, fmt in zip(handles, fmts, strict=True):
                async for event in self.service.events(handle):
                    if isinstance(event, Delta):
                        chunk = fmt.chunk(event)
                        if chunk is not None:
                            yield frame(chunk)
                        continue
                    finishes.append(event)
                    for payload in fmt.final_chunks(event.reason):
                        yield frame(payload)
            if include_usage:
                yield frame({**envelope.wrap(fmts[0].chunk_object_name, []), "usage": usage(finishes, n)})
        except Exception as exc:  # noqa: BLE001 - after the headers: in-band; a bug must still end the stream properly
            yield frame(self.service.stream_failure(exc, envelope.id).to_json())
        yield frame(DONE)

    # ------------------------------------------------------------------ POST /v1/chat/completions

    async def chat_completions(self, request: Request) -> Response:
        body = parse(ChatCompletionRequest, await self._body(request))
        n = body.n or 1
        self.check_choices(n)
        plan = await self.plan_chat(body)
        envelope = Envelope(f"chatcmpl-{request.state.completion_id}", plan.model)
        handles = self.submit([plan.ids], body.token_limit, "messages", n, sampling=plan.sampling,
                              constraint=plan.constraint, stop=body.stop, request_id=envelope.id,
                              skip_special_tokens=not plan.keep_special_tokens, **self._eos_fields(body))
        fmts = [ChatFormat(self.prompts, envelope, i, plan.sampling.logprobs, plan.new_parser()) for i in range(n)]
        return await self._respond(request, handles, fmts, n, bool(body.stream), body.include_usage)

    async def plan_chat(self, body: ChatCompletionRequest) -> ChatPlan:
        """Checks, the prompt through the model's protocol and template, and the output constraint."""
        model = self.prompts.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs", code="invalid_value")
        sampling = self._sampling(body, (body.top_logprobs or 0) if body.logprobs else None)
        ids, inputs = await self.prompts.chat_prompt(body)
        constraint = await self.constraints.plan(body, inputs)
        protocol = self.prompts.protocol
        tool_names = [tool.function["name"] for tool in body.tools or ()]
        parse_tools = bool(tool_names) and body.tool_choice != "none"
        return ChatPlan(model, ids, inputs, sampling, constraint,
                        functools.partial(protocol.parser, tool_names=tool_names, parse_tool_calls=parse_tools),
                        protocol.keep_special_tokens)

    @staticmethod
    def _eos_fields(body: SamplingFields) -> dict[str, Any]:
        return {"ignore_eos": bool(body.ignore_eos), "min_tokens": body.min_tokens or 0}

    # ------------------------------------------------------------------ POST /v1/completions

    async def completions(self, request: Request) -> Response:
        body = parse(CompletionRequest, await self._body(request))
        model = self.prompts.check_model(body.model)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo: prompt logprobs are not supported; use echo or logprobs, not both",
                           param="echo", code="invalid_value")
        n = body.n or 1
        self.check_choices(n * len(body.prompt), "n" if len(body.prompt) == 1 else "prompt")
        sampling = self._sampling(body, body.logprobs)
        prompts: list[list[int]] = []
        echoes: list[str] = []
        for index, prompt in enumerate(body.prompt):
            if isinstance(prompt, str):
                prompts.append(await self.prompts.text_ids(prompt))  # with BOS, as vLLM does
                echoes.append(prompt)
            else:
                self.prompts.check_token_ids(prompt, "prompt" if len(body.prompt) == 1 else f"prompt[{index}]")
                prompts.append(list(prompt))
                echoes.append(await self.prompts.decode(prompt) if body.echo else "")
        envelope = Envelope(f"cmpl-{request.state.completion_id}", model)
        handles = self.submit(prompts, body.token_limit, "prompt", n, sampling=sampling, stop=body.stop,
                              request_id=envelope.id, **self._eos_fields(body))
        fmts = [CompletionFormat(self.prompts, envelope, i, body.logprobs is not None,
                                 echo=echoes[i // n] if body.echo else "") for i in range(len(handles))]
        return await self._respond(request, handles, fmts, n, bool(body.stream), body.include_usage)

    # ------------------------------------------------------------------ POST /generate (the seed server's)

    async def generate(self, request: Request) -> Response:
        body = parse(GenerateRequest, await self._body(request))
        ids = await self.prompts.chat_ids([Message(role="user", content=body.prompt)])
        handles = self.submit([ids], body.max_new_tokens, "prompt", 1, sampling=SamplingParams(temperature=0.0),
                              request_id=f"gen-{request.state.completion_id}")
        try:
            (done,) = await self.service.collect(request, handles)
        except ClientGone:
            return Response(status_code=499)
        finish = done.finish
        return JSONResponse({"prompt": body.prompt, "response": done.text, "prompt_tokens": finish.prompt_tokens,
                             "gen_tokens": finish.completion_tokens, "finish_reason": finish.reason})

    # ------------------------------------------------------------------ tokenizer routes and models

    async def tokenize(self, request: Request) -> Response:
        body = parse(TokenizeRequest, await self._body(request))
        self.prompts.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of `prompt` or `messages`.", param="prompt", code="invalid_value")
        if body.messages is not None:
            ids = await self.prompts.chat_ids(body.messages, add_generation_prompt=body.add_generation_prompt is not False,
                                        add_special_tokens=bool(body.add_special_tokens))
        else:
            assert body.prompt is not None
            ids = await self.prompts.text_ids(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.prompts.model.max_total})

    async def detokenize(self, request: Request) -> Response:
        body = parse(DetokenizeRequest, await self._body(request))
        self.prompts.check_model(body.model)
        self.prompts.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": await self.prompts.decode(body.tokens)})

    def _model_card(self) -> dict[str, Any]:
        name = self.prompts.model.name
        return {"id": name, "object": "model", "created": self.prompts.created, "owned_by": "gemma4-optb",
                "root": name, "parent": None, "max_model_len": self.prompts.model.max_total}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self.prompts.check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

