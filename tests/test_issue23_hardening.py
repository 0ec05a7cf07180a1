"""Issue 23's hostile-input battery, one regression test per case: each was a 500, a silent non-answer or a cross-site
drain; each is now a 4xx with OpenAI's error JSON, answered fast, and the server keeps serving.

Served on the tiny random Gemma-4 (tests/test_api_gemma4.py's host: the Gemma-4 protocol renders tool calls and tool
results, which the plain demo refuses before it parses them) with the grammar vocabulary built.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from server.api.http import parse
from server.api.openapi import OPERATIONS, describe
from server.app.runtime import Host, build_engine
from server.constraints.constraint import ConstraintError
from server.json_text import JSONTextError, JSONTooDeep, read_json
from server.protocol.base import RESERVED_TEMPLATE_VARIABLES, is_tool_name
from server.protocol.gemma4 import parse_call
from tests.support import gemma4_app
from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.support.gemma4_app import MODEL
from tests.test_api_gemma4 import WEATHER

HI = {"role": "user", "content": "Hi"}
DEEP = "[" * 50_000  # unterminated, as the battery sent it: the parser must give up on depth, not on length
DEEP_OBJECT = '{"a": ' + DEEP
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
FAST_S = 2.0  # every refusal below is answered within this (each was a 500 in milliseconds, or a full generation)


host = gemma4_app.host  # a shared fixture (pytest finds it by name)


@pytest.fixture(scope="module")
def server(host: Host) -> Iterator[LiveServer]:
    config = settings(served_model_name=MODEL)
    with live_server(config, build_engine(host, config), host) as live, \
            httpx.Client(base_url=live.url, timeout=60) as client:
        live.app.state.grammar.wait(600)  # the grammar vocabulary (the unsatisfiable-schema cases compile against it)
        live.client = client  # type: ignore[attr-defined]
        yield live


def post(server: LiveServer, path: str, body: Any, content_type: str | None = "application/json") -> httpx.Response:
    headers = {} if content_type is None else {"Content-Type": content_type}
    return server.client.post(path, content=json.dumps(body).encode(), headers=headers)  # type: ignore[attr-defined]


def refused(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    """OpenAI's error JSON with `status`, naming `param`, answered fast."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    assert param is None or error["message"].startswith(param), error
    assert r.elapsed.total_seconds() < FAST_S, r.elapsed
    return error


def assert_serving(server: LiveServer) -> None:
    r = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text[:300]


def called(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": arguments}}]}


# ------------------------------------------------------------------ JSON inside fields: bounded as the body is


def test_deeply_nested_tool_call_arguments_in_chat_are_a_400(server: LiveServer) -> None:
    r = post(server, "/v1/chat/completions", {"messages": [HI, called(DEEP)], "max_tokens": 2})
    refused(r, 400, "messages[1].tool_calls[0].function.arguments")
    assert_serving(server)


def test_a_deeply_nested_tool_message_in_chat_is_a_400(server: LiveServer) -> None:
    tool = {"role": "tool", "tool_call_id": "call_1", "content": DEEP_OBJECT}
    r = post(server, "/v1/chat/completions", {"messages": [HI, called("{}"), tool], "max_tokens": 2})
    refused(r, 400, "messages[2].content")
    assert_serving(server)


def test_deeply_nested_function_call_arguments_in_responses_are_a_400(server: LiveServer) -> None:
    items = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": DEEP}]
    refused(post(server, "/v1/responses", {"input": items, "max_output_tokens": 2}), 400, "input")
    assert_serving(server)


def test_a_deeply_nested_function_call_output_in_responses_is_a_400(server: LiveServer) -> None:
    items = [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": DEEP_OBJECT}]
    refused(post(server, "/v1/responses", {"input": items, "max_output_tokens": 2}), 400, "input")
    assert_serving(server)


def test_json_nested_within_the_body_limit_but_too_deep_for_the_template_is_a_400(server: LiveServer) -> None:
    """199 levels pass the reader (the body's own limit) but overflow the template's recursive macro: a 400 too."""
    nested = '{"a": ' + "[" * 199 + "]" * 199 + "}"
    r = post(server, "/v1/chat/completions", {"messages": [HI, called(nested)], "max_tokens": 2})
    refused(r, 400, "messages")
    assert_serving(server)


def test_the_reader_has_the_bodys_limits() -> None:
    assert read_json('{"a": [1, 2.5, "x", null]}', "f") == {"a": [1, 2.5, "x", None]}
    with pytest.raises(JSONTooDeep):
        read_json(DEEP, "f")
    for bad in ("{not json", '{"a": 1e999}', "NaN", '"\\ud800"'):
        with pytest.raises(JSONTextError) as caught:
            read_json(bad, "f.arguments")
        assert caught.value.param == "f.arguments" and caught.value.message.startswith("f.arguments: ")


def test_the_gemma4_argument_parser_gives_up_on_depth_not_with_a_recursion_error() -> None:
    assert parse_call("call:f{a:" + "[" * 5_000 + "]" * 5_000 + "}") is None  # text, never a RecursionError
    assert parse_call("call:f{a:[[1]]}") == ("f", {"a": [[1]]})


# ------------------------------------------------------------------ template variables the server owns


@pytest.mark.parametrize("name", ["tools", "add_generation_prompt", "conversation", "messages", "chat_template"])
def test_chat_template_kwargs_may_not_set_the_servers_own_variables(server: LiveServer, name: str) -> None:
    assert name in RESERVED_TEMPLATE_VARIABLES
    r = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2, "chat_template_kwargs": {name: []}})
    refused(r, 400, f"chat_template_kwargs.{name}")
    assert_serving(server)


def test_other_chat_template_kwargs_still_reach_the_template(server: LiveServer) -> None:
    r = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2,
                                              "chat_template_kwargs": {"enable_thinking": False, "custom": 1}})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ a schema that can never be satisfied


@pytest.mark.parametrize("schema", [CYCLE, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}],
                         ids=["two-ref-cycle", "self-ref"])
@pytest.mark.parametrize("thinking", [False, True], ids=["plain", "after-a-thought"])
def test_an_unsatisfiable_schema_is_a_400_in_chat(server: LiveServer, schema: dict[str, Any], thinking: bool) -> None:
    body = {"messages": [HI], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    if thinking:
        body["reasoning_effort"] = "high"
    error = refused(post(server, "/v1/chat/completions", body), 400, "response_format.json_schema.schema")
    assert "can never be satisfied" in error["message"]
    assert_serving(server)


def test_an_unsatisfiable_schema_is_a_400_in_responses(server: LiveServer) -> None:
    body = {"input": "Hi", "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": CYCLE}}}
    error = refused(post(server, "/v1/responses", body), 400, "text.format.schema")
    assert "can never be satisfied" in error["message"]
    assert_serving(server)


def test_a_grammar_that_allows_only_the_end_is_refused_at_compile(server: LiveServer) -> None:
    """The general rule, below any schema: a grammar whose start state allows no token but a stop id."""
    vocab = server.app.state.grammar.wait(0)
    for lark in ('start: ""\n', f"start: {vocab.special('<turn|>')}\n"):
        with pytest.raises(ConstraintError, match="can never be satisfied"):
            vocab.compile(lark)
    vocab.compile('start: "" | "a"\n')  # the empty output among others: a real choice, compiled


# ------------------------------------------------------------------ Content-Type: JSON or 415


def json_routes(server: LiveServer) -> list[str]:
    return [route.path for route in server.app.routes if isinstance(route, Route) and "POST" in (route.methods or ())]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None, "application/jsonx", "text/json"])
def test_a_json_body_of_another_content_type_is_a_415_on_every_json_route(server: LiveServer,
                                                                          content_type: str | None) -> None:
    routes = json_routes(server)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate", "/tokenize"} <= set(routes)
    before = server.engine.admitted
    for path in routes:
        r = post(server, path, {"messages": [HI], "prompt": "Hi", "input": "Hi", "tokens": [2]}, content_type)
        if path.startswith("/v1/messages"):  # Anthropic's Messages API answers in Anthropic's error shape
            assert r.status_code == 415 and r.json()["type"] == "error", r.text[:300]
            assert r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
            continue
        error = refused(r, 415, None)
        assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error", error
    assert server.engine.admitted == before  # nothing was generated
    assert_serving(server)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_application_json_with_or_without_parameters_is_served(server: LiveServer, content_type: str) -> None:
    r = post(server, "/v1/chat/completions", {"messages": [HI], "max_tokens": 2}, content_type)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ tool names the model can call


@pytest.mark.parametrize("name", ["get weather", "a" * 1000, "a" * 65, "", "wetter/heute", "naïve", "a\nb"])
def test_a_tool_name_the_model_cannot_call_is_a_400_on_chat_and_responses(server: LiveServer, name: str) -> None:
    function = {**WEATHER["function"], "name": name}
    chat = {"messages": [HI], "max_tokens": 2, "tools": [{"type": "function", "function": function}],
            "tool_choice": "auto"}
    refused(post(server, "/v1/chat/completions", chat), 400, "tools[0].function.name")
    responses = {"input": "Hi", "max_output_tokens": 2, "tools": [{"type": "function", **function}],
                 "tool_choice": "auto"}
    refused(post(server, "/v1/responses", responses), 400, "tools[0].name")
    assert_serving(server)


@pytest.mark.parametrize("name", ["get_weather", "ns.get-weather", "1st_tool", "a" * 64])
def test_names_within_the_rule_are_declared_and_parsed_back(server: LiveServer, name: str) -> None:
    assert is_tool_name(name)
    assert parse_call(f"call:{name}{{city:<|\"|>Paris<|\"|>}}", [name]) == (name, {"city": "Paris"})
    function = {**WEATHER["function"], "name": name}
    chat = {"messages": [HI], "max_tokens": 2, "tools": [{"type": "function", "function": function}]}
    assert post(server, "/v1/chat/completions", chat).status_code == 200


# ------------------------------------------------------------------ /openapi.json


def test_openapi_json_is_valid_openapi_3_1_and_describes_every_route(server: LiveServer) -> None:
    from openapi_spec_validator import validate

    r = server.client.get("/openapi.json")  # type: ignore[attr-defined]
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    document = r.json()
    validate(document)
    assert document["openapi"] == "3.1.0"
    for route in server.app.routes:
        path = route.path.replace("{model:path}", "{model}")
        for method in set(route.methods or ()) - {"HEAD"}:
            operation = document["paths"][path][method.lower()]
            assert "200" in operation["responses"], (path, method)
            if method == "POST":  # a JSON body: its model's schema, and the errors in OpenAI's (or Anthropic's) shape
                assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                shape = "AnthropicErrorBody" if path.startswith("/v1/messages") else "ErrorBody"
                assert operation["responses"]["415"]["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{shape}"}
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}
    tool = document["components"]["schemas"]["FunctionTool"]["properties"]["name"]
    assert tool["pattern"] == "^[A-Za-z0-9_.\\-]{1,64}$"
    # With an API key set, the protected operations declare it and their 401; the open ones do not.
    keyed = describe(server.app.routes, title="t", version="0", keyed=True)
    validate(keyed)
    assert "401" in keyed["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert keyed["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}, {"apiKey": []}]
    assert "security" not in keyed["paths"]["/health"]["get"] and "401" not in document["paths"]["/v1/models"]["get"][
        "responses"]


def test_the_descriptions_examples_are_bodies_the_routes_accept() -> None:
    shown = [(key, op, example) for key, op in OPERATIONS.items() for example in (op.examples or {}).values()]
    assert len(shown) >= 10
    for key, op, example in shown:
        assert op.body is not None, key
        parse(op.body, json.dumps(example).encode())  # raises APIError (a 400) if the example is not accepted


def test_a_route_without_a_description_cannot_be_served() -> None:
    async def endpoint(request: Any) -> Any:
        raise AssertionError

    with pytest.raises(ValueError, match="POST /v1/undescribed"):
        describe([Route("/health", endpoint, methods=["GET"]), Route("/v1/undescribed", endpoint, methods=["POST"])],
                 title="t", version="0", keyed=False)
