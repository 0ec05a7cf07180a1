"""OpenAI's Responses API (`POST /v1/responses`; `GET`, `DELETE /v1/responses/{id}`, and its `/input_items`) on the
chat path.

A Responses request is translated into a `ChatCompletionRequest` (its conversation as chat messages, its tools,
tool_choice, text format and reasoning effort as the chat fields) and planned by `OpenAIRoutes.plan_chat`: the same
checks, the same prompt through the model's protocol and chat template, the same output constraints and the same
output parser as `/v1/chat/completions`. What is new here is only the shape: the conversation as items, the answer as
output items (`reasoning`, `message`, `function_call`), and the stream as OpenAI's typed events.

Deliberate choices (do not "fix" these without reading why):
- One builder (`OutputBuilder`) turns the parser's deltas into output items *and* the stream events that build them;
  a non-streamed response is the same builder fed the same engine deltas, so the two cannot differ.
- The thought channel is a `reasoning` item whose `content` holds the thought's text (`reasoning_text` parts, as
  OpenAI's open-weight models return it). There is no summarizer (a second generation at ~6 tok/s would double the
  wait), so when `reasoning.summary` is asked for, the item's `summary` is the thought itself, verbatim, as one
  `summary_text` part: clients that show only summaries (agents, IDE assistants) then show the thinking. Without
  that field `summary` is `[]`, as OpenAI's.
- A stored response keeps its whole conversation (see response_store.py); `previous_response_id` continues it.
  `instructions` are not carried over from the previous response, nor are `tools` (OpenAI's rules).
- Errors from the chat planning name the Responses fields (`text.format`, `reasoning.effort`, `input`,
  `max_output_tokens`), not the chat fields they were translated into.
- After the headers of a stream, a failure is `response.failed` (its `error` set), not an HTTP status.
- A response cut by `max_output_tokens` (or by the context) is `status: "incomplete"` with
  `incomplete_details.reason: "max_output_tokens"`, and its stream ends with `response.incomplete`.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.chat.routes import ChatPlan, OpenAIRoutes, read_body
from server.api.responses.store import ResponseStore
from server.api.schemas import ChatCompletionRequest, _Body, _Request, joined_text_parts, parse
from server.api.service import ClientGone
from server.api.sse import GenerationStream, frame
from server.engine.types import Delta, Finish, RequestHandle
from server.errors import APIError
from server.protocol import OutputParser, ParsedDelta, ToolCallDelta

log = logging.getLogger("server.api")

# ----------------------------------------------------------------------------------------------------------
# The request body

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
MAX_METADATA = 16  # OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512
REFUSED = {
    "conversation": "the Conversations API is not served; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "top_logprobs": "logprobs are not returned by /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "not supported: tool calls are the client's to run, one response at a time",
    "stream_options": "not supported",
}


def _texts(value: Any, allowed: tuple[str, ...]) -> str:
    """A string, or text parts joined as chat content parts are; any other part is refused."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be a string or a list of {' / '.join(allowed)} parts")
    return joined_text_parts(value, allowed)


class _Item(_Body):
    id: str | None = Field(default=None, max_length=256)  # kept as sent (e.g. this server's output items sent back)


class MessageItem(_Item):
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return _texts(value, ("input_text", "output_text"))


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object's text, parsed (and refused if it is not one) by the protocol


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str

    @field_validator("output", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return _texts(value, ("input_text",))


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _ours(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server issues no encrypted reasoning and cannot read another's; send the "
                             "reasoning item as this server returned it (its text in content)")
        return value

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ()) or "\n".join(part.text for part in self.summary)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs its 'schema' object")
        return self

    def chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.json_schema, "strict": self.strict,
                "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; it changes nothing here


class ReasoningConfig(_Body):
    effort: str | None = None  # checked by the protocol (REASONING_EFFORTS)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of `summary`

    @property
    def asked_summary(self) -> str | None:
        return self.summary or self.generate_summary


class ResponsesRequest(_Request):
    refused_hints = REFUSED

    model: str | None = None
    input: list[InputItem] = []
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    include: list[str] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of items")
        items = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                kind = item.get("type", "message" if "role" in item else None)
                if kind not in ITEM_TYPES:
                    raise ValueError(f"item {i} has type {kind!r}; supported: {', '.join(ITEM_TYPES)}")
                item = {**item, "type": kind}
            items.append(item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} has type {kind!r}: only function tools are supported (this server runs "
                                 "no hosted tools)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}, got type "
                             f"{value.get('type')!r}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > MAX_METADATA or any(len(k) > 64 or len(v) > 512
                                                                   for k, v in value.items())):
            raise ValueError(f"at most {MAX_METADATA} pairs, keys up to 64 characters, values up to 512")
        return value

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("'auto' is not supported: nothing is dropped from a conversation; one longer than the "
                             "context is a 400 (context_length_exceeded)")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(f"nothing can be included ({', '.join(value)[:200]}): reasoning text is always in the "
                             "reasoning item's content; there is no encrypted reasoning and no logprobs")
        return value


# ----------------------------------------------------------------------------------------------------------
# The translation into a chat request


def chat_messages(instructions: str | None, items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages: function calls join the assistant turn they follow, a reasoning item's
    text becomes the next assistant turn's `reasoning_content` (the template decides whether to render it), function
    call outputs become tool messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    thought = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            thought += item.text
            continue
        last = messages[-1] if messages else None
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None and last["role"] == "assistant":  # the same assistant turn
                last.setdefault("tool_calls", []).append(call)
                if thought:
                    last["reasoning_content"] = last.get("reasoning_content", "") + thought
                    thought = ""
                continue
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
        else:
            message = {"role": item.role, "content": item.content}
        if message["role"] == "assistant" and thought:
            message["reasoning_content"] = thought
        thought = ""  # a thought no assistant turn follows has nothing to go with
        messages.append(message)
    return messages


def chat_request(body: ResponsesRequest, items: Sequence[InputItem]) -> ChatCompletionRequest:
    choice = body.tool_choice
    fields = {
        "model": body.model,
        "messages": chat_messages(body.instructions, items),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [tool.chat() for tool in body.tools] if body.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice)
        else choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": body.text.format.chat() if body.text and body.text.format else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    raw = json.dumps({key: value for key, value in fields.items() if value is not None}).encode()
    try:
        return parse(ChatCompletionRequest, raw)
    except APIError as exc:
        raise in_responses_terms(exc) from None


_RENAMED = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"), ("max_completion_tokens", "max_output_tokens"),
            ("chat_template_kwargs", "reasoning"))
_TOOL_FUNCTION = re.compile(r"^(tools\[\d+\])\.function\b")


def _renamed(param: str) -> str:
    if param == "messages" or param.startswith(("messages.", "messages[")):
        return "input"  # message indices are not item indices (instructions, merged calls)
    for old, new in _RENAMED:
        if param == old or param.startswith((old + ".", old + "[")):
            return new + param[len(old):]
    return _TOOL_FUNCTION.sub(r"\1", param)


def in_responses_terms(exc: APIError) -> APIError:
    """A chat-path error naming the Responses field it came from."""
    if not exc.param:
        return exc
    param = _renamed(exc.param)
    message = param + exc.message[len(exc.param):] if exc.message.startswith(exc.param) else exc.message
    return APIError(exc.status, message, param=param, code=exc.code, type=exc.type, headers=exc.headers)


# ----------------------------------------------------------------------------------------------------------
# Output items and stream events


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it (OpenAI's item shapes): with an id (the one it
    was sent with, else a new one), text content as parts, `status: "completed"`."""
    listed = {"id": item.get("id") or _new_id(_ID_PREFIXES[item["type"]]), **item, "status": "completed"}
    if item["type"] == "message":
        if item["role"] == "assistant":
            listed["content"] = [{"type": "output_text", "text": item["content"], "annotations": []}]
        else:
            listed["content"] = [{"type": "input_text", "text": item["content"]}]
    return listed


class OutputBuilder:
    """The generated text, through the plan's parser, as output items, and the stream events that build them in order
    (each event a dict with its `type`; the stream adds `sequence_number`).

    Items: a `reasoning` item for the thought channel, a `message` item for visible text, a `function_call` item per
    complete call; a new item starts whenever the kind of text changes. Events carry copies: an item keeps growing
    after its `output_item.added` was sent."""

    def __init__(self, parser: OutputParser, *, summary: bool = False) -> None:
        self.parser = parser
        self._summary = summary  # the thought is also each reasoning item's summary (reasoning.summary was asked)
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item text is added to
        self._tokens = 0  # generated tokens fed so far
        self._tokens_before = 0  # ... before the current feed
        self._answered = False  # visible text or a call was seen
        self.reasoning_tokens = 0  # tokens before the answer began, when there was a thought

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        self._tokens_before = self._tokens
        self._tokens += delta.token_id is not None
        return self._add(self.parser.feed(delta.text)) if delta.text else []

    def finish(self, reason: str) -> list[dict[str, Any]]:
        self._tokens_before = self._tokens
        events = self._add(self.parser.finish().delta)
        if not self._answered and any(item["type"] == "reasoning" for item in self.items):
            self.reasoning_tokens = self._tokens  # all thought (a cut, or an empty answer)
        if not self.items:  # nothing at all: still one (empty) message, so output_text is ""
            events += self._start("message")
        return events + self._close("incomplete" if reason == "length" else "completed")

    def _add(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events = self._text("reasoning", parsed.reasoning) if parsed.reasoning else []
        if parsed.content or parsed.tool_calls:
            if not self._answered and any(item["type"] == "reasoning" for item in self.items):
                self.reasoning_tokens = self._tokens_before
            self._answered = True
        if parsed.content:
            events += self._text("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items) - 1}

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": copy.deepcopy(item)}
        item["content"].append(part)
        events = [added, {"type": "response.content_part.added", **self._where(item), "content_index": 0,
                          "part": copy.deepcopy(part)}]
        if kind == "reasoning" and self._summary:
            item["summary"].append({"type": "summary_text", "text": ""})
            events.append({"type": "response.reasoning_summary_part.added", **self._where(item), "summary_index": 0,
                           "part": {"type": "summary_text", "text": ""}})
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close("completed") + self._start(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        if kind == "message":
            events.append({"type": "response.output_text.delta", **self._where(item), "content_index": 0,
                           "delta": text, "logprobs": []})
        else:
            events.append({"type": "response.reasoning_text.delta", **self._where(item), "content_index": 0,
                           "delta": text})
            if item["summary"]:
                item["summary"][0]["text"] += text
                events.append({"type": "response.reasoning_summary_text.delta", **self._where(item),
                               "summary_index": 0, "delta": text})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        where = {**self._where(item), "content_index": 0}
        if item["type"] == "message":
            events = [{"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []}]
        else:
            events = [{"type": "response.reasoning_text.done", **where, "text": part["text"]}]
        events.append({"type": "response.content_part.done", **where, "part": copy.deepcopy(part)})
        for summary in item.get("summary", ()):  # one part at most: the thought itself
            at = {**self._where(item), "summary_index": 0}
            events += [{"type": "response.reasoning_summary_text.done", **at, "text": summary["text"]},
                       {"type": "response.reasoning_summary_part.done", **at, "part": copy.deepcopy(summary)}]
        item["status"] = status
        return [*events,
                {"type": "response.output_item.done", "output_index": where["output_index"],
                 "item": copy.deepcopy(item)}]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = self._close("completed")
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        # The parser emits a call once, complete: its arguments are one delta.
        events.append({"type": "response.function_call_arguments.delta", **self._where(item), "delta": call.arguments})
        item.update(arguments=call.arguments, status="completed")
        events.append({"type": "response.function_call_arguments.done", **self._where(item), "name": call.name,
                       "arguments": call.arguments})
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        return events


def response_shell(response_id: str, body: ResponsesRequest, plan: ChatPlan) -> dict[str, Any]:
    """The response object before any output: its id and the request's settings echoed, as OpenAI's."""
    choice = body.tool_choice
    text_format = body.text.format if body.text and body.text.format else TextFormat(type="text")
    reasoning = body.reasoning or ReasoningConfig()
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "max_tool_calls": None, "model": plan.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.asked_summary},
        "store": body.store is not False, "temperature": plan.sampling.temperature,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True),
                 **({"verbosity": body.text.verbosity} if body.text and body.text.verbosity else {})},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "top_p": plan.sampling.top_p, "truncation": "disabled", "usage": None, "user": body.user,
        "metadata": body.metadata or {},
    }


def finished(shell: dict[str, Any], builder: OutputBuilder, finish: Finish) -> dict[str, Any]:
    cut = finish.reason == "length"
    return {
        **shell, "status": "incomplete" if cut else "completed", "completed_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": copy.deepcopy(builder.items),
        "usage": {
            "input_tokens": finish.prompt_tokens,
            # cached: the prompt prefix reused from the device's KV cache; written: the rest, prefilled now
            "input_tokens_details": {"cached_tokens": finish.reused_tokens,
                                     "cache_write_tokens": finish.prompt_tokens - finish.reused_tokens},
            "output_tokens": finish.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": builder.reasoning_tokens},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        },
    }


# ----------------------------------------------------------------------------------------------------------
# Routes


def _not_found(response_id: str, param: str | None = None) -> APIError:
    shown = response_id if len(response_id) <= 100 else response_id[:100] + "..."
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id '{shown}' not found (never stored, deleted, evicted from this server's "
                    "bounded store, or stored before a restart).", param=param,
                    code="previous_response_not_found" if param else "response_not_found",
                    type="invalid_request_error")


class ResponsesRoutes:
    def __init__(self, chat: OpenAIRoutes, store: ResponseStore) -> None:
        self.chat = chat
        self.service = chat.service
        self.settings = chat.settings
        self.store = store

    # ------------------------------------------------------------------ POST /v1/responses

    async def create(self, request: Request) -> Response:
        body = parse(ResponsesRequest, await read_body(request, self.settings.max_body_bytes,
                                                       self.settings.body_timeout_s))
        history: tuple[dict[str, Any], ...] = ()
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = previous.conversation
        given = [item.model_dump(by_alias=True, exclude_none=True) for item in body.input]
        conversation = [*history, *given]
        if not conversation:
            raise APIError(400, "input: required (a string or a list of items)", param="input", code="invalid_value")
        chat_body = chat_request(body, _ITEMS.validate_python(conversation))
        try:
            plan = await self.chat.plan_chat(chat_body)
        except APIError as exc:
            raise in_responses_terms(exc) from None
        response_id = f"resp_{request.state.completion_id}"
        try:
            (handle,) = self.chat.submit([plan.ids], chat_body.token_limit, "input", 1, sampling=plan.sampling,
                                         constraint=plan.constraint, request_id=response_id,
                                         skip_special_tokens=not plan.keep_special_tokens)
        except APIError as exc:
            raise in_responses_terms(exc) from None
        shell = response_shell(response_id, body, plan)
        builder = OutputBuilder(plan.new_parser(), summary=(body.reasoning or ReasoningConfig()).asked_summary is not None)

        def keep(response: dict[str, Any]) -> None:
            inputs = [listed_item(item) for item in given]  # ids for the items sent without one: only when stored
            stored = self.store.put(response, [*conversation, *response["output"]], inputs)
            if not stored:
                log.warning("%s: not stored (larger than --responses-store-bytes, or storing is off)", response_id)

        store = keep if body.store is not False else None
        if body.stream:
            return GenerationStream(self._stream(handle, builder, shell, store),
                                    lambda: self.service.release(handle), ping_s=self.settings.sse_ping_s)
        try:
            (done,) = await self.service.collect(request, [handle])
        except ClientGone:
            return Response(status_code=499)
        for delta in done.deltas:
            builder.feed(delta)
        builder.finish(done.finish.reason)
        response = finished(shell, builder, done.finish)
        if store:
            store(response)
        return JSONResponse(response)

    async def _stream(self, handle: RequestHandle, builder: OutputBuilder, shell: dict[str, Any],
                      store: Callable[[dict[str, Any]], None] | None) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(payload: dict[str, Any]) -> bytes:
            return frame({**payload, "sequence_number": next(numbers)}, event=payload["type"])

        yield event({"type": "response.created", "response": shell})
        yield event({"type": "response.in_progress", "response": shell})
        try:
            async for engine_event in self.service.events(handle):
                if isinstance(engine_event, Delta):
                    for payload in builder.feed(engine_event):
                        yield event(payload)
                    continue
                for payload in builder.finish(engine_event.reason):
                    yield event(payload)
                response = finished(shell, builder, engine_event)
                if store:
                    store(response)
                yield event({"type": f"response.{response['status']}", "response": response})
        except Exception as exc:  # noqa: BLE001 - after the headers: in-band; a bug must still end the stream properly
            yield event(self._failed(shell, builder, self.service.stream_failure(exc, shell["id"]).message))

    @staticmethod
    def _failed(shell: dict[str, Any], builder: OutputBuilder, message: str) -> dict[str, Any]:
        response = {**shell, "status": "failed", "output": copy.deepcopy(builder.items),
                    "error": {"code": "server_error", "message": message}}
        return {"type": "response.failed", "response": response}

    # ------------------------------------------------------------------ GET, DELETE /v1/responses/{id}, input_items

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(400, "stream: replaying a stored response as a stream is not supported", param="stream",
                           code="invalid_value")
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response)

    async def input_items(self, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items`: the input items of that request (not of earlier turns), a cursor page
        as OpenAI's: `limit` 1-100 (20), `order` `desc` (newest first, the default) or `asc`, `after` an item id."""
        response_id = request.path_params["response_id"]
        query = request.query_params
        unknown = sorted(set(query) - {"limit", "order", "after", "include", "include[]"})
        if unknown:
            raise APIError(400, f"{unknown[0]}: unknown query parameter (supported: limit, order, after)",
                           param=unknown[0], code="invalid_value")
        if query.getlist("include") or query.getlist("include[]"):
            raise APIError(400, "include: nothing can be included (text items only)", param="include",
                           code="invalid_value")
        limit_text = query.get("limit", "20")
        if not (limit_text.isascii() and limit_text.isdigit() and 1 <= int(limit_text) <= 100):
            raise APIError(400, "limit: must be an integer from 1 to 100", param="limit", code="invalid_value")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order: must be 'asc' or 'desc'", param="order", code="invalid_value")
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        items = list(stored.inputs if order == "asc" else reversed(stored.inputs))
        start = 0
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                raise APIError(400, f"after: no input item of {response_id} has that id", param="after",
                               code="invalid_value")
            start = ids.index(query["after"]) + 1
        page = items[start:start + int(limit_text)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": start + len(page) < len(items)})

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
