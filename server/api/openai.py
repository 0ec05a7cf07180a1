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
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from server.api.prompts import GRAMMAR_RETRY_AFTER_S, GRAMMAR_WAIT_S, Prompts, grammar_spec, invalid
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
from server.api.service import ClientGone, Service, finish_error
from server.api.sse import DONE, GenerationStream, frame
from server.errors import APIError
from server.generation import (
    Delta,
    Finish,
    GenerationRequest,
    RequestHandle,
    SamplingParams,
    TokenConstraint,
    TokenLogprob,
)
from server.protocol import Delta as ParsedDelta
from server.protocol import OutputParser, PromptInputs, ToolCallDelta, collect
from server.protocol.base import PlainParser

log = logging.getLogger("server.api")

_LOGPROB_FLOOR = -9999.0  # vLLM's floor: JSON has no -inf


def _lp(value: float) -> float:
    return value if math.isfinite(value) and value > _LOGPROB_FLOOR else _LOGPROB_FLOOR


def _usage(finish: Finish) -> dict[str, int]:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


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


class _Format:
    """Builds one request's response objects (non-stream body, stream chunks) from engine events."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, prompts: Prompts, response_id: str, model: str, logprobs: bool, echo: str = "") -> None:
        self.prompts = prompts
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.echo = echo

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, finish: Finish) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": _usage(finish)}

    # Each format adds: opening() -> chunks before the first token; chunk(Delta) -> a chunk or None;
    # final_chunk(reason); body(text, deltas, finish) -> the non-stream response.


class ChatFormat(_Format):
    """Chat responses: the generated text goes through the protocol's parser, which splits it into content, the
    thought channel (`reasoning_content`) and tool calls (`tool_calls`, finish_reason "tool_calls")."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, prompts: Prompts, response_id: str, model: str, logprobs: bool,
                 parser: OutputParser | None = None) -> None:
        super().__init__(prompts, response_id, model, logprobs)
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
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope(self.chunk_object_name, [choice])

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

    def body(self, text: str, deltas: Sequence[Delta], finish: Finish) -> dict[str, Any]:
        parsed = collect(self.parser, text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
            message["content"] = parsed.content or None
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(deltas),
                  "finish_reason": _reason(finish.reason, parsed.called_tools)}
        return {**self._envelope(self.object_name, [choice]), "usage": _usage(finish)}


def _reason(engine_reason: str, called_tools: bool) -> str:
    """A stop after complete calls is "tool_calls"; a cut ("length") stays what it is."""
    return "tool_calls" if called_tools and engine_reason == "stop" else engine_reason


def _tool_call(call: ToolCallDelta, index: bool = False) -> dict[str, Any]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **entry} if index else entry


class CompletionFormat(_Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, prompts: Prompts, response_id: str, model: str, logprobs: bool, echo: str = "") -> None:
        super().__init__(prompts, response_id, model, logprobs, echo)
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
        return self._envelope(self.chunk_object_name,
                              [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}])

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(self.echo, None, None)] if self.echo else []

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        if delta.text or (self.logprobs and delta.logprob is not None):
            return self._chunk(delta.text, self._logprobs([delta]), None)
        return None

    def final_chunks(self, reason: str) -> list[dict[str, Any]]:
        return [self._chunk("", None, reason)]

    def body(self, text: str, deltas: Sequence[Delta], finish: Finish) -> dict[str, Any]:
        choice = {"index": 0, "text": self.echo + text, "logprobs": self._logprobs(deltas),
                  "finish_reason": finish.reason}
        return {**self._envelope(self.object_name, [choice]), "usage": _usage(finish)}


Format = ChatFormat | CompletionFormat

# ----------------------------------------------------------------------------------------------------------
# Routes


class OpenAIRoutes:
    def __init__(self, service: Service, prompts: Prompts) -> None:
        self.service = service
        self.prompts = prompts
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

    def _submit(self, ids: Sequence[int], limit: int | None, param: str, **fields: Any) -> RequestHandle:
        """The one place a GenerationRequest is built from a parsed body: the prompt, its budget, then `fields`."""
        budget = self.prompts.budget(len(ids), limit, param)
        return self.service.submit(GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=budget, **fields))

    async def _respond(self, request: Request, handle: RequestHandle, fmt: Format, stream: bool,
                       include_usage: bool) -> Response:
        if stream:
            return GenerationStream(self._stream(handle, fmt, include_usage),
                                    lambda: self.service.release(handle), ping_s=self.settings.sse_ping_s)
        try:
            done = await self.service.collect(request, handle)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        error = finish_error(done.finish)
        if error is not None:
            raise error
        return JSONResponse(fmt.body(done.text, done.deltas, done.finish))

    async def _stream(self, handle: RequestHandle, fmt: Format, include_usage: bool) -> AsyncIterator[bytes]:
        try:
            for payload in fmt.opening():
                yield frame(payload)
            async for event in self.service.events(handle):
                if isinstance(event, Delta):
                    chunk = fmt.chunk(event)
                    if chunk is not None:
                        yield frame(chunk)
                    continue
                error = finish_error(event)
                if error is not None:
                    raise error
                for payload in fmt.final_chunks(event.reason):
                    yield frame(payload)
                if include_usage:
                    yield frame(fmt.usage_chunk(event))
        except APIError as exc:  # after the headers: in-band
            self.service.metrics.errors.labels(str(exc.status)).inc()
            yield frame(exc.to_json())
        except Exception as exc:  # noqa: BLE001 - a bug must still end the stream properly
            self.service.metrics.errors.labels("500").inc()
            log.exception("stream %s failed", fmt.id)
            yield frame(APIError(500, f"Internal error: {type(exc).__name__}").to_json())
        yield frame(DONE)

    # ------------------------------------------------------------------ POST /v1/chat/completions

    async def chat_completions(self, request: Request) -> Response:
        body = parse(ChatCompletionRequest, await self._body(request))
        model = self.prompts.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs=true", param="top_logprobs", code="invalid_value")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = self._sampling(body, top_logprobs)
        ids, inputs = await self.prompts.chat_prompt(body)
        constraint = await self._constraint(body, inputs)
        self._check_constraint_fields(body, constraint)
        protocol = self.prompts.protocol
        tool_names = [tool.function["name"] for tool in body.tools or ()]
        parser = protocol.parser(tool_names=tool_names, parse_tool_calls=bool(tool_names) and body.tool_choice != "none")
        response_id = f"chatcmpl-{request.state.completion_id}"
        handle = self._submit(ids, body.token_limit, "messages", sampling=sampling, stop=body.stop,
                              request_id=response_id, constraint=constraint,
                              skip_special_tokens=not protocol.keep_special_tokens, **self._eos_fields(body))
        fmt = ChatFormat(self.prompts, response_id, model, top_logprobs is not None, parser)
        return await self._respond(request, handle, fmt, bool(body.stream), body.include_usage)

    async def _constraint(self, body: ChatCompletionRequest, inputs: PromptInputs) -> TokenConstraint | None:
        """The request's output constraint, compiled off the event loop (bounded by the compiler's limits), or None.
        Waits (bounded) for the grammar vocabulary while it is still being built after start-up."""
        spec = grammar_spec(body)
        if spec is None:
            return None
        from server.constraints import ConstraintError, build_constraint

        try:
            vocab = await anyio.to_thread.run_sync(self.prompts.grammar.wait, GRAMMAR_WAIT_S)
        except RuntimeError as exc:
            raise APIError(500, str(exc), code="grammar_unavailable") from None
        if vocab is None:
            raise APIError(503, "The grammar engine is still loading its vocabulary (once, after start-up); retry "
                           "shortly.", code="grammar_loading", headers={"Retry-After": str(GRAMMAR_RETRY_AFTER_S)})
        protocol = self.prompts.protocol

        def build() -> TokenConstraint | None:
            return build_constraint(vocab, **spec, thinking=inputs.thinking, native_tools=protocol.supports_tools)

        try:
            return await anyio.to_thread.run_sync(build)
        except ConstraintError as exc:
            raise invalid(exc.message, exc.param or "response_format") from None

    @staticmethod
    def _check_constraint_fields(body: SamplingFields, constraint: TokenConstraint | None) -> None:
        if constraint is None:
            return
        for name in ("ignore_eos", "min_tokens"):
            if getattr(body, name):
                raise APIError(400, f"{name}: cannot be combined with a constrained output (response_format or a "
                               "tool_choice that forces or forbids calls): the grammar decides where it may end",
                               param=name, code="invalid_value")

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
        sampling = self._sampling(body, body.logprobs)
        if isinstance(body.prompt, str):
            ids = await self.prompts.text_ids(body.prompt)  # with BOS, as vLLM does
            prompt_text = body.prompt
        else:
            ids = list(body.prompt)
            self.prompts.check_token_ids(ids, "prompt")
            prompt_text = await self.prompts.decode(ids) if body.echo else ""
        response_id = f"cmpl-{request.state.completion_id}"
        handle = self._submit(ids, body.token_limit, "prompt", sampling=sampling, stop=body.stop,
                              request_id=response_id, **self._eos_fields(body))
        fmt = CompletionFormat(self.prompts, response_id, model, body.logprobs is not None,
                               echo=prompt_text if body.echo else "")
        return await self._respond(request, handle, fmt, bool(body.stream), body.include_usage)

    # ------------------------------------------------------------------ POST /generate (the seed server's)

    async def generate(self, request: Request) -> Response:
        body = parse(GenerateRequest, await self._body(request))
        ids = await self.prompts.chat_ids([Message(role="user", content=body.prompt)])
        handle = self._submit(ids, body.max_new_tokens, "prompt", sampling=SamplingParams(temperature=0.0),
                              request_id=f"gen-{request.state.completion_id}")
        try:
            done = await self.service.collect(request, handle)
        except ClientGone:
            return Response(status_code=499)
        finish = done.finish
        error = finish_error(finish)
        if error is not None:
            raise error
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

