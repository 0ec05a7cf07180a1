"""Strict wire types and every field the official SDKs declare, on every route (issue 36).

- A number sent as a string, a bool as a string or a number, an integer as a decimal: a 400 in the protocol's error
  JSON naming the param, never coerced; an integer where a float is declared is a float (JSON has one number type).
  Sent through the official `openai` and `anthropic` SDKs (declared params as keyword arguments, others through
  `extra_body`), raw HTTP for the routes no SDK has (/generate, /tokenize, /detokenize).
- Enumerated fields against the values the installed SDKs' request params declare (`service_tier`, `cache_control`,
  `verbosity`, `prompt_cache_retention`, `modalities`, ...): outside them a 400, inside them accepted.
- Responses: the SDKs' own pydantic models walked field by field against the raw JSON (streamed and not), so a field
  the SDK declares and the server leaves out fails here, new SDK fields included. Anthropic's Message, its usage and
  message_delta's every field; OpenAI's required fields everywhere and every usage detail. Thinking tokens counted on
  the tiny Gemma-4 with a scripted thought; the rest on the null graph (instant).
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import (
    CacheCreation,
    Message,
    MessageDeltaUsage,
    OutputTokensDetails,
    RawMessageDeltaEvent,
    RawMessageStreamEvent,
    ServerToolUsage,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta as MessageDelta
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_usage import CompletionTokensDetails, PromptTokensDetails
from openai.types.responses import Response, ResponseStreamEvent, ResponseUsage, response_usage
from pydantic import BaseModel, TypeAdapter

from server.app.runtime import Host, graph_loader
from tests.support import gemma4_app
from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.support.gemma4_app import MODEL, gemma4_server
from tests.test_api_gemma4 import ScriptedGraph

NULL_MODEL = "gemma-test"
HI = [{"role": "user", "content": "Hi"}]
THOUGHT_PART = "<|channel>thought\nLet me see.<channel|>"
THOUGHT = f"{THOUGHT_PART}It is 4.<turn|>"

# The SDK models whose every field must be in our JSON (the others: their required fields).
EVERY_FIELD: frozenset[type[BaseModel]] = frozenset({
    Message, Usage, MessageDeltaUsage, CacheCreation, ServerToolUsage, OutputTokensDetails, RawMessageDeltaEvent,
    MessageDelta, CompletionUsage, CompletionTokensDetails, PromptTokensDetails, ResponseUsage,
    response_usage.InputTokensDetails, response_usage.OutputTokensDetails,
})


# ------------------------------------------------------------------ the SDK models, walked

def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, lists, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models(arg)
    return found


def _member(candidates: list[type[BaseModel]], data: dict[str, Any]) -> type[BaseModel] | None:
    """The union member `data` is: the only one, or the one whose `type` Literal is data's type."""
    if len(candidates) == 1:
        return candidates[0]
    for model in candidates:
        field = model.model_fields.get("type")
        if field is not None and data.get("type") in typing.get_args(field.annotation):
            return model
    return None


def missing_fields(model: type[BaseModel], data: Any, where: str = "") -> list[str]:
    """Where `data` (raw JSON) lacks a field the SDK's `model` declares: every field of EVERY_FIELD's models, the
    required ones of the others, recursively (a union's member picked by `type`)."""
    assert isinstance(data, dict), f"{where or model.__name__}: not an object: {data!r}"
    missing = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        path = f"{where}.{key}" if where else key
        if key not in data:
            if model in EVERY_FIELD or info.is_required():
                missing.append(f"{path} ({model.__name__})")
            continue
        candidates, value = _models(info.annotation), data[key]
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            member = _member(candidates, item) if isinstance(item, dict) else None
            if member is not None:
                missing += missing_fields(member, item, f"{path}[{index}]" if isinstance(value, list) else path)
    return missing


def event_model(union: Any, data: dict[str, Any]) -> type[BaseModel]:
    member = _member(_models(union), data)
    assert member is not None, f"no SDK event type {data.get('type')!r}"
    return member


def test_the_walk_finds_a_missing_field_deep_and_a_new_one() -> None:
    # The check this module rests on cannot pass by accident: a usage detail left out, or a field an SDK adds, fails.
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_creation": {"ephemeral_5m_input_tokens": 0}}
    missing = missing_fields(Message, {"usage": usage})
    assert "usage.cache_creation.ephemeral_1h_input_tokens (CacheCreation)" in missing
    assert "usage.server_tool_use (Usage)" in missing and "container (Message)" in missing
    block = {"type": "text"}  # a content block: its required fields only (text), found through the union by type
    assert "content[0].text (TextBlock)" in missing_fields(Message, {"content": [block]})
    assert CacheCreation in _models(Usage.model_fields["cache_creation"].annotation)
    assert ResponseUsage in _models(Response.model_fields["usage"].annotation)
    assert len(_models(RawMessageStreamEvent)) >= 6 and len(_models(ResponseStreamEvent)) >= 20


# ------------------------------------------------------------------ servers and clients

@pytest.fixture(scope="module")
def null_server() -> Iterator[LiveServer]:
    with live_server(settings()) as live:
        yield live


@pytest.fixture(scope="module")
def oai(null_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{null_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ant(null_server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=null_server.url, api_key="unused", max_retries=0, timeout=60)


host, script = gemma4_app.host, gemma4_app.script  # fixtures (pytest finds them by name)


@pytest.fixture(scope="module")
def graph(host: Host) -> ScriptedGraph:
    return ScriptedGraph(graph_loader(host)())


@pytest.fixture(scope="module")
def gemma4(host: Host, graph: ScriptedGraph) -> Iterator[LiveServer]:
    with gemma4_server(host, graph, prefix_reuse=False, wait_grammar=False) as live:
        yield live


def _send(method: Callable[..., Any], base: dict[str, Any], fields: dict[str, Any]) -> Any:
    """`method` (an SDK's create) with `fields`: the params it declares as keyword arguments (a user's typo of a type),
    the rest (and `stream`, which changes what the SDK returns) through `extra_body`."""
    declared = inspect.signature(method).parameters
    kwargs = {k: v for k, v in fields.items() if k in declared and k != "stream"}
    extra = {k: v for k, v in fields.items() if k not in kwargs}
    return method(**{**base, **kwargs}, **({"extra_body": extra} if extra else {}))


def openai_call(client: openai.OpenAI, route: str, fields: dict[str, Any]) -> Any:
    if route == "chat":
        return _send(client.chat.completions.create, {"model": NULL_MODEL, "messages": HI, "max_tokens": 2}, fields)
    if route == "completions":
        return _send(client.completions.create, {"model": NULL_MODEL, "prompt": "Hi", "max_tokens": 2}, fields)
    return _send(client.responses.create, {"model": NULL_MODEL, "input": "Hi", "max_output_tokens": 2}, fields)


def anthropic_call(client: anthropic.Anthropic, route: str, fields: dict[str, Any]) -> Any:
    if route == "messages":
        return _send(client.messages.create, {"model": NULL_MODEL, "messages": HI, "max_tokens": 2}, fields)
    return _send(client.messages.count_tokens, {"model": NULL_MODEL, "messages": HI}, fields)


# ------------------------------------------------------------------ strict types and enumerated values

TEXT_BLOCK = {"type": "text", "text": "Hi"}
OPENAI_REFUSED = [  # (route, fields, the param named)
    ("chat", {"max_tokens": "16"}, "max_tokens"),
    ("chat", {"max_tokens": 16.0}, "max_tokens"),  # OpenAI: "expected an integer, but got a decimal number"
    ("chat", {"max_completion_tokens": "8"}, "max_completion_tokens"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("chat", {"top_p": "1"}, "top_p"),
    ("chat", {"n": "1"}, "n"),
    ("chat", {"seed": "7"}, "seed"),
    ("chat", {"stream": "true"}, "stream"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"top_k": "1"}, "top_k"),
    ("chat", {"logit_bias": {"1": "5"}}, "logit_bias.1"),
    ("chat", {"parallel_tool_calls": "false"}, "parallel_tool_calls"),
    ("chat", {"service_tier": "gold"}, "service_tier"),
    ("chat", {"service_tier": "ultrafast"}, "service_tier"),  # the Responses API's tier only
    ("chat", {"verbosity": "loud"}, "verbosity"),
    ("chat", {"prompt_cache_retention": "1y"}, "prompt_cache_retention"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"store": "yes"}, "store"),
    ("chat", {"user": 5}, "user"),
    ("chat", {"metadata": {"k": 1}}, "metadata"),
    ("completions", {"max_tokens": "16"}, "max_tokens"),
    ("completions", {"echo": 0}, "echo"),
    ("completions", {"logprobs": "1"}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),  # a bool is not the legacy count
    ("completions", {"frequency_penalty": "0"}, "frequency_penalty"),
    ("responses", {"max_output_tokens": "16"}, "max_output_tokens"),
    ("responses", {"temperature": "1"}, "temperature"),
    ("responses", {"store": "false"}, "store"),
    ("responses", {"parallel_tool_calls": 1}, "parallel_tool_calls"),
    ("responses", {"seed": 1.5}, "seed"),
    ("responses", {"service_tier": "gold"}, "service_tier"),
    ("responses", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
]


@pytest.mark.parametrize(("route", "fields", "param"), OPENAI_REFUSED,
                         ids=[f"{r}-{next(iter(f))}={next(iter(f.values()))!r}" for r, f, _ in OPENAI_REFUSED])
def test_openai_routes_refuse_a_wrong_type_or_value_naming_the_param(oai: openai.OpenAI, route: str,
                                                                     fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_call(oai, route, fields)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param), error


OPENAI_TAKEN = [
    ("chat", {"temperature": 1, "top_p": 1, "presence_penalty": 0}),  # integers where floats are declared
    ("chat", {"service_tier": "flex", "verbosity": "low", "prompt_cache_retention": "24h", "modalities": ["text"],
              "store": False, "user": "u", "metadata": {"k": "v"}}),
    ("chat", {"service_tier": None, "stream": False}),
    ("completions", {"temperature": 0, "echo": False, "logprobs": 1}),
    ("responses", {"temperature": 1, "service_tier": "ultrafast", "prompt_cache_retention": "in_memory"}),
]


@pytest.mark.parametrize(("route", "fields"), OPENAI_TAKEN, ids=[f"{r}-{i}" for i, (r, _) in enumerate(OPENAI_TAKEN)])
def test_openai_routes_take_the_declared_types_and_values(oai: openai.OpenAI, route: str,
                                                          fields: dict[str, Any]) -> None:
    answer = openai_call(oai, route, fields)
    assert answer.usage is not None and answer.usage.total_tokens > 0


ANTHROPIC_REFUSED = [  # (route, fields, how the message starts: Anthropic's error JSON has no param)
    ("messages", {"max_tokens": "16"}, "max_tokens"),
    ("messages", {"max_tokens": 16.0}, "max_tokens"),
    ("messages", {"temperature": "0.5"}, "temperature"),
    ("messages", {"top_k": "1"}, "top_k"),
    ("messages", {"stream": "true"}, "stream"),
    ("messages", {"service_tier": "priority"}, "service_tier"),  # Messages' tiers: auto, standard_only
    ("messages", {"metadata": {"user_id": 5}}, "metadata.user_id"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": "200"}}, "thinking.budget_tokens"),
    ("messages", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    ("messages", {"cache_control": {"type": "persistent"}}, "cache_control.type"),
    ("messages", {"messages": [{"role": "user", "content": [{**TEXT_BLOCK, "cache_control": {
        "type": "ephemeral", "ttl": "10m"}}]}]}, "messages[0].content[0].text.cache_control.ttl"),
    ("count_tokens", {"system": [{**TEXT_BLOCK, "cache_control": {"type": "ephemeral", "ttl": 300}}]},
     "system[0].cache_control.ttl"),
    ("count_tokens", {"tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": {
        "type": "lasting"}}]}, "tools[0].cache_control.type"),
    ("count_tokens", {"tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": "true"}]},
     "tools[0].strict"),
    ("count_tokens", {"speed": "turbo"}, "speed"),
]


@pytest.mark.parametrize(("route", "fields", "param"), ANTHROPIC_REFUSED,
                         ids=[f"{r}-{p}" for r, _, p in ANTHROPIC_REFUSED])
def test_anthropic_routes_refuse_a_wrong_type_or_value_naming_the_param(ant: anthropic.Anthropic, route: str,
                                                                        fields: dict[str, Any], param: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_call(ant, route, fields)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].startswith(f"{param}:"), body


ANTHROPIC_TAKEN = [
    ("messages", {"temperature": 1, "top_p": 1, "service_tier": "standard_only", "metadata": {"user_id": "u"}}),
    ("messages", {"service_tier": "auto", "cache_control": {"type": "ephemeral", "ttl": "1h"}, "speed": "standard"}),
    ("count_tokens", {"messages": [{"role": "user", "content": [{**TEXT_BLOCK, "cache_control": {
        "type": "ephemeral", "ttl": "5m"}}]}], "cache_control": {"type": "ephemeral"}}),
]


@pytest.mark.parametrize(("route", "fields"), ANTHROPIC_TAKEN,
                         ids=[f"{r}-{i}" for i, (r, _) in enumerate(ANTHROPIC_TAKEN)])
def test_anthropic_routes_take_the_declared_types_and_values(ant: anthropic.Anthropic, route: str,
                                                             fields: dict[str, Any]) -> None:
    answer = anthropic_call(ant, route, fields)
    assert (answer.usage.output_tokens if route == "messages" else answer.input_tokens) > 0


RAW_REFUSED = [  # the routes no SDK sends: raw HTTP, OpenAI's error JSON
    ("/generate", {"prompt": "Hi", "max_new_tokens": "8"}, "max_new_tokens"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "true"}, "add_special_tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1.0]}, "tokens[0]"),
]


@pytest.mark.parametrize(("path", "body", "param"), RAW_REFUSED, ids=[f"{p}-{q}" for p, _, q in RAW_REFUSED])
def test_the_other_routes_refuse_a_wrong_type_naming_the_param(null_server: LiveServer, path: str,
                                                               body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{null_server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------ every declared field, streamed and not

def sse(server: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's data payloads, raw (before any SDK reads them)."""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def post(server: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def thought_tokens(host: Host) -> int:
    return len(host.tokenizer.encode(THOUGHT_PART, add_special_tokens=False))


def test_a_message_has_every_field_the_sdk_declares_with_its_thinking_tokens(gemma4: LiveServer, host: Host,
                                                                             script: Callable[[str], None]) -> None:
    script(THOUGHT)
    body = {"model": MODEL, "max_tokens": 60, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 200}}
    message = post(gemma4, "/v1/messages", body)
    assert missing_fields(Message, message) == []
    usage = message["usage"]
    assert usage["output_tokens_details"] == {"thinking_tokens": thought_tokens(host)}
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    assert usage["server_tool_use"] == {"web_search_requests": 0, "web_fetch_requests": 0}
    assert usage["service_tier"] == "standard" and message["container"] is None and message["stop_details"] is None
    assert Message.model_validate(message).usage.output_tokens_details.thinking_tokens == thought_tokens(host)  # type: ignore[union-attr]

    events = [e for e in sse(gemma4, "/v1/messages", body) if e["type"] != "ping"]  # a keep-alive: no SDK model
    for event in events:
        assert missing_fields(event_model(RawMessageStreamEvent, event), event) == [], event["type"]
    start = next(e for e in events if e["type"] == "message_start")
    assert start["message"]["usage"]["output_tokens_details"] == {"thinking_tokens": 0}  # nothing generated yet
    (last,) = [e for e in events if e["type"] == "message_delta"]
    assert last["usage"]["output_tokens_details"] == usage["output_tokens_details"]
    assert RawMessageDeltaEvent.model_validate(last).usage.output_tokens == usage["output_tokens"]


def test_an_answer_without_a_thought_counts_no_thinking_tokens(ant: anthropic.Anthropic) -> None:
    message = ant.messages.create(model=NULL_MODEL, max_tokens=3, messages=HI)  # type: ignore[arg-type]
    assert message.usage.output_tokens_details is not None and message.usage.output_tokens_details.thinking_tokens == 0
    assert message.usage.output_tokens == 3


def test_chat_has_every_required_field_and_its_usage_details(gemma4: LiveServer, host: Host,
                                                             script: Callable[[str], None]) -> None:
    script(THOUGHT)
    body = {"model": MODEL, "max_tokens": 60, "messages": HI, "reasoning_effort": "low"}
    whole = post(gemma4, "/v1/chat/completions", body)
    assert missing_fields(ChatCompletion, whole) == []
    details = whole["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == thought_tokens(host)
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # this server reuses no prefix

    chunks = sse(gemma4, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert missing_fields(ChatCompletionChunk, chunk) == []
    assert chunks[-1]["usage"] == whole["usage"]


def test_responses_have_every_required_field_streamed_and_not(gemma4: LiveServer, host: Host,
                                                              script: Callable[[str], None]) -> None:
    script(THOUGHT)
    body = {"model": MODEL, "max_output_tokens": 60, "input": "Hi", "reasoning": {"effort": "low"}, "store": False}
    whole = post(gemma4, "/v1/responses", body)
    assert missing_fields(Response, whole) == []
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == thought_tokens(host)
    events = sse(gemma4, "/v1/responses", body)
    for event in events:
        assert missing_fields(event_model(ResponseStreamEvent, event), event) == [], event["type"]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"] == whole["usage"]


def test_legacy_completions_have_every_required_field_and_the_usage_details(null_server: LiveServer) -> None:
    # The prompt twice: the second reuses the first's prefix, which usage's cached_tokens tells.
    body = {"model": NULL_MODEL, "prompt": "Once upon a time there was", "max_tokens": 3}
    post(null_server, "/v1/completions", body)
    whole = post(null_server, "/v1/completions", body)
    assert missing_fields(Completion, whole) == []
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    chunks = sse(null_server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        assert missing_fields(Completion, chunk) == []
    assert TypeAdapter(CompletionUsage).validate_python(chunks[-1]["usage"]).completion_tokens == 3
