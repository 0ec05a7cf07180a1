"""Gemma-4's protocol through the OpenAI API, end to end: a tiny random Gemma-4 served with the Gemma-4-format
tokenizer and chat template (tests/support/gemma4_tokenizer.py), over HTTP.

- A scripted graph (a stand-in device: the real tiny graph, whose logits are overridden while a script is set to force
  a chosen token sequence) drives the output parser through the engine and SSE: plain answer, thought then answer,
  one call, two calls, a call after a thought, the known failure modes, a stream cut mid-call.
- The random model itself, constrained: tool_choice named / required / none, response_format, a cut call.
- The official `openai` client, streaming and not, including a whole tool round trip.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI
from pydantic import BaseModel, Field

from server.app.runtime import Host, graph_loader
from server.graphs.base import Graph
from server.protocol import Gemma4Protocol, PlainProtocol
from tests.support import gemma4_app
from tests.support.api_fixtures import LiveServer, WrappedGraph, null_host
from tests.support.gemma4_app import MODEL, chat_chunks, gemma4_server
from tests.support.gemma4_tokenizer import GEMMA4_TOKENS

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]

host, client, script = gemma4_app.host, gemma4_app.client, gemma4_app.script  # shared fixtures (pytest finds them by name)


class ScriptedGraph(WrappedGraph):
    """A stand-in device: the real graph, except that while `script` (token ids) is set, each request's logits force
    those tokens in order (the last one repeated). Needs every prompt in one prefill call (bucket = context)."""

    def __init__(self, inner: Graph) -> None:
        super().__init__(inner, "scripted")
        self.script: list[int] | None = None
        self._step = 0

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        self.calls += 1
        logits = self.inner.forward(embeds, positions, last_only=last_only, on_submit=on_submit)  # [1, T, V]
        if self.script is None:
            return logits
        self._step = 0 if positions.shape[1] > 1 or int(positions[0, 0]) == 0 else self._step + 1
        forced = torch.full_like(logits, -20.0)  # [1, T, V]
        forced[..., self.script[min(self._step, len(self.script) - 1)]] = 20.0
        return forced


@pytest.fixture(scope="module")
def graph(host: Host) -> ScriptedGraph:
    return ScriptedGraph(graph_loader(host)())


@pytest.fixture(scope="module")
def server(host: Host, graph: ScriptedGraph) -> Iterator[LiveServer]:
    with gemma4_server(host, graph, prefix_reuse=False) as live:
        yield live


def chat(server: LiveServer, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": HI, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: LiveServer, **body: Any) -> dict[str, Any]:
    """The stream gathered as an OpenAI client accumulates it (tool calls by index, arguments concatenated)."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in chat_chunks(server, {"model": MODEL, "messages": HI, "stream": True, **body}):
        choice = chunk["choices"][0]
        delta = choice["delta"]
        message["content"] += delta.get("content") or ""
        message["reasoning_content"] += delta.get("reasoning_content") or ""
        assert '<|"|>' not in (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        for call in delta.get("tool_calls") or ():
            entry = message["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or call.get("id")
            entry["name"] = entry["name"] or call["function"].get("name")
            entry["arguments"] += call["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    message["tool_calls"] = [message["tool_calls"][i] for i in sorted(message["tool_calls"])]
    return {"message": message, "finish_reason": finish}


def calls_of(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in body["choices"][0]["message"].get("tool_calls") or ()]


Q = '<|"|>'
CALL_PARIS = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},unit:{Q}celsius{Q}}}<tool_call|>"
CALL_UTC = f"<|tool_call>call:get_time{{zone:{Q}UTC{Q}}}<tool_call|>"
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
UTC = ("get_time", {"zone": "UTC"})

# (script, request fields, expected content, reasoning, calls, finish_reason)
CASES = {
    "plain answer": ("Hello there.<turn|>", {}, "Hello there.", "", [], "stop"),
    "thought then answer": ("<|channel>thought\nLet me see.<channel|>It is 4.<turn|>",
                            {"chat_template_kwargs": {"enable_thinking": True}}, "It is 4.", "Let me see.", [], "stop"),
    "one call": (CALL_PARIS + "<|tool_response>", {"tools": TOOLS}, "", "", [PARIS], "tool_calls"),
    "two calls": (CALL_PARIS + CALL_UTC + "<|tool_response>", {"tools": TOOLS}, "", "", [PARIS, UTC], "tool_calls"),
    "a call after a thought": ("<|channel>thought\nWeather tool.<channel|>" + CALL_PARIS + "<|tool_response>",
                               {"tools": TOOLS, "reasoning_effort": "high"}, "", "Weather tool.", [PARIS],
                               "tool_calls"),
    "text then a call": ("Checking." + CALL_UTC + "<turn|>", {"tools": TOOLS}, "Checking.", "", [UTC], "tool_calls"),
    # Failure modes seen in other servers' Gemma-4 parsers:
    "quote token in text": (f"She said {Q}hi{Q}.<turn|>", {}, 'She said "hi".', "", [], "stop"),
    "call without call:": (f"<|tool_call>get_time{{zone:{Q}UTC{Q}}}<tool_call|><turn|>", {"tools": TOOLS}, "", "",
                           [UTC], "tool_calls"),
    "call without its opening token": (f"call:get_time{{zone:{Q}UTC{Q}}}<tool_call|><turn|>", {"tools": TOOLS}, "",
                                       "", [UTC], "tool_calls"),
    "undeclared tool stays content": (f"<|tool_call>call:rm{{path:{Q}/{Q}}}<tool_call|><turn|>", {"tools": TOOLS},
                                      None, "", [], "stop"),
    "calls ignored without tools": (CALL_UTC + "<turn|>", {}, None, "", [], "stop"),
}


def test_the_protocol_is_detected_once_with_the_host(server: LiveServer, host: Host) -> None:
    """load_host asks the tokenizer once; the stop ids, the API and the constraint planner are handed that answer."""
    assert isinstance(host.protocol, Gemma4Protocol) and host.info.protocol is host.protocol
    assert server.app.state.prompts.protocol is host.protocol
    assert host.stop_token_ids == tuple(dict.fromkeys((*host.structure.eos_token_ids, GEMMA4_TOKENS["<turn|>"],
                                                       GEMMA4_TOKENS["<|tool_response>"])))
    assert server.app.state.grammar is host.grammar  # the one the engine builds its matchers with
    plain = null_host()  # the Gemma-3 demo: no native tool format, no stops beyond its own eos
    assert isinstance(plain.protocol, PlainProtocol) and plain.protocol.calls is None
    assert plain.stop_token_ids == tuple(dict.fromkeys(plain.structure.eos_token_ids))


@pytest.mark.parametrize("name", list(CASES))
def test_scripted_outputs_parse_the_same_streamed_and_not(server: LiveServer, script: Callable[[str], None],
                                                          name: str) -> None:
    text, fields, content, reasoning, calls, finish = CASES[name]
    script(text)
    body = chat(server, max_tokens=100, **fields)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == finish
    assert calls_of(body) == calls
    assert message.get("reasoning_content", "") == reasoning
    if content is not None:
        assert (message["content"] or "") == content
    else:  # not a call: it comes back as text, never dropped, never with the quote token
        assert "get_time" in message["content"] or "rm" in message["content"]
    assert '<|"|>' not in (message["content"] or "") + message.get("reasoning_content", "")
    for call in message.get("tool_calls") or ():
        assert call["type"] == "function" and call["id"].startswith("call_")

    streamed = stream(server, max_tokens=100, **fields)
    assert streamed["finish_reason"] == finish
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["message"]["tool_calls"]] == calls
    assert streamed["message"]["reasoning_content"] == reasoning
    assert streamed["message"]["content"] == (message["content"] or "")


def test_a_stream_cut_mid_call_ends_with_length_and_no_tool_call(server: LiveServer, host: Host,
                                                                 script: Callable[[str], None]) -> None:
    script(CALL_PARIS + "<|tool_response>")
    cut = len(host.tokenizer.encode(CALL_PARIS, add_special_tokens=False)) - 2
    for result in (chat(server, tools=TOOLS, max_tokens=cut)["choices"][0], stream(server, tools=TOOLS, max_tokens=cut)):
        message = result["message"]
        assert result["finish_reason"] == "length"
        assert not message.get("tool_calls")
        assert message["content"] == ""  # dropped: no raw call syntax as text (tests/test_cut_markup.py: every route)


def test_a_finished_grammar_ends_without_another_device_step(server: LiveServer, host: Host, graph: ScriptedGraph,
                                                             script: Callable[[str], None]) -> None:
    document = '{"answer": 42}'
    script(document + " and more text<turn|>")  # the model would go on; the grammar is complete after "}"
    tokens = len(host.tokenizer.encode(document, add_special_tokens=False))
    before = graph.calls
    body = chat(server, response_format={"type": "json_object"}, max_tokens=50)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == document
    assert body["usage"]["completion_tokens"] == tokens
    assert graph.calls - before == tokens  # one prefill + one step per token after the first: none to sample eos


def test_tool_round_trip_with_the_openai_client(client: OpenAI, host: Host, script: Callable[[str], None],
                                                server: LiveServer) -> None:
    script(CALL_PARIS + "<|tool_response>")
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == PARIS[1]

    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    # The result is rendered back in Gemma-4's tool-response form, in the same model turn.
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    prompt = host.tokenizer.decode(r.json()["tokens"])
    assert "<|tool_response>response:get_weather{temperature:21}<tool_response|>" in prompt, prompt

    script("It is 21 degrees in Paris.<turn|>")
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)  # type: ignore[arg-type]
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is 21 degrees in Paris."
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is 21 degrees in Paris."


def test_reasoning_deltas_with_the_openai_client(client: OpenAI, script: Callable[[str], None]) -> None:
    script("<|channel>thought\nTwo plus two.<channel|>4<turn|>")
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True,  # type: ignore[arg-type]
                                                 reasoning_effort="low"))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert reasoning == "Two plus two."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "4"


# ------------------------------------------------------------------ the random model, constrained


def valid_call(name: str, arguments: dict[str, Any]) -> bool:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(arguments, schema)
    return True


@pytest.mark.parametrize("seed", range(4))
def test_a_named_tool_choice_always_calls_that_function_validly(client: OpenAI, seed: int) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=HI, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                       temperature=1.0, seed=seed, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"] or len(calls) >= 1 and all(
        c.function.name == "get_weather" for c in calls)
    assert all(valid_call(c.function.name, json.loads(c.function.arguments)) for c in calls)


@pytest.mark.parametrize("seed", range(3))
def test_required_calls_a_declared_function_streamed(server: LiveServer, seed: int) -> None:
    result = stream(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                    seed=seed, max_tokens=200)
    assert result["finish_reason"] == "tool_calls"
    calls = result["message"]["tool_calls"]
    assert len(calls) == 1 and valid_call(calls[0]["name"], json.loads(calls[0]["arguments"]))


def test_tool_choice_none_never_calls(server: LiveServer) -> None:
    for seed in range(3):
        body = chat(server, tools=TOOLS, tool_choice="none", temperature=1.0, seed=seed, max_tokens=30)
        assert not body["choices"][0]["message"].get("tool_calls")
        assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_forced_call_cut_by_max_tokens_is_length_and_never_a_malformed_call(server: LiveServer) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for result in (chat(server, tools=TOOLS, tool_choice=choice, max_tokens=4)["choices"][0],
                   stream(server, tools=TOOLS, tool_choice=choice, max_tokens=4)):
        assert result["finish_reason"] == "length"
        assert not result["message"].get("tool_calls")


@pytest.mark.parametrize("response_format", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "age": {"type": "integer"},
                                         "role": {"type": "string", "enum": ["admin", "user"]}},
        "required": ["name", "age", "role"], "additionalProperties": False}}},
])
def test_structured_output_on_the_random_model(server: LiveServer, response_format: dict[str, Any]) -> None:
    for seed in range(3):
        body = chat(server, response_format=response_format, temperature=1.0, seed=seed, max_tokens=300)
        if body["choices"][0]["finish_reason"] == "length":
            continue  # a random model may write a long string; what it wrote is still a prefix of valid JSON
        assert body["choices"][0]["finish_reason"] == "stop"
        value = json.loads(body["choices"][0]["message"]["content"])
        jsonschema.validate(value, response_format.get("json_schema", {}).get("schema", {"type": "object"}))


def test_what_cannot_be_enforced_is_a_400(server: LiveServer) -> None:
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "a+"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
        ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high"}, "reasoning_effort"),
    ]
    for fields, param in cases:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, **fields}, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        assert (r.json()["error"]["param"] or "").startswith(param), (fields, r.json())
    assert httpx.get(f"{server.url}/health").status_code == 200




# ------------------------------------------------------------------ third-party clients, unmodified


class Weather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def test_openai_parse_with_a_pydantic_model(client: OpenAI) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=HI, response_format=Weather,  # type: ignore[arg-type]
                                      temperature=1.0, seed=1, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Weather)


def test_langchain_bind_tools_and_structured_output(server: LiveServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", temperature=1.0, max_tokens=200,
                     max_retries=0, seed=3)
    message = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("Weather in Paris?")
    assert [call["name"] for call in message.tool_calls][:1] == ["get_weather"]
    assert all(valid_call(call["name"], call["args"]) for call in message.tool_calls)
    for method in ("function_calling", "json_schema"):
        result = llm.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(result, Weather), (method, result)


def test_litellm_completion_with_tools_and_response_format(server: LiveServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    import litellm

    common = {"model": f"openai/{MODEL}", "api_base": f"{server.url}/v1", "api_key": "unused", "messages": HI,
              "temperature": 1.0, "max_tokens": 200, "seed": 5}
    r = litellm.completion(tools=TOOLS, tool_choice="required", **common)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert all(valid_call(c.function.name, json.loads(c.function.arguments)) for c in calls)
    r = litellm.completion(response_format=Weather, **common)
    assert r.choices[0].finish_reason == "stop"
    Weather.model_validate_json(r.choices[0].message.content)
