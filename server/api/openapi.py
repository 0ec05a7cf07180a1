"""`GET /openapi.json`: an OpenAPI 3.1 description of every route the app serves, generated, not written by hand.

- Request bodies are the JSON Schemas of the pydantic models the routes validate with (`mode="validation"`), so the
  description cannot drift from what is accepted. Answers are described by the models below (`extra` allowed: they
  pin what clients rely on, not every key), errors by OpenAI's error JSON (Anthropic's on the Messages API's routes).
- The paths come from the app's own route table (`describe(routes, ...)`): a route without an `Operation` in
  `OPERATIONS` fails `create_app` at once, so a new route cannot be served undescribed.
- A streaming route's 200 is `application/json` or, with `"stream": true`, `text/event-stream`.
- schemathesis fuzzes the running server against this description in CI (tests/test_openapi_fuzz.py): every answer
  must be one it lists, in the content type it lists, matching its schema.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema
from starlette.routing import BaseRoute, Route

from server.api.messages.schemas import CountTokensRequest, MessagesRequest
from server.api.responses.schemas import ResponsesRequest
from server.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)

# ------------------------------------------------------------------ the answers, as clients read them


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Answer):
    """OpenAI's error JSON: every 4xx and 5xx of every route."""

    error: ErrorDetail


class AnthropicErrorDetail(_Answer):
    type: str
    message: str


class AnthropicErrorBody(_Answer):
    """Anthropic's error JSON: every 4xx and 5xx of the Messages API's routes."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCallOut(_Answer):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(_Answer):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(_Answer):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Answer):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length"]


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseObject(_Answer):
    """The Responses API's `response` object (its output items as OpenAI's; see server/api/responses/builder.py)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class MessageObject(_Answer):
    """The Messages API's `message` (its content blocks as Anthropic's; see server/api/messages/builder.py)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, Any]


class TokenCount(_Answer):
    input_tokens: int


class InputItemList(_Answer):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(_Answer):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class Generated(_Answer):
    prompt: str
    response: str
    prompt_tokens: int
    gen_tokens: int
    finish_reason: Literal["stop", "length"]


class Tokens(_Answer):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(_Answer):
    prompt: str


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int  # the build's context, prompt + completion (vLLM's key)
    context_length: int  # the same number under OpenRouter's / llama.cpp's key


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Answer):
    status: Literal["loading", "ok", "error", "draining"]
    reason: str | None = None


# ------------------------------------------------------------------ the operations


@dataclass(frozen=True)
class Query:
    name: str
    schema: Mapping[str, Any]
    description: str


@dataclass(frozen=True)
class Operation:
    """One route and method: its request body, its 200's model (or media type), the errors it answers."""

    summary: str
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None
    media_type: str = "application/json"  # of the 200 when `answer` is None: text/plain, text/html, ...
    stream: bool = False  # the 200 may also be text/event-stream (`"stream": true`)
    errors: tuple[int, ...] = ()
    protected: bool = True  # behind the API key, when one is set
    query: tuple[Query, ...] = ()
    answer_schema: Mapping[str, Any] | None = None  # the 200's schema when it is no model (this document itself)
    # OpenAPI links from the 200: (operation, method) the answer's `id` is the path parameter of (a client, or a
    # fuzzer's stateful phase, follows a created response to its GET, input_items and DELETE).
    links: tuple[tuple[str, str], ...] = ()
    # Request bodies to show (and for a fuzzer's examples phase to send first): name -> body.
    examples: Mapping[str, Mapping[str, Any]] | None = None
    error_body: type[BaseModel] = ErrorBody  # the shape of its errors (one per wire protocol)


# A JSON route's errors: bad body (400), key (401), model or id not found (404), body too slow (408), too large (413),
# not JSON (415).
_BODY_ERRORS = (400, 401, 404, 408, 413, 415)
# A generation's: its body's, and a full queue (429, Retry-After), a server loading or draining (503).
_GENERATION_ERRORS = (*_BODY_ERRORS, 429, 503)
_HI = [{"role": "user", "content": "Hi"}]
# One SSE event as clients (and schemathesis) parse it: `event:` (the Responses API names each), `data:` (a JSON
# object; chat and completions end with `data: [DONE]`). Keep-alive comments are no events.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string", "description": "A JSON object, or [DONE] at the end"}}}

OPERATIONS: Mapping[tuple[str, str], Operation] = {
    ("/v1/chat/completions", "POST"): Operation(
        "Chat completion", ChatCompletionRequest, ChatCompletion, stream=True, errors=_GENERATION_ERRORS, examples={
            "answer": {"messages": _HI, "max_tokens": 8},
            "stream": {"messages": _HI, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
            "json": {"messages": _HI, "max_tokens": 8, "response_format": {"type": "json_object"}}}),
    ("/v1/completions", "POST"): Operation(
        "Legacy completion", CompletionRequest, Completion, stream=True, errors=_GENERATION_ERRORS, examples={
            "answer": {"prompt": "Hi", "max_tokens": 8}, "stream": {"prompt": "Hi", "max_tokens": 8, "stream": True},
            # lm-evaluation-harness's loglikelihood request: the prompt's token logprobs (echo + logprobs)
            "prompt logprobs": {"prompt": [[2, 651, 1000, 2000]], "max_tokens": 1, "logprobs": 1, "echo": True,
                                "temperature": 0, "seed": 1234}}),
    ("/v1/responses", "POST"): Operation(
        "Create a response (OpenAI's Responses API)", ResponsesRequest, ResponseObject, stream=True,
        errors=_GENERATION_ERRORS, examples={
            "answer": {"input": "Hi", "max_output_tokens": 8},
            "stream": {"input": "Hi", "max_output_tokens": 8, "stream": True}},
        links=(("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}/input_items", "GET"),
               ("/v1/responses/{response_id}", "DELETE"))),
    ("/v1/responses/{response_id}", "GET"): Operation("A stored response", answer=ResponseObject, errors=(400, 401, 404)),
    ("/v1/responses/{response_id}/input_items", "GET"): Operation(
        "A stored response's input items", answer=InputItemList, errors=(400, 401, 404), query=(
            Query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Items per page."),
            Query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}, "Oldest or newest first."),
            Query("after", {"type": "string"}, "The id of the item the page starts after."))),
    ("/v1/responses/{response_id}", "DELETE"): Operation("Delete a stored response", answer=DeletedResponse,
                                                         errors=(401, 404)),
    ("/v1/messages", "POST"): Operation(
        "Create a message (Anthropic's Messages API)", MessagesRequest, MessageObject, stream=True,
        errors=_GENERATION_ERRORS, error_body=AnthropicErrorBody, examples={
            "answer": {"messages": _HI, "max_tokens": 8},
            "stream": {"messages": _HI, "max_tokens": 8, "stream": True}}),
    ("/v1/messages/count_tokens", "POST"): Operation(
        "Count a message's prompt tokens (Anthropic's Messages API)", CountTokensRequest, TokenCount,
        errors=_BODY_ERRORS, error_body=AnthropicErrorBody, examples={"count": {"messages": _HI}}),
    ("/generate", "POST"): Operation("The seed server's greedy chat generation", GenerateRequest, Generated,
                                     errors=_GENERATION_ERRORS, examples={"answer": {"prompt": "Hi", "max_new_tokens": 8}}),
    ("/v1/models", "GET"): Operation("The served model", answer=ModelList, errors=(401,)),
    ("/v1/models/{model}", "GET"): Operation("One model by its id or an alias (--served-model-name)", answer=ModelCard,
                                             errors=(401, 404)),
    ("/tokenize", "POST"): Operation("Tokenize a prompt, or chat messages (with tools) as chat renders them", TokenizeRequest,
                                     Tokens, errors=_BODY_ERRORS,
                                     examples={"prompt": {"prompt": "Hi"}, "messages": {"messages": _HI}}),
    ("/detokenize", "POST"): Operation("Token ids back to text", DetokenizeRequest, Detokenized, errors=_BODY_ERRORS,
                                       examples={"tokens": {"tokens": [2, 9259]}}),
    ("/health", "GET"): Operation("Readiness (503 unless ok)", answer=Health, protected=False),
    ("/metrics", "GET"): Operation("Prometheus metrics", media_type="text/plain", protected=False),
    ("/openapi.json", "GET"): Operation("This description", protected=False, answer_schema={"type": "object"}),
    ("/", "GET"): Operation("The chat page", media_type="text/html", protected=False),
}

_PATH_PARAM = re.compile(r"\{([^}:]+)(?::[^}]+)?\}")  # Starlette's `{name}` / `{name:convertor}`
_REF = "#/components/schemas/{model}"


def _json(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": dict(schema)}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _error(status: int, body: type[BaseModel]) -> dict[str, Any]:
    shape = "Anthropic's" if body is AnthropicErrorBody else "OpenAI's"
    answer: dict[str, Any] = {"description": f"{shape} error JSON ({status})", "content": _json(_ref(body))}
    if status in (429, 503):
        answer["headers"] = {"Retry-After": {"description": "Seconds to wait before retrying (when given).",
                                             "schema": {"type": "string"}}}
    return answer


def _operation(path: str, method: str, op: Operation, keyed: bool) -> dict[str, Any]:
    if op.answer is not None:
        content = _json(_ref(op.answer))
    elif op.answer_schema is not None:
        content = _json(op.answer_schema)
    else:
        content = {op.media_type: {"schema": {"type": "string"}}}
    if op.stream:  # with "stream": true; the schema is one event's
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    responses: dict[str, Any] = {"200": {"description": op.summary, "content": content}}
    if op.links:
        responses["200"]["links"] = {
            _operation_id(target, verb): {"operationId": _operation_id(target, verb),
                                          "parameters": {name: "$response.body#/id" for name in _PATH_PARAM.findall(target)}}
            for target, verb in op.links}
    if path == "/health":
        responses["503"] = {"description": "Not ready: loading, draining or failed", "content": _json(_ref(Health))}
    for status in op.errors:
        if status != 401 or keyed:
            responses[str(status)] = _error(status, op.error_body)
    described: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(path, method),
                                 "responses": responses}
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
                  for name in _PATH_PARAM.findall(path)]
    parameters += [{"name": q.name, "in": "query", "required": False, "schema": dict(q.schema),
                    "description": q.description} for q in op.query]
    if parameters:
        described["parameters"] = parameters
    if op.body is not None:
        body = _json(_ref(op.body))
        if op.examples:
            body["application/json"]["examples"] = {name: {"value": dict(value)} for name, value in op.examples.items()}
        described["requestBody"] = {"required": True, "content": body}
    if op.protected and keyed:
        described["security"] = [{"bearer": []}, {"apiKey": []}]
    return described


def _operation_id(path: str, method: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", _PATH_PARAM.sub(r"by_\1", path)).strip("_") or "page"
    return f"{method.lower()}_{words}"


def openapi_path(route_path: str) -> str:
    """Starlette's `/v1/models/{model:path}` as OpenAPI's `/v1/models/{model}`."""
    return _PATH_PARAM.sub(r"{\1}", route_path)


def route_methods(routes: Iterable[BaseRoute]) -> list[tuple[str, str]]:
    """(OpenAPI path, method) of every route the app serves (HEAD, which Starlette adds to each GET, left out)."""
    served = []
    for route in routes:
        assert isinstance(route, Route), f"{route!r}: only plain routes are described"
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                served.append((openapi_path(route.path), method))
    return served


def describe(routes: Iterable[BaseRoute], *, title: str, version: str, keyed: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes`; ValueError for a route that has no `Operation` here. `keyed`: an API key
    is set (the protected operations answer 401 and declare the schemes)."""
    served = route_methods(routes)
    missing = [f"{method} {path}" for path, method in served if (path, method) not in OPERATIONS]
    if missing:
        raise ValueError(f"routes with no description in server/api/openapi.py OPERATIONS: {', '.join(missing)}")
    models: list[type[BaseModel]] = [ErrorBody, Health]
    for key in served:
        op = OPERATIONS[key]
        models += [model for model in (op.body, op.answer, op.error_body) if model is not None]
    _, schemas = models_json_schema([(model, "validation") for model in dict.fromkeys(models)], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for path, method in served:
        paths.setdefault(path, {})[method.lower()] = _operation(path, method, OPERATIONS[(path, method)], keyed)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible inference server. Every JSON route takes `Content-Type: "
                                "application/json` only (415 otherwise)."},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
    if keyed:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}}
    return document
