"""`/v1/responses` as Codex CLI (0.171.0, `codex exec`) uses it, against a live server on the tiny Gemma-4 with a context
that holds Codex's prompt, its output forced by the scripted graph where the test needs a given answer.

- Codex's own request bodies, captured from the real CLI (tests/data/agents/codex/, texts trimmed, shape kept; how:
  docs/api.md "Codex CLI"), sent as they are (the model name aside): each a 200 stream whose every event the `openai`
  SDK's pydantic types accept, numbered 0, 1, 2, ... with the response nested and ids that match the final output;
  the same body zstd-compressed.
- `custom` tools: Codex's real `apply_patch` (a Lark grammar): a call is a `custom_tool_call` item (raw `input`),
  streamed with OpenAI's custom_tool_call_input events; its `custom_tool_call_output` is read back into the prompt;
  the grammar is enforced (the call's input held to it, under "auto" and a forcing tool_choice: the constraint-level
  walks are in tests/test_constraints_client_grammar.py); an invalid grammar is a 400 naming it.
- The fields Codex sends (developer items, reasoning, store false, include, prompt_cache_key, text.verbosity,
  client_metadata, namespace / web_search / tool_search tools) and a `max_output_tokens: 1` probe.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard
from openai import OpenAI
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from server.app.runtime import Host, graph_loader
from tests.support import gemma4_app
from tests.support.api_fixtures import LiveServer
from tests.support.gemma4_app import MODEL, Prompts, gemma4_host, gemma4_server
from tests.test_responses import TurnScriptedGraph

DATA = Path(__file__).parent / "data" / "agents" / "codex"
FIRST_TURN = json.loads((DATA / "exec-first-turn.json").read_text())  # `codex exec "say hi"`'s first request
PATCH_RESULT = json.loads((DATA / "exec-apply-patch-result.json").read_text())  # after an apply_patch call ran
APPLY_PATCH = next(tool for tool in FIRST_TURN["tools"] if tool["type"] == "custom")
CONTEXT = 8192  # Codex's prompt (trimmed) in Gemma tokens, with room to answer
Q = '<|"|>'
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)

client, prompts, script = gemma4_app.client, gemma4_app.prompts, gemma4_app.script  # fixtures


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return gemma4_host(tmp_path_factory.mktemp("gemma4-codex"), max_total=CONTEXT)


@pytest.fixture(scope="module")
def graph(host: Host) -> TurnScriptedGraph:
    return TurnScriptedGraph(graph_loader(host)())


@pytest.fixture(scope="module")
def server(host: Host, graph: TurnScriptedGraph) -> Iterator[LiveServer]:
    with gemma4_server(host, graph) as live:
        yield live


def codex_body(body: dict[str, Any]) -> dict[str, Any]:
    return {**copy.deepcopy(body), "model": MODEL}  # Codex names an OpenAI model; this server serves one name


def stream_events(server: LiveServer, body: dict[str, Any], headers: dict[str, str] | None = None,
                  content: bytes | None = None) -> list[Any]:
    """The SSE stream of a Responses request, every event validated by the SDK's own event types."""
    events = []
    sent = {"content": content} if content is not None else {"json": body}
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=300,
                      headers={"Content-Type": "application/json", **(headers or {})}, **sent) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                payload = json.loads(line.removeprefix("data: "))
                assert payload["type"] == name  # the SSE event name is the payload's type
                events.append(EVENTS.validate_python(payload))
    return events


def check_strict(events: list[Any]) -> Any:
    """What Codex relies on: numbered from 0, the response nested in created / in_progress / completed, each
    item's events naming its id and index, the final output the items as their `output_item.done` had them."""
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert {event.response.id for event in (events[0], events[1], events[-1])} == {final.id}
    done = {event.output_index: event.item for event in events if event.type == "response.output_item.done"}
    assert [item.model_dump() for item in final.output] == [done[i].model_dump() for i in range(len(done))]
    added = {event.output_index: event.item.id for event in events if event.type == "response.output_item.added"}
    assert added == {i: item.id for i, item in enumerate(final.output)}
    for event in events:
        if hasattr(event, "item_id"):
            assert final.output[event.output_index].id == event.item_id, event
    return final


# ------------------------------------------------------------------ Codex's own requests


def test_codex_first_turn_is_a_strict_stream(server: LiveServer, prompts: Prompts,
                                             script: Callable[[str], None]) -> None:
    script("hi<turn|>")
    body = codex_body(FIRST_TURN)
    assert body["stream"] and "max_output_tokens" not in body and body["store"] is False
    final = check_strict(stream_events(server, body))
    assert final.status == "completed" and final.output_text == "hi"
    assert final.store is False and final.reasoning.effort == "medium" and final.text.verbosity == "low"
    text = server.host.tokenizer.decode(list(prompts.last))
    developer = FIRST_TURN["input"][0]["content"][0]["text"]
    assert developer[:120] in text  # the developer items are in the prompt
    for tool in FIRST_TURN["tools"]:  # every tool the model can call is offered; web_search and tool_search are not
        named = tool.get("name")
        if tool["type"] in ("function", "custom"):
            assert f"declaration:{named}" in text, named
    assert "declaration:tool_search" not in text and "web_search" not in text
    assert "*** Begin Patch" in text  # the custom tool's grammar is shown to the model
    # Not stored (store: false): nothing to retrieve.
    assert httpx.get(f"{server.url}/v1/responses/{final.id}", timeout=30).status_code == 404


def test_codex_first_turn_compressed_with_zstd(server: LiveServer, prompts: Prompts,
                                               script: Callable[[str], None]) -> None:
    script("hi<turn|>")
    body = codex_body(FIRST_TURN)
    final = check_strict(stream_events(server, body))
    plain = prompts.last
    packed = zstandard.ZstdCompressor().compress(json.dumps(body).encode())
    again = check_strict(stream_events(server, body, headers={"Content-Encoding": "zstd"}, content=packed))
    assert prompts.last == plain and again.output_text == final.output_text == "hi"


def test_codex_apply_patch_result_is_read_back(server: LiveServer, prompts: Prompts,
                                               script: Callable[[str], None]) -> None:
    script("Created hello.txt.<turn|>")
    final = check_strict(stream_events(server, codex_body(PATCH_RESULT)))
    assert final.output_text == "Created hello.txt."
    text = server.host.tokenizer.decode(list(prompts.last))
    call = next(item for item in PATCH_RESULT["input"] if item["type"] == "custom_tool_call")
    result = next(item for item in PATCH_RESULT["input"] if item["type"] == "custom_tool_call_output")
    assert "call:apply_patch{input:" in text and "+hello" in text  # the call, as the model writes one
    assert result["output"].splitlines()[-1] in text  # its output, as the tool's response
    assert call["call_id"] == result["call_id"]


# ------------------------------------------------------------------ custom tools


def test_a_custom_tool_call_is_a_custom_tool_call_item(server: LiveServer, client: OpenAI,
                                                       script: Callable[[str], None]) -> None:
    script(f"<|tool_call>call:apply_patch{{input:{Q}{PATCH}{Q}}}<tool_call|><|tool_response>")
    body = {"model": MODEL, "input": "Create hello.txt", "tools": [APPLY_PATCH], "stream": True}
    events = stream_events(server, body)
    final = check_strict(events)
    (call,) = final.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    assert call.call_id.startswith("call_") and call.id.startswith("ctc_")
    assert [event.type for event in events[2:]] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
    assert events[4].input == PATCH and final.tools[0].type == "custom"

    # Non-streamed through the SDK, then the call and its output sent back (stateless, as Codex does).
    r = client.responses.create(model=MODEL, input="Create hello.txt", tools=[APPLY_PATCH])  # type: ignore[list-item]
    assert r.output[0].type == "custom_tool_call" and r.output[0].input == PATCH  # type: ignore[union-attr]
    script("Done.<turn|>")
    second = client.responses.create(model=MODEL, tools=[APPLY_PATCH], input=[  # type: ignore[list-item]
        {"role": "user", "content": "Create hello.txt"}, r.output[0].model_dump(exclude_none=True),  # type: ignore[list-item]
        {"type": "custom_tool_call_output", "call_id": r.output[0].call_id, "output": "Success. A hello.txt"}])  # type: ignore[union-attr]
    assert second.output_text == "Done."


def test_a_forced_custom_tool_holds_its_input_to_the_grammar(server: LiveServer, client: OpenAI,
                                                             script: Callable[[str], None]) -> None:
    """The script writes text that is no patch; under tool_choice naming apply_patch the grammar does not let it:
    every token the model could take outside the grammar is masked, so the input begins as the grammar says."""
    script(f"<|tool_call>call:apply_patch{{input:{Q}rm -rf /{Q}}}<tool_call|><|tool_response>")
    r = client.responses.create(model=MODEL, input="Patch it", tools=[APPLY_PATCH],  # type: ignore[list-item]
                                tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=40,
                                temperature=1.0)
    assert "rm -rf" not in json.dumps(r.model_dump())
    assert r.status == "incomplete"  # held to the grammar, the random model has not finished a patch in 40 tokens


def test_a_regex_custom_tool_and_a_free_text_one(server: LiveServer, client: OpenAI,
                                                 script: Callable[[str], None]) -> None:
    tools = [{"type": "custom", "name": "set_flag", "description": "Set a flag.",
              "format": {"type": "grammar", "syntax": "regex", "definition": "(on|off)"}},
             {"type": "custom", "name": "note", "description": "Write a note."}]
    script(f"<|tool_call>call:set_flag{{input:{Q}on{Q}}}<tool_call|><|tool_response>")
    r = client.responses.create(model=MODEL, input="Flag on", tools=tools)  # type: ignore[arg-type]
    assert [(item.type, item.input) for item in r.output] == [("custom_tool_call", "on")]  # type: ignore[union-attr]
    script(f"<|tool_call>call:note{{input:{Q}any text, even {{braces}}{Q}}}<tool_call|><|tool_response>")
    r = client.responses.create(model=MODEL, input="Note", tools=tools)  # type: ignore[arg-type]
    assert [(item.type, item.input) for item in r.output] == [  # type: ignore[union-attr]
        ("custom_tool_call", "any text, even {braces}")]


def test_an_invalid_or_oversized_grammar_is_a_400_naming_it(server: LiveServer) -> None:
    cases = [
        {"type": "grammar", "syntax": "lark", "definition": "start: undefined_rule\n"},
        {"type": "grammar", "syntax": "lark", "definition": "start: \"a\" ) (\n"},
        {"type": "grammar", "syntax": "regex", "definition": "(unclosed"},
        {"type": "grammar", "syntax": "lark", "definition": "start: " + " | ".join(f'"{i}"' for i in range(20000))},
        {"type": "grammar", "syntax": "ebnf", "definition": "x"},
    ]
    for fmt in cases:
        tool = {"type": "custom", "name": "t", "format": fmt}
        r = httpx.post(f"{server.url}/v1/responses", timeout=120,
                       json={"model": MODEL, "input": "Hi", "tools": [tool], "max_output_tokens": 1})
        assert r.status_code == 400, (fmt["definition"][:40], r.text)
        assert r.json()["error"]["param"].startswith("tools[0]"), r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------ the fields Codex sends


def test_codex_fields_are_accepted_and_honoured(server: LiveServer, client: OpenAI, prompts: Prompts,
                                                script: Callable[[str], None]) -> None:
    script("hi<turn|>")
    r = client.responses.create(
        model=MODEL, instructions="Be brief.",
        input=[{"role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
               {"role": "user", "content": "say hi"}],
        reasoning={"effort": "low", "summary": "auto"}, store=False, include=["reasoning.encrypted_content"],
        prompt_cache_key="session-1", parallel_tool_calls=True, text={"verbosity": "low", "format": {"type": "text"}},
        extra_body={"client_metadata": {"session_id": "s"}})
    assert r.output_text == "hi" and r.store is False and r.reasoning.effort == "low"  # type: ignore[union-attr]
    assert r.text.verbosity == "low"  # type: ignore[union-attr]
    text = server.host.tokenizer.decode(list(prompts.last))
    assert text.index("Be brief.") < text.index("You are Codex.") < text.index("say hi")
    # The probe Codex-style clients send: one token, answered as a cut.
    probe = client.responses.create(model=MODEL, input="ping", max_output_tokens=1)
    assert probe.status == "incomplete" and probe.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert probe.usage is not None and probe.usage.output_tokens == 1


def test_a_namespaced_tool_call_names_its_namespace(server: LiveServer, client: OpenAI,
                                                    script: Callable[[str], None]) -> None:
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]}}]}
    script(f"<|tool_call>call:close_agent{{target:{Q}a1{Q}}}<tool_call|><|tool_response>")
    r = client.responses.create(model=MODEL, input="Close a1", tools=[namespace,  # type: ignore[list-item]
                                                                       {"type": "web_search"}])
    (call,) = r.output
    assert call.type == "function_call" and call.name == "close_agent" and call.namespace == "multi_agent_v1"
    assert json.loads(call.arguments) == {"target": "a1"}


def test_refusals_still_name_their_field(server: LiveServer) -> None:
    cases = [({"tools": [{"type": "file_search"}]}, "tools"),
             ({"tools": [{"type": "tool_search", "execution": "server"}]}, "tools"),
             ({"include": ["message.output_text.logprobs"]}, "include"),
             ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]}, "input")]
    for fields, param in cases:
        r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi", **fields}, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        assert re.match(re.escape(param), r.json()["error"]["param"] or ""), (fields, r.text)
