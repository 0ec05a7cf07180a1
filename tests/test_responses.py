"""`/v1/responses` with the official `openai` SDK against a live server.

- The tiny random Gemma-4 (tests/support/gemma4_tokenizer.py), its output forced by a scripted graph (a stand-in device) where
  the test needs a given answer (a thought, a call), or left random under a grammar (a JSON schema): plain, streamed
  (event types and order, the same text as non-streamed), reasoning items, function calls and their outputs, three
  turns through `previous_response_id`. Every rebuilt prompt is checked against the prompt the chat route renders for
  the same conversation: the Responses route is the chat path, not a second implementation of it.
- The demo host on the null graph (fast): the store's bounds (count, bytes), 404s, GET and DELETE, the API key, the
  body limit, prefix reuse across turns, and what the plain (no tools, no thinking) protocol refuses.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from openai import OpenAI
from pydantic import BaseModel, Field

from server.app.runtime import Host, build_engine, graph_loader
from tests.support import gemma4_app
from tests.support.api_fixtures import API_KEY, ROOT, LiveServer, live_server, null_host, settings, slow_loader
from tests.support.gemma4_app import MODEL, Prompts, chat_prompt, gemma4_server
from tests.test_api_gemma4 import CALL_PARIS, PARIS, WEATHER, ScriptedGraph

# The Responses API's flat function-tool shape.
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
                "parameters": WEATHER["function"]["parameters"], "strict": True}
THOUGHT = "<|channel>thought\nLet me see.<channel|>It is 4.<turn|>"


class TurnScriptedGraph(ScriptedGraph):
    """The scripted graph with prefix reuse on: the script's step is counted from the last prefill's end (a reused
    prefix makes the prefill shorter; a repeated prompt makes none, its kept logits give the first token)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self._prompt_end = 0

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        self.calls += 1
        logits = self.inner.forward(embeds, positions, last_only=last_only, on_submit=on_submit)  # [1, T, V]
        last = int(positions[0, -1])
        if positions.shape[1] > 1:
            self._prompt_end = last
        if self.script is None:
            return logits
        step = last - self._prompt_end
        forced = torch.full_like(logits, -20.0)  # [1, T, V]
        forced[..., self.script[min(step, len(self.script) - 1)]] = 20.0
        return forced


host, client, prompts, script = gemma4_app.host, gemma4_app.client, gemma4_app.prompts, gemma4_app.script  # fixtures


@pytest.fixture(scope="module")
def graph(host: Host) -> TurnScriptedGraph:
    return TurnScriptedGraph(graph_loader(host)())


@pytest.fixture(scope="module")
def server(host: Host, graph: TurnScriptedGraph) -> Iterator[LiveServer]:
    with gemma4_server(host, graph) as live:
        yield live


def event_types(events: Sequence[Any]) -> list[str]:
    return [event.type for event in events]


# ------------------------------------------------------------------ plain, streamed, reasoning


def test_plain_create_is_the_chat_prompt_and_openais_shape(client: OpenAI, server: LiveServer, prompts: Prompts,
                                                          script: Callable[[str], None]) -> None:
    script("Hello there.<turn|>")
    r = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", temperature=0,
                                metadata={"run": "1"})
    prompt = prompts.last
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there."
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.instructions == "Be brief." and r.temperature == 0 and r.metadata == {"run": "1"} and r.store
    assert r.tools == [] and r.tool_choice == "auto" and r.incomplete_details is None and r.error is None
    assert r.usage is not None and r.usage.input_tokens == len(prompt)
    assert r.usage.output_tokens == len(server.host.tokenizer.encode("Hello there.<turn|>", add_special_tokens=False))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # instructions are a system message first: the prompt is the chat route's for that conversation
    assert prompt == chat_prompt(server, prompts, [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}], temperature=0)
    # input as items, text parts joined as chat joins them
    client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."}, {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "H"},
                                                       {"type": "input_text", "text": "i"}]}])
    assert prompts.last == chat_prompt(server, prompts, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}])


EXPECTED_STREAM = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
    "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.completed",
]


def squeeze(types: list[str]) -> list[str]:
    """Runs of the same delta event as one."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or not t.endswith(".delta")]


def test_reasoning_item_streamed_and_not(client: OpenAI, script: Callable[[str], None]) -> None:
    script(THOUGHT)
    r = client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "high", "summary": "auto"})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [part.text for part in reasoning.content] == ["Let me see."]
    # No summarizer: asked for a summary, the item's summary is the thought itself, verbatim.
    assert [(part.type, part.text) for part in reasoning.summary] == [("summary_text", "Let me see.")]
    assert message.type == "message" and r.output_text == "It is 4."
    assert r.reasoning is not None and r.reasoning.effort == "high"
    assert r.usage is not None and 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens

    plain = client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "high"})
    assert plain.output[0].type == "reasoning" and plain.output[0].summary == []  # not asked for: none, as OpenAI's

    events = list(client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "high"}, stream=True))
    assert squeeze(event_types(events)) == EXPECTED_STREAM
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me see."
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."
    final = events[-1].response
    assert final.output_text == "It is 4." and final.id == events[0].response.id
    assert [item.type for item in final.output] == ["reasoning", "message"]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1] and added[1].item.id == final.output[1].id


def test_reasoning_items_sent_back_are_the_assistant_turns_reasoning(client: OpenAI, server: LiveServer,
                                                                     prompts: Prompts,
                                                                     script: Callable[[str], None]) -> None:
    script(THOUGHT)
    first = client.responses.create(model=MODEL, input="2+2?", reasoning={"effort": "high"})
    script("Yes.<turn|>")
    client.responses.create(model=MODEL, reasoning={"effort": "high"}, input=[
        {"role": "user", "content": "2+2?"}, *first.output, {"role": "user", "content": "Sure?"}])  # type: ignore[list-item]
    sent_back = prompts.last
    client.responses.create(model=MODEL, reasoning={"effort": "high"}, previous_response_id=first.id, input="Sure?")
    assert prompts.last == sent_back
    assert sent_back == chat_prompt(server, prompts, [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "Let me see."},
        {"role": "user", "content": "Sure?"}], reasoning_effort="high")


def test_streamed_equals_non_streamed_on_the_random_model_greedy(client: OpenAI) -> None:
    common: dict[str, Any] = {"model": MODEL, "input": "Tell me a story.", "temperature": 0, "max_output_tokens": 24}
    r = client.responses.create(**common)
    events = list(client.responses.create(**common, stream=True))
    streamed = events[-1].response
    assert events[-1].type == f"response.{r.status}" and streamed.status == r.status
    assert streamed.output_text == r.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [item.type for item in streamed.output] == [item.type for item in r.output]
    assert streamed.usage == r.usage or streamed.usage.output_tokens == r.usage.output_tokens  # type: ignore[union-attr]


def test_a_cut_by_max_output_tokens_is_incomplete(client: OpenAI, script: Callable[[str], None]) -> None:
    script("One two three four five six seven.<turn|>")
    r = client.responses.create(model=MODEL, input="Count.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage is not None and r.usage.output_tokens == 3
    assert r.output[-1].status == "incomplete"
    events = list(client.responses.create(model=MODEL, input="Count.", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text and events[-1].response.output[-1].status == "incomplete"


def test_the_stream_helper_and_its_final_response(client: OpenAI, script: Callable[[str], None]) -> None:
    script("Hello there.<turn|>")
    texts = []
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                texts.append(event.delta)
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello there."
    assert final.status == "completed"
    # Stored once the stream finished, as a non-streamed response is.
    assert client.responses.retrieve(final.id).output_text == "Hello there."
    (said,) = client.responses.input_items.list(final.id)
    assert said.type == "message" and said.content[0].text == "Hi"  # type: ignore[union-attr]


# ------------------------------------------------------------------ tools


def test_function_call_and_its_output_round_trip(client: OpenAI, server: LiveServer, prompts: Prompts,
                                                 script: Callable[[str], None]) -> None:
    script(CALL_PARIS + "<|tool_response>")
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL])  # type: ignore[list-item]
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed" and call.call_id.startswith("call_")
    assert (call.name, json.loads(call.arguments)) == PARIS
    assert first.output_text == "" and first.tools[0].name == "get_weather"  # type: ignore[union-attr]

    # Streamed: the call's item, its arguments in one delta (a call is emitted once, complete), then done.
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                          stream=True))
    assert event_types(events)[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                       "response.function_call_arguments.done", "response.output_item.done",
                                       "response.completed"]
    assert json.loads(events[3].delta) == PARIS[1] and events[-1].response.output[0].name == "get_weather"

    result = json.dumps({"temperature": 21})
    script("It is 21 degrees in Paris.<turn|>")
    # Stateless: the output items sent back as input, then the call's output.
    second = client.responses.create(model=MODEL, tools=[WEATHER_TOOL], input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"}, *first.output,  # type: ignore[list-item]
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert second.output_text == "It is 21 degrees in Paris."
    stateless = prompts.last
    # Stored: previous_response_id, then only the call's output.
    third = client.responses.create(model=MODEL, tools=[WEATHER_TOOL], previous_response_id=first.id, input=[  # type: ignore[list-item]
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    assert third.output_text == "It is 21 degrees in Paris." and third.previous_response_id == first.id
    assert prompts.last == stateless
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": call.name,
                                                                           "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    assert stateless == chat_prompt(server, prompts, messages, tools=[WEATHER])
    assert "<|tool_response>response:get_weather{temperature:21}<tool_response|>" in \
        server.host.tokenizer.decode(list(stateless))

    # Each response lists its own input items (not earlier turns'), ids kept as sent or new, text as parts.
    listed = [item.model_dump(exclude_none=True) for item in client.responses.input_items.list(second.id, order="asc")]
    (message, sent_call, output) = listed
    assert message["id"].startswith("msg_") and message["role"] == "user" and message["status"] == "completed"
    assert message["content"] == [{"type": "input_text", "text": "Weather in Paris?"}]
    assert sent_call["id"] == call.id and (sent_call["type"], sent_call["call_id"]) == ("function_call", call.call_id)
    assert output["id"].startswith("fco_") and (output["call_id"], output["output"]) == (call.call_id, result)
    assert [item.id for item in client.responses.input_items.list(second.id)] == [o["id"] for o in listed[::-1]]
    (only,) = client.responses.input_items.list(third.id)
    assert only.type == "function_call_output" and only.call_id == call.call_id


@pytest.mark.parametrize("seed", range(2))
def test_a_named_tool_choice_calls_that_function_validly(client: OpenAI, seed: int) -> None:
    r = client.responses.create(model=MODEL, input="Hi", tools=[WEATHER_TOOL],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                                max_output_tokens=200)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER_TOOL["parameters"])


# ------------------------------------------------------------------ structured output


# Bounded everywhere (no free integer: a random model may write digits until max_output_tokens).
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "admin": {"type": "boolean"},
                                           "role": {"type": "string", "enum": ["admin", "user"]}},
          "required": ["name", "admin", "role"], "additionalProperties": False}


def test_a_json_schema_text_format_validates(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    done = 0
    for _ in range(3):
        r = client.responses.create(model=MODEL, input="A person, please.", text={"format": fmt},  # type: ignore[typeddict-item]
                                    temperature=1.0, max_output_tokens=200)
        assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
        if r.status == "incomplete":
            continue  # a random model may write a long string; what it wrote is still a prefix of valid JSON
        jsonschema.validate(json.loads(r.output_text), PERSON)
        done += 1
    assert done


class Weather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Weather in Paris?", text_format=Weather, temperature=1.0,
                               max_output_tokens=200)
    assert isinstance(r.output_parsed, Weather)


# ------------------------------------------------------------------ previous_response_id


def test_three_turns_through_previous_response_id(client: OpenAI, server: LiveServer, prompts: Prompts,
                                                  script: Callable[[str], None]) -> None:
    script("Hello Ada.<turn|>")
    one = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Be brief.")
    script("Ada.<turn|>")
    two = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=one.id)
    script("You are welcome.<turn|>")
    three = client.responses.create(model=MODEL, input="Thanks.", previous_response_id=two.id)
    assert three.output_text == "You are welcome." and three.previous_response_id == two.id
    assert three.instructions is None  # instructions are not carried over (OpenAI's rule)
    turn3 = prompts.last
    assert turn3 == chat_prompt(server, prompts, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": "Ada."},
        {"role": "user", "content": "Thanks."}])
    assert client.responses.retrieve(three.id).output_text == "You are welcome."


def test_an_unknown_previous_response_id_is_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert caught.value.code == "previous_response_not_found"
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_refused_fields_are_400s_naming_them(server: LiveServer) -> None:
    cases = [
        ({"foo": 1}, "foo"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "file_search"}]}, "tools"),  # web_search is accepted, not offered (Codex sends it)
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),  # reasoning.encrypted_content is accepted
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/$defs/missing"}}}},
         "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "not json"}]}, "input"),
        ({"input": []}, "input"),
    ]
    for fields, param in cases:
        r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi", **fields}, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert (error["param"] or "").startswith(param), (fields, error)
        assert error["message"].startswith(param), (fields, error)
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------ the store, on the demo's null graph


@pytest.fixture(scope="module")
def null_live() -> Iterator[LiveServer]:
    config = settings(api_key=API_KEY, responses_store_max=3, max_body_bytes=32 * 1024)
    with live_server(config) as live:
        yield live


def null_client(live: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_store_evicts_the_oldest_by_count(null_live: LiveServer) -> None:
    client = null_client(null_live)
    made = [client.responses.create(model="gemma-test", input=f"Turn {i}", max_output_tokens=2) for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="gemma-test", input="Hi", previous_response_id=made[0].id)
    assert "evicted" in caught.value.message
    for r in made[1:]:
        kept = client.responses.retrieve(r.id)
        assert kept.id == r.id and kept.output_text == r.output_text
    assert len(null_live.app.state.response_store) == 3


def test_store_evicts_the_oldest_by_bytes() -> None:
    """metadata is echoed in the stored response: bytes without tokens (the demo's context is 512 tokens)."""
    with live_server(settings(responses_store_bytes=8000)) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        store = live.app.state.response_store
        made = []
        for i in range(4):
            metadata = {f"k{j}": str(i) * 500 for j in range(4)}  # ~2 KB
            made.append(client.responses.create(model="gemma-test", input="Hi", metadata=metadata,
                                                max_output_tokens=2))
            assert store.bytes <= 8000
        kept = [r.id for r in made if r.id in store]
        assert made[0].id not in kept and made[-1].id in kept and len(kept) >= 2
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made[0].id)
        # One larger than the whole budget is answered, not kept, and evicts nothing.
        big = client.responses.create(model="gemma-test", input="Hi", max_output_tokens=2,
                                      metadata={f"k{j}": "x" * 512 for j in range(16)})
        assert big.output and big.id not in store and [r.id for r in made if r.id in store] == kept


def test_retrieve_delete_and_store_false(null_live: LiveServer) -> None:
    client = null_client(null_live)
    r = client.responses.create(model="gemma-test", input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model="gemma-test", input="Hi", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_items_page_as_openais_cursor_list(null_live: LiveServer) -> None:
    client = null_client(null_live)
    said = [f"Message {i}" for i in range(5)]
    r = client.responses.create(model="gemma-test", max_output_tokens=2,
                                input=[{"role": "user", "content": text} for text in said])
    page = client.responses.input_items.list(r.id, limit=2)
    assert [item.content[0].text for item in page.data] == said[:-3:-1] and page.has_more  # newest first
    assert page.first_id == page.data[0].id and page.last_id == page.data[1].id
    everything = list(client.responses.input_items.list(r.id, limit=2))  # the SDK follows `after` to the end
    assert [item.content[0].text for item in everything] == said[::-1]
    assert [item.content[0].text for item in client.responses.input_items.list(r.id, order="asc", limit=100)] == said
    last = client.responses.input_items.list(r.id, order="asc", after=everything[1].id)
    assert [item.content[0].text for item in last] == said[-1:] and not last.has_more

    base = f"{null_live.url}/v1/responses/{r.id}/input_items"
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=msg_nope", "after"), ("include=message.input_image.image_url", "include"),
                         ("before=x", "before")):
        reply = httpx.get(f"{base}?{query}", headers={"Authorization": f"Bearer {API_KEY}"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, query
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


def test_the_api_key_and_the_body_limit_apply(null_live: LiveServer) -> None:
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x")):
        r = httpx.request(method, f"{null_live.url}{path}", json={"input": "Hi"}, timeout=30)
        assert r.status_code == 401, (method, path, r.text)
    r = httpx.post(f"{null_live.url}/v1/responses", json={"input": "x" * 40_000},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_turn_three_reuses_the_prefix_in_the_device_cache(null_live: LiveServer) -> None:
    client = null_client(null_live)
    one = client.responses.create(model="gemma-test", input="Hello, who are you?", temperature=0, max_output_tokens=4)
    two = client.responses.create(model="gemma-test", input="And what can you do?", previous_response_id=one.id,
                                  temperature=0, max_output_tokens=4)
    three = client.responses.create(model="gemma-test", input="Thanks.", previous_response_id=two.id,
                                    temperature=0, max_output_tokens=4)
    assert two.usage is not None and three.usage is not None
    # turn 2's whole prompt (and more) was still in the KV cache: only the new tail was prefilled
    assert three.usage.input_tokens_details.cached_tokens >= two.usage.input_tokens
    assert three.usage.input_tokens > two.usage.input_tokens


def test_the_plain_protocol_refuses_tools_and_thinking_naming_the_responses_fields(null_live: LiveServer) -> None:
    client = null_client(null_live)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="gemma-test", input="Hi", tools=[WEATHER_TOOL])  # type: ignore[list-item]
    assert caught.value.body["param"] == "tools"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="gemma-test", input="Hi", reasoning={"effort": "high"})
    assert caught.value.body["param"] == "reasoning.effort"  # type: ignore[index]


def test_a_device_error_after_the_headers_is_response_failed() -> None:
    config = settings()
    load, _ = slow_loader(null_host(), 0.0, fail_after=3)  # prefill + 2 decode calls work, then the device fails
    with live_server(config, build_engine(null_host(), config, load=load)) as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
        events = list(client.responses.create(model="gemma-test", input="Hi", temperature=0, max_output_tokens=20,
                                              stream=True))
        failed = events[-1]
        assert failed.type == "response.failed" and failed.response.status == "failed"
        assert failed.response.error is not None and "simulated device fault" in failed.response.error.message
        assert failed.response.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert failed.response.id not in live.app.state.response_store
        with pytest.raises(openai.InternalServerError) as caught:
            client.responses.create(model="gemma-test", input="Hi")
        assert caught.value.body["code"] == "generation_error"  # type: ignore[index]
        assert live.engine.state == "ok"


def test_the_readme_example_runs_as_written() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.DOTALL)
    (example,) = [block for block in blocks if "client.responses" in block]
    with live_server(settings()) as live:
        done = subprocess.run([sys.executable, "-c", example.replace("http://127.0.0.1:8080", live.url)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cached_tokens" in done.stdout and len(done.stdout.split()) > 10, done.stdout


def test_reasoning_summary_streams_as_openais_summary_events(client: OpenAI, script: Callable[[str], None]) -> None:
    script(THOUGHT)
    events = list(client.responses.create(model=MODEL, input="2+2?", stream=True,
                                          reasoning={"effort": "high", "summary": "detailed"}))
    final = events[-1].response
    thought = final.output[0]
    mine = [e for e in events if getattr(e, "item_id", None) == thought.id or
            (e.type.startswith("response.output_item.") and e.item.id == thought.id)]
    assert [e.type for e in mine if not e.type.endswith(".delta")] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_summary_part.added",
        "response.reasoning_text.done", "response.content_part.done",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done"]
    deltas = [e for e in mine if e.type.endswith(".delta")]
    # Each piece of thought goes out twice in a row: as the content's text, then as the summary's.
    assert [e.type for e in deltas] == ["response.reasoning_text.delta", "response.reasoning_summary_text.delta"] * (
        len(deltas) // 2)
    assert [e.delta for e in deltas[::2]] == [e.delta for e in deltas[1::2]]
    assert "".join(e.delta for e in deltas[1::2]) == "Let me see."
    (done,) = [e for e in mine if e.type == "response.reasoning_summary_text.done"]
    (part_done,) = [e for e in mine if e.type == "response.reasoning_summary_part.done"]
    assert done.text == part_done.part.text == "Let me see." and done.summary_index == 0
    assert [(p.type, p.text) for p in thought.summary] == [("summary_text", "Let me see.")]
    assert final.output_text == "It is 4."

    # The SDK's stream helper accumulates the same summary.
    with client.responses.stream(model=MODEL, input="2+2?", reasoning={"effort": "high", "summary": "auto"}) as stream:
        helper = stream.get_final_response()
    assert [p.text for p in helper.output[0].summary] == ["Let me see."]

