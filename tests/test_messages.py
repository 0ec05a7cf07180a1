"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official `anthropic` SDK, unmodified.

- The tiny random Gemma-4, its output forced by the scripted graph where the test needs a given answer (a thought, a
  call), or left random under a grammar (forced tool calls, a JSON schema, over several seeds): text, streamed events in
  Anthropic's order, thinking blocks, a tool round trip (tool_use -> tool_result -> answer). Every rebuilt prompt is
  checked against the prompt the chat route renders for the same conversation: the Messages route is the chat path.
- The demo host on the null graph (fast): the SDK's create / stream / count_tokens, stop reasons and sequences, usage
  with the prefix reused, and errors as the SDK's own exception types in Anthropic's JSON (400, 401, 404, 413, 429).
- The thinking mapping onto the chat fields (the budget itself is the chat path's; its effect is tested there).
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from server.api.messages.schemas import MessagesRequest
from server.api.messages.translate import chat_request
from server.app.runtime import build_engine, graph_loader
from server.errors import AnthropicError
from server.graphs.base import Graph
from tests import test_responses
from tests.support import gemma4_app
from tests.support.api_fixtures import API_KEY, LiveServer, live_server, null_host, settings, slow_loader
from tests.support.gemma4_app import MODEL, Prompts, chat_prompt
from tests.support.vision import png_bytes, random_image
from tests.test_api_gemma4 import CALL_PARIS, PARIS, WEATHER
from tests.test_responses import PERSON, THOUGHT

WEATHER_TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
                "input_schema": WEATHER["function"]["parameters"]}
TIME_TOOL = {"name": "get_time", "description": "The time in a timezone.", "input_schema": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}
SCHEMAS = {"get_weather": WEATHER_TOOL["input_schema"], "get_time": TIME_TOOL["input_schema"]}
HI = [{"role": "user", "content": "Hi"}]
PNG_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(random_image(16, 16))).decode()}}
STREAM_ORDER = ["message_start", "content_block_start", "ping"]  # then the deltas (the SDK skips pings)


def sse_events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    """A raw stream's events as (event name, data), keep-alive comments skipped; each event is named by its type."""
    events = []
    for block in raw.strip().split("\n\n"):
        if block.startswith(":"):
            continue
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert events[-1][0] == events[-1][1]["type"], block
    return events


# ------------------------------------------------------------------ the tiny Gemma-4


# The fixtures of tests/test_responses.py's scripted server (the same graph and server, this module's own instance).
host, prompts, script = gemma4_app.host, gemma4_app.prompts, gemma4_app.script
graph, server = test_responses.graph, test_responses.server


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_a_text_answer_is_the_chat_prompt_and_anthropics_shape(client: anthropic.Anthropic, server: LiveServer,
                                                               prompts: Prompts, script: Callable[[str], None]) -> None:
    script("Hello there.<turn|>")
    m = client.messages.create(model=MODEL, max_tokens=50, system="Be brief.", messages=HI)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello there.")]  # type: ignore[union-attr]
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    sent = prompts.last
    assert sent == chat_prompt(server, prompts, [{"role": "system", "content": "Be brief."}, *HI])
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(sent)
    assert m.usage.output_tokens == len(server.host.tokenizer.encode("Hello there.<turn|>", add_special_tokens=False))
    count = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=HI)  # type: ignore[arg-type]
    assert count.input_tokens == len(sent)


def test_thinking_blocks_streamed_and_not(client: anthropic.Anthropic, server: LiveServer, prompts: Prompts,
                                          script: Callable[[str], None]) -> None:
    script(THOUGHT)
    thinking = {"type": "enabled", "budget_tokens": 200}
    m = client.messages.create(model=MODEL, max_tokens=100, messages=HI, thinking=thinking)  # type: ignore[arg-type]
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "Let me see." and m.content[0].signature == ""  # type: ignore[union-attr]
    assert m.content[1].text == "It is 4." and m.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert "<|think|>" in server.host.tokenizer.decode(list(prompts.last))  # thinking on in the prompt

    with client.messages.stream(model=MODEL, max_tokens=100, messages=HI, thinking=thinking) as stream:  # type: ignore[arg-type]
        events = [event for event in stream if event.type in (  # the raw events (the helper adds its own: text, ...)
            "message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
            "message_delta", "message_stop")]
        final = stream.get_final_message()
    types = [e.type for e in events]
    assert types[:2] == STREAM_ORDER[:2] and types[-2:] == ["message_delta", "message_stop"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Let me see."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "It is 4."
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Let me see."  # type: ignore[union-attr]
    assert final.content[1].text == "It is 4." and final.stop_reason == "end_turn"  # type: ignore[union-attr]

    # Adaptive thinking is thinking on too; display "omitted" keeps the block, its text empty.
    m = client.messages.create(model=MODEL, max_tokens=100, messages=HI, thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [("thinking", ""), ("text", None)]


def test_a_thinking_block_sent_back_is_the_assistant_turns_reasoning(client: anthropic.Anthropic, server: LiveServer,
                                                                      prompts: Prompts,
                                                                      script: Callable[[str], None]) -> None:
    script("Fine.<turn|>")
    history = [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": ""},
                                                      {"type": "text", "text": "Hello!"}]},
               {"role": "user", "content": [{"type": "text", "text": "How are you?", "cache_control": {"type": "ephemeral"}}]}]
    client.messages.create(model=MODEL, max_tokens=20, messages=history, thinking={"type": "adaptive"})  # type: ignore[arg-type]
    chat = [*HI, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
            {"role": "user", "content": "How are you?"}]
    assert prompts.last == chat_prompt(server, prompts, chat, chat_template_kwargs={"enable_thinking": True})


def test_a_tool_round_trip(client: anthropic.Anthropic, server: LiveServer, prompts: Prompts,
                           script: Callable[[str], None]) -> None:
    script(CALL_PARIS + "<|tool_response>")
    first = client.messages.create(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Paris?"}],
                                   tools=[WEATHER_TOOL])  # type: ignore[list-item]
    (call,) = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and (call.name, call.input) == PARIS
    assert first.stop_reason == "tool_use"

    with client.messages.stream(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Paris?"}],
                                tools=[WEATHER_TOOL]) as stream:  # type: ignore[list-item]
        raw = [e for e in stream if e.type in ("content_block_start", "content_block_delta", "content_block_stop")]
        streamed = stream.get_final_message()
    assert [e.type for e in raw] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert raw[1].delta.type == "input_json_delta" and json.loads(raw[1].delta.partial_json) == PARIS[1]  # type: ignore[union-attr]
    assert streamed.content[0].input == PARIS[1] and streamed.stop_reason == "tool_use"  # type: ignore[union-attr]

    script("It is 21 degrees in Paris.<turn|>")
    result = json.dumps({"temperature": 21})
    second = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER_TOOL], messages=[  # type: ignore[list-item]
        {"role": "user", "content": "Paris?"}, {"role": "assistant", "content": first.content},  # type: ignore[typeddict-item]
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}])
    assert second.content[0].text == "It is 21 degrees in Paris." and second.stop_reason == "end_turn"  # type: ignore[union-attr]
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": call.name,
                                                                      "arguments": json.dumps(call.input)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": result}]
    assert prompts.last == chat_prompt(server, prompts, messages, tools=[WEATHER])
    assert "<|tool_response>response:get_weather{temperature:21}<tool_response|>" in \
        server.host.tokenizer.decode(list(prompts.last))

    # A failed call: the model is told so, as the tool's response object.
    client.messages.create(model=MODEL, max_tokens=20, tools=[WEATHER_TOOL], messages=[  # type: ignore[list-item]
        {"role": "user", "content": "Paris?"}, {"role": "assistant", "content": first.content},  # type: ignore[typeddict-item]
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                      "content": [{"type": "text", "text": "no network"}]},
                                     {"type": "text", "text": "Try again?"}]}])
    rendered = server.host.tokenizer.decode(list(prompts.last))
    assert '<|tool_response>response:get_weather{error:<|"|>no network<|"|>}<tool_response|>' in rendered
    assert "<tool_response|><turn|>\n<|turn>user\nTry again?<turn|>\n<|turn>model\n" in rendered  # the result first


@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_choices_call_validly(client: anthropic.Anthropic, seed: int) -> None:
    """The random model under the call grammar: `tool` (named) and `any`, every call valid against its input_schema."""
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"},
                   {"type": "any", "disable_parallel_tool_use": True}):
        m = client.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "Go."}],
                                   tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice,  # type: ignore[list-item,arg-type]
                                   extra_body={"temperature": 1.0, "top_k": 50 + seed})
        calls = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and calls, (choice, m)
        if choice["type"] == "tool":
            assert {c.name for c in calls} == {"get_weather"}
        if choice.get("disable_parallel_tool_use"):
            assert len(calls) == 1
        for c in calls:
            jsonschema.validate(c.input, SCHEMAS[c.name])


def test_output_config_format_answers_validate(client: anthropic.Anthropic) -> None:
    done = 0
    for _ in range(3):
        m = client.messages.create(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "A person."}],
                                   output_config={"format": {"type": "json_schema", "schema": PERSON}},
                                   extra_body={"temperature": 1.0})
        if m.stop_reason == "max_tokens":
            continue  # a random model may write a long string; what it wrote is still a prefix of valid JSON
        (text,) = m.content
        jsonschema.validate(json.loads(text.text), PERSON)  # type: ignore[union-attr]
        done += 1
    assert done


def test_errors_name_the_messages_fields(server: LiveServer) -> None:
    cases = [
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}, "output_config.format"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}}, "output_config.effort"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"tools": [{**WEATHER_TOOL, "input_schema": 3}]}, "tools[0].input_schema"),
    ]
    for fields, name in cases:
        r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": HI, **fields},
                       timeout=60)
        assert r.status_code == 400, (fields, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(name), (fields, body)


# ------------------------------------------------------------------ the demo host on the null graph


@pytest.fixture(scope="module")
def null_live() -> Iterator[LiveServer]:
    with live_server(settings(api_key=API_KEY, max_body_bytes=32 * 1024)) as live:
        yield live


def null_client(live: LiveServer, **options: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, **({"api_key": API_KEY} | options), max_retries=0, timeout=60)


def test_create_stream_and_count_tokens_on_the_demo(null_live: LiveServer) -> None:
    client = null_client(null_live)
    greedy = {"temperature": 0}
    m = client.messages.create(model="gemma-test", max_tokens=6, messages=HI, extra_body=greedy)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and m.content[0].type == "text"
    with client.messages.stream(model="gemma-test", max_tokens=6, messages=HI, extra_body=greedy) as stream:
        final = stream.get_final_message()
    raw = sse_events(httpx.post(f"{null_live.url}/v1/messages", headers={"x-api-key": API_KEY}, timeout=60, json={
        "model": "gemma-test", "max_tokens": 6, "messages": HI, "stream": True, "temperature": 0}).text)
    assert [name for name, _ in raw] == [*STREAM_ORDER, *["content_block_delta"] * 6, "content_block_stop",
                                         "message_delta", "message_stop"]
    assert raw[0][1]["message"]["content"] == [] and raw[0][1]["message"]["stop_reason"] is None
    assert raw[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(data["delta"]["text"] for name, data in raw if name == "content_block_delta") == m.content[0].text  # type: ignore[union-attr]
    assert raw[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None, "stop_details": None,
                                   "container": None}
    assert raw[-2][1]["usage"]["output_tokens"] == 6
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"  # type: ignore[union-attr]
    # The repeated prompt is found in the device's KV cache: read from it, not prefilled again.
    total = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert final.usage.cache_read_input_tokens and total == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    count = client.messages.count_tokens(model="gemma-test", messages=HI)  # type: ignore[arg-type]
    tokenized = httpx.post(f"{null_live.url}/tokenize", json={"messages": HI}, headers={"x-api-key": API_KEY}).json()
    assert count.input_tokens == total == tokenized["count"]


def test_stop_sequences_and_the_bearer_token(null_live: LiveServer) -> None:
    client = null_client(null_live, api_key=None, auth_token=API_KEY)  # Authorization: Bearer, as Claude Code's token
    m = client.messages.create(model="gemma-test", max_tokens=30, messages=HI, stop_sequences=["a a"],
                               extra_body={"temperature": 0}, metadata={"user_id": "u1"})
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "a a")
    assert "a a" not in "".join(b.text for b in m.content)  # type: ignore[union-attr]


def test_errors_are_the_sdks_exceptions_in_anthropics_shape(null_live: LiveServer) -> None:
    client = null_client(null_live)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        null_client(null_live, api_key="wrong").messages.create(model="gemma-test", max_tokens=5, messages=HI)
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-opus-9", max_tokens=5, messages=HI)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "claude-opus-9" in missing.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-opus-9", messages=HI)  # type: ignore[arg-type]
    refused = [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, PNG_BLOCK]}]},  # a text-only model
         "messages[0].content[1]: image blocks are not supported"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}]}, "messages"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"thinking": {"type": "adaptive"}}, "thinking"),  # the plain protocol has no thought channel
        ({"tools": [WEATHER_TOOL]}, "tools"),  # ... nor tool calls
        ({"container": "c1"}, "container"),
        ({"mcp_servers": []}, "mcp_servers"),
    ]
    for fields, name in refused:
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model="gemma-test", max_tokens=5, messages=HI, extra_body=fields)
        assert bad.value.body["error"]["type"] == "invalid_request_error", fields  # type: ignore[index]
        assert bad.value.body["error"]["message"].startswith(name), (fields, bad.value.body)  # type: ignore[index]
    r = httpx.post(f"{null_live.url}/v1/messages", json={"model": "gemma-test", "messages": HI},
                   headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens"), r.text
    assert r.json()["request_id"] == r.headers["x-request-id"]
    r = httpx.post(f"{null_live.url}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": "gemma-test", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 40000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # cache_control anywhere is accepted and ignored
    m = client.messages.create(model="gemma-test", max_tokens=2, cache_control={"type": "ephemeral"}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}])
    assert m.stop_reason == "max_tokens"
    # OpenAI's routes keep OpenAI's shape
    r = httpx.post(f"{null_live.url}/v1/chat/completions", json={"model": "nope", "messages": HI},
                   headers={"x-api-key": API_KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "type" not in r.json()


def test_a_full_queue_is_a_rate_limit_error_and_a_device_error_an_error_event() -> None:
    config = settings(max_queue=1)
    load, _ = slow_loader(null_host(), 0.05)
    with live_server(config, build_engine(null_host(), config, load=load)) as live:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=30)
        with client.messages.stream(model="gemma-test", max_tokens=300, messages=HI) as running:
            next(iter(running))  # message_start: it holds the queue
            with pytest.raises(anthropic.RateLimitError) as caught:
                client.messages.create(model="gemma-test", max_tokens=1, messages=HI)
            assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
            assert caught.value.response.headers["retry-after"] == "1"
    load, _ = slow_loader(null_host(), 0.0, fail_after=3)  # prefill + 2 decode calls work, then the device fails
    with live_server(config, build_engine(null_host(), config, load=load)) as live:
        raw = httpx.post(f"{live.url}/v1/messages", json={"model": "gemma-test", "max_tokens": 20, "messages": HI,
                                                          "stream": True}, timeout=30).text
        blocks = [block.split("\n") for block in raw.strip().split("\n\n") if not block.startswith(":")]
        assert blocks[-1][0] == "event: error"
        error = json.loads(blocks[-1][1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert "simulated device fault" in error["error"]["message"]


def test_a_loading_server_is_overloaded_with_retry_after_and_counts_tokens_already() -> None:
    release = threading.Event()

    def load() -> Graph:
        assert release.wait(60), "the test never released the load"
        return graph_loader(null_host())()

    config = settings()
    live = LiveServer(config, build_engine(null_host(), config, load=load), null_host()).start(wait_ready=False)
    try:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(anthropic.ServiceUnavailableError) as caught:
            client.messages.create(model="gemma-test", max_tokens=5, messages=HI)
        assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert caught.value.response.headers["retry-after"]
        assert client.messages.count_tokens(model="gemma-test", messages=HI).input_tokens > 0  # type: ignore[arg-type]
    finally:
        release.set()
        live.wait_state("ok")
        live.stop()


# ------------------------------------------------------------------ the mapping onto the chat fields


def _chat(**fields: Any) -> Any:
    return chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 64, "messages": HI, **fields}))


def test_thinking_and_effort_map_onto_the_chat_fields() -> None:
    enabled = _chat(thinking={"type": "enabled", "budget_tokens": 300})
    assert enabled.chat_template_kwargs == {"enable_thinking": True} and enabled.reasoning_budget == 300
    adaptive = _chat(thinking={"type": "adaptive"})
    assert adaptive.chat_template_kwargs == {"enable_thinking": True} and adaptive.reasoning_budget is None
    disabled = _chat(thinking={"type": "disabled"})
    assert disabled.chat_template_kwargs == {"enable_thinking": False} and disabled.reasoning_effort is None
    assert _chat(output_config={"effort": "low"}).reasoning_effort == "low"
    assert _chat(output_config={"effort": "max"}).reasoning_effort == "xhigh"  # chat's highest
    both = _chat(thinking={"type": "enabled", "budget_tokens": 50}, output_config={"effort": "high"})
    assert (both.reasoning_budget, both.reasoning_effort) == (50, "high")
    with pytest.raises(AnthropicError) as caught:
        _chat(thinking={"type": "disabled"}, output_config={"effort": "high"})
    assert caught.value.param == "output_config.effort"
    assert _chat().chat_template_kwargs is None and _chat().reasoning_budget is None  # the model's default


def test_tool_choice_and_sampling_map_onto_the_chat_fields() -> None:
    tools = [WEATHER_TOOL]
    assert _chat(tools=tools, tool_choice={"type": "any"}).tool_choice == "required"
    named = _chat(tools=tools, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert named.parallel_tool_calls is False
    assert named.tools[0].function == {"name": "get_weather", "description": WEATHER_TOOL["description"],
                                       "parameters": WEATHER_TOOL["input_schema"]}
    assert _chat(tools=tools, tool_choice={"type": "none"}).tool_choice == "none"
    sampled = _chat(temperature=0.5, top_p=0.9, top_k=20, stop_sequences=["END"])
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.stop, sampled.max_tokens) == (
        0.5, 0.9, 20, ("END",), 64)
