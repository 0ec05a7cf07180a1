"""The Messages API as coding agents use it (issue 33): Claude Code 2.1.332's own requests, captured from the real CLI
(tests/data/agents/claude-code/), answered 200; system turns inside `messages`; context-management edits and their
`applied_edits`; `thinking.display: "updates"`; deferred tools; glob model names; the overflow wording agents act on;
count_tokens equal to usage; the billing-header block kept out of the prompt; `ping` keep-alives while a prompt is
prefilled, and a disconnect that frees the row.

The tiny random Gemma-4 with an 8k context, prefilled in 512-token chunks (the captured requests are trimmed to fit:
their texts and tool descriptions cut, their shape kept; Claude Code's whole first prompt is ~9.4k Gemma tokens), its
output scripted where a test needs an answer; a gate holds its prefill for the keep-alive tests.
"""

from __future__ import annotations

import copy
import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import torch

from server.app.runtime import Host, graph_loader, load_host
from server.config import served_as, served_names
from server.errors import context_overflow
from tests.support import gemma4_app
from tests.support.api_fixtures import LiveServer, settings
from tests.support.gemma4_app import Prompts, gemma4_server
from tests.support.gemma4_tokenizer import gemma4_cfg_dir
from tests.support.models import tiny_gemma4_checkpoint
from tests.support.wait import wait_until
from tests.test_responses import TurnScriptedGraph

MODEL = "gemma4-tiny"
SERVED = f"{MODEL},claude-*,gpt-*"
MAX_TOTAL = 8192
FIXTURES = Path(__file__).parent / "data" / "agents" / "claude-code"
CAPTURED = sorted(FIXTURES.glob("*.json"))
PROMPT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                 "context_management")
READ_TOOL = {"name": "Read", "description": "Reads a file.", "input_schema": {
    "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}
GREP_TOOL = {"name": "Grep", "description": "Searches files.", "input_schema": {
    "type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}


class GatedGraph(TurnScriptedGraph):
    """The scripted graph whose calls wait for `gate` (set: they run at once); counts the calls it ran."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a chunk is held at the gate
        self.chunks = 0

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(60)
        self.chunks += 1
        return super().forward(embeds, positions, **kwargs)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    from server.tools.export import export

    root = tmp_path_factory.mktemp("gemma4-16k")
    checkpoint = tiny_gemma4_checkpoint(root / "checkpoint")
    artifacts = export(checkpoint, root / "artifacts", prefill_bucket=512, max_total=MAX_TOTAL, dtype="float32")
    cfg, source = artifacts / "cfg", gemma4_cfg_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copyfile(source / name, cfg / name)
    (cfg / "special_tokens_map.json").unlink(missing_ok=True)
    return load_host(artifacts, "hf", SERVED)


@pytest.fixture(scope="module")
def graph(host: Host) -> GatedGraph:
    return GatedGraph(graph_loader(host)())


@pytest.fixture(scope="module")
def server(host: Host, graph: GatedGraph) -> Iterator[LiveServer]:
    with gemma4_server(host, graph, settings(served_model_name=SERVED, sse_ping_s=0.2), wait_grammar=False) as live:
        yield live


@pytest.fixture(scope="module")
def prompts(server: LiveServer) -> Prompts:
    return server.prompts  # type: ignore[attr-defined, no-any-return]


script = gemma4_app.script  # a fixture (by assignment, as gemma4_app's docstring says): it drives `graph` below


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def post(server: LiveServer, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)


def events(raw: str) -> list[dict[str, Any]]:
    """A raw Messages stream's events (keep-alive comments skipped), each checked to be named by its type."""
    found = []
    for block in raw.strip().split("\n\n"):
        if block.startswith(":"):
            continue
        name, data = block.split("\n")
        found.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {found[-1]['type']}", block
    return found


def counted(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    r = post(server, "/v1/messages/count_tokens?beta=true", {k: v for k, v in body.items() if k in PROMPT_FIELDS})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def created(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    r = post(server, "/v1/messages?beta=true", {"max_tokens": 4, **body, "stream": False},
             **{"anthropic-beta": "context-management-2025-06-27"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def prompt_tokens(message: dict[str, Any]) -> int:
    return int(message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"])


def text_of(host: Host, ids: tuple[int, ...]) -> str:
    return str(host.tokenizer.decode(list(ids)))


# ------------------------------------------------------------------ Claude Code's own requests


@pytest.mark.parametrize("path", CAPTURED, ids=[p.stem for p in CAPTURED])
def test_claude_codes_captured_requests_are_answered(server: LiveServer, prompts: Prompts, host: Host, path: Path,
                                                     script: Callable[[str], None]) -> None:
    """As Claude Code sent them (`?beta=true`, its betas, max_tokens 128000, adaptive thinking shown "omitted",
    `context_management`, a trailing system turn with its own output_config, a deferred tool): 200, in order."""
    captured = json.loads(path.read_text())
    script("Hello.<turn|>")
    r = httpx.post(f"{server.url}{captured['path']}", json=captured["body"], headers=captured["headers"], timeout=600)
    assert r.status_code == 200, r.text
    stream = events(r.text)
    assert [e["type"] for e in stream][0] == "message_start" and stream[-1]["type"] == "message_stop"
    assert stream[0]["message"]["model"] == MODEL
    delta = next(e for e in stream if e["type"] == "message_delta")
    assert delta["context_management"] == {"applied_edits": []}  # keep: "all" clears nothing
    assert delta["usage"]["output_tokens"] >= 1 and delta["delta"]["stop_reason"] == "end_turn"
    assert prompt_tokens({"usage": delta["usage"]}) == counted(server, captured["body"])["input_tokens"]
    rendered = text_of(host, prompts.last)
    assert "x-anthropic-billing-header" not in rendered  # left out of the prompt
    assert "# Environment" in rendered.split("<|turn>user")[-1]  # the trailing system turn, after the user's
    assert "DeferredToolPlaceholder" not in rendered and "ToolSearch" in rendered


# ------------------------------------------------------------------ system turns


def test_system_turns_anywhere_render_in_place(server: LiveServer, prompts: Prompts, host: Host,
                                               script: Callable[[str], None]) -> None:
    script("Yes.<turn|>")
    body = {"model": MODEL, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Reminder: today is Tuesday."}, {"role": "user", "content": "Day?"},
        {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}],
         "output_config": {"effort": "low"}}]}
    message = created(server, body)
    rendered = text_of(host, prompts.last)
    assert rendered.index("Hello.") < rendered.index("Reminder: today is Tuesday.") < rendered.index("Day?")
    assert rendered.index("Day?") < rendered.index("Answer in one word.")
    assert rendered.endswith("<|turn>model\n")  # the generation prompt follows the trailing system turn
    assert [b["text"] for b in message["content"]] == ["Yes."]
    # the chat route renders the same turns the same way: the Messages route is the chat path
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "reasoning_effort": "low",
                                                 "messages": [{"role": "system", "content": "Be brief."},
                                                              *[{"role": m["role"], "content": m["content"] if isinstance(
                                                                  m["content"], str) else m["content"][0]["text"]}
                                                                for m in body["messages"]]]})
    assert chat.status_code == 200 and text_of(host, prompts.last) == rendered


def test_system_turns_alone_or_an_assistant_last_are_refused(server: LiveServer) -> None:
    alone = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4,
                                          "messages": [{"role": "system", "content": "Hi"}]})
    assert alone.status_code == 400 and "no user message" in alone.json()["error"]["message"]
    last = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"},
        {"role": "system", "content": "Go on."}]})
    assert last.status_code == 400 and "the last message must be the user's" in last.json()["error"]["message"]
    per_turn = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi", "output_config": {"format": {"type": "json_schema", "schema": {}}}}]})
    assert per_turn.status_code == 400 and "format" in per_turn.json()["error"]["message"]


def test_the_billing_header_block_is_left_out_so_invocations_share_the_prefix(
        client: anthropic.Anthropic, prompts: Prompts, script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    system = [{"type": "text", "text": "You are an agent. " * 40}]
    for cch in ("cc_version=2.1.332.9a2; cc_entrypoint=sdk-cli; cch=1a2b3;", "cc_version=2.1.332.28c; cch=9f8e7;"):
        client.messages.create(model="claude-opus-5-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                               system=[{"type": "text", "text": f"x-anthropic-billing-header: {cch}"}, *system],
                               tools=[READ_TOOL])  # type: ignore[list-item]
    client.messages.create(model="claude-opus-5-5", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                           system=system, tools=[READ_TOOL])  # type: ignore[arg-type]
    first, second, without = prompts.ids[-3:]
    # The whole prompt is shared, system prompt and tools included: the engine's cache can reuse all of it (whether
    # it does is the cache's: the tiny model's sliding window, wrapped, cannot rewind past its decoded tokens).
    assert first == second == without


# ------------------------------------------------------------------ context management


def tool_loop(thoughts: bool = True) -> list[dict[str, Any]]:
    """A user's question, then three Read round trips (each turn with a thought): all after the last user text."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read the three files."}]
    for i in range(3):
        turn: list[dict[str, Any]] = [{"type": "thinking", "thinking": f"I will read file {i}.", "signature": ""}] \
            if thoughts else []
        name = "Grep" if i == 1 else "Read"
        args = {"pattern": "x"} if name == "Grep" else {"file_path": f"/tmp/file{i}.txt"}
        messages.append({"role": "assistant", "content": [*turn, {"type": "tool_use", "id": f"toolu_{i}",
                                                                  "name": name, "input": args}]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                      "content": f"contents of file {i}: " + "lorem ipsum " * 30}]})
    return messages


def edited_body(edits: list[dict[str, Any]], messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"model": MODEL, "tools": [READ_TOOL, GREP_TOOL], "thinking": {"type": "adaptive"},
            "messages": messages or tool_loop(), "context_management": {"edits": edits}}


def test_clear_thinking_keeps_the_last_turns_thoughts(server: LiveServer, prompts: Prompts, host: Host,
                                                      script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    body = edited_body([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}])
    message = created(server, body)
    rendered = text_of(host, prompts.last)
    assert "I will read file 2." in rendered and "I will read file 0." not in rendered
    assert "I will read file 1." not in rendered
    by_hand = copy.deepcopy(body)
    del by_hand["context_management"]
    for turn in by_hand["messages"][1:4:2]:
        turn["content"] = turn["content"][1:]
    unedited = counted(server, {**body, "context_management": None})["input_tokens"]
    applied = message["context_management"]["applied_edits"]
    assert applied == [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 2,
                        "cleared_input_tokens": unedited - prompt_tokens(message)}]
    assert applied[0]["cleared_input_tokens"] > 0
    assert prompt_tokens(message) == counted(server, by_hand)["input_tokens"] == counted(server, body)["input_tokens"]
    assert counted(server, body)["context_management"] == {"original_input_tokens": unedited}
    keep_all = created(server, edited_body([{"type": "clear_thinking_20251015", "keep": "all"}]))
    assert keep_all["context_management"] == {"applied_edits": []} and prompt_tokens(keep_all) == unedited


def test_clear_tool_uses_clears_the_oldest_results_and_inputs(server: LiveServer, prompts: Prompts, host: Host,
                                                              script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    unedited = counted(server, edited_body([]))["input_tokens"]
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["Read"]}
    message = created(server, edited_body([edit]))
    rendered = text_of(host, prompts.last)
    assert "contents of file 0" not in rendered and "contents of file 1" not in rendered  # cleared
    assert "contents of file 2" in rendered  # the last use is kept
    assert rendered.count("cleared to save context") == 2
    assert "/tmp/file0.txt" not in rendered and "/tmp/file2.txt" in rendered  # Read's input cleared, not the kept one's
    assert message["context_management"]["applied_edits"] == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2,
         "cleared_input_tokens": unedited - prompt_tokens(message)}]
    assert prompt_tokens(message) == counted(server, edited_body([edit]))["input_tokens"]
    # exclude_tools keeps Grep's; with every input cleared
    excluded = created(server, edited_body([{**edit, "exclude_tools": ["Grep"], "clear_tool_inputs": True}]))
    rendered = text_of(host, prompts.last)
    assert "contents of file 1" in rendered and "contents of file 0" not in rendered
    assert excluded["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 1


@pytest.mark.parametrize("edit", [
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100_000}},  # not reached
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3}},  # 3 uses: not more than 3
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
     "clear_at_least": {"type": "input_tokens", "value": 100_000}},  # would clear too little
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses",
                                                                                                 "value": 3}},
], ids=["below-trigger", "below-tool-uses", "below-clear-at-least", "keeps-all"])
def test_an_edit_that_clears_nothing_is_not_applied(server: LiveServer, edit: dict[str, Any],
                                                    script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    message = created(server, edited_body([edit]))
    assert message["context_management"] == {"applied_edits": []}
    assert prompt_tokens(message) == counted(server, edited_body([]))["input_tokens"]


def test_both_edits_stream_their_applied_edits(server: LiveServer, script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    body = edited_body([{"type": "clear_thinking_20251015"},
                        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
                         "keep": {"type": "tool_uses", "value": 1}}])
    r = post(server, "/v1/messages", {**body, "max_tokens": 4, "stream": True})
    stream = events(r.text)
    applied = stream[0]["message"]["context_management"]["applied_edits"]
    assert [e["type"] for e in applied] == ["clear_thinking_20251015", "clear_tool_uses_20250919"]
    assert applied[0]["cleared_thinking_turns"] == 2 and applied[1]["cleared_tool_uses"] == 2
    delta = next(e for e in stream if e["type"] == "message_delta")
    assert delta["context_management"] == stream[0]["message"]["context_management"]
    assert prompt_tokens({"usage": delta["usage"]}) == counted(server, body)["input_tokens"]


@pytest.mark.parametrize(("edits", "named"), [
    ([{"type": "compact_20260112"}], "compact_20260112"),
    ([{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}, "extra": 1}], "extra"),
    ([{"type": "clear_tool_uses_20250919", "trigger": {"type": "messages", "value": 3}}], "trigger"),
])
def test_unknown_edits_are_refused_naming_them(server: LiveServer, edits: list[dict[str, Any]], named: str) -> None:
    r = post(server, "/v1/messages", {**edited_body(edits), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "context_management" in r.json()["error"]["message"] and named in r.json()["error"]["message"]


# ------------------------------------------------------------------ thinking, tools, limits


def test_thinking_display_updates_hides_the_thought(server: LiveServer, script: Callable[[str], None]) -> None:
    script("<|channel>thought\nLet me see.<channel|>It is 4.<turn|>")
    for display, shown in (("updates", ""), ("omitted", ""), ("summarized", "Let me see.")):
        message = created(server, {"model": MODEL, "max_tokens": 64, "thinking": {"type": "adaptive",
                                                                                  "display": display},
                                   "output_config": {"effort": "high"}, "metadata": {"user_id": "someone"},
                                   "messages": [{"role": "user", "content": "2+2?"}]})
        assert [(b["type"], b.get("thinking", b.get("text"))) for b in message["content"]] == [
            ("thinking", shown), ("text", "It is 4.")], display


def test_deferred_tools_join_the_prompt_once_surfaced(server: LiveServer, prompts: Prompts, host: Host,
                                                      script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    deferred = {**GREP_TOOL, "defer_loading": True}
    created(server, {"model": MODEL, "tools": [READ_TOOL, deferred], "messages": [{"role": "user", "content": "Hi"}]})
    assert "Searches files." not in text_of(host, prompts.last)
    found = json.dumps({"description": GREP_TOOL["description"], "name": "Grep",
                        "parameters": GREP_TOOL["input_schema"]})
    messages = [{"role": "user", "content": "Find x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s", "name": "Read",
                                                   "input": {"file_path": "a"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s",
                                              "content": f"<functions><function>{found}</function></functions>"}]}]
    created(server, {"model": MODEL, "tools": [READ_TOOL, deferred], "messages": messages})
    assert text_of(host, prompts.last).count("Searches files.") == 2  # declared now (and in the result's text)


@pytest.mark.parametrize("kind", ["tool_search_tool_regex_20251119", "tool_search_tool_bm25_20251119"])
def test_anthropics_tool_search_tools_are_refused_by_name(server: LiveServer, kind: str) -> None:
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                                      "tools": [{"type": kind, "name": "tool_search"}]})
    assert r.status_code == 400 and kind in r.json()["error"]["message"]
    assert "defer_loading" in r.json()["error"]["message"]


def test_a_huge_max_tokens_is_capped_by_what_the_context_leaves(server: LiveServer,
                                                                 script: Callable[[str], None]) -> None:
    script("Hi.<turn|>")
    for limit in (32_000, 128_000):
        message = created(server, {"model": MODEL, "max_tokens": limit, "messages": [{"role": "user", "content": "Hi"}]})
        assert message["stop_reason"] == "end_turn"


def test_a_prompt_longer_than_the_context_is_refused_in_the_words_agents_act_on(server: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "lorem ipsum " * 5000}]}
    tokens = counted(server, body)["input_tokens"]
    assert tokens > MAX_TOTAL
    r = post(server, "/v1/messages?beta=true", {**body, "max_tokens": 32_000, "stream": True})
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_request_error", "message": f"prompt is too long: {tokens} tokens > {MAX_TOTAL - 1} maximum"}
    chat = post(server, "/v1/chat/completions", {"model": "gpt-5", "messages": body["messages"], "max_tokens": 4})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    completion = post(server, "/v1/completions", {"model": MODEL, "prompt": [2] * MAX_TOTAL, "max_tokens": 4})
    assert completion.status_code == 400 and completion.json()["error"]["code"] == "context_length_exceeded"
    assert completion.json()["error"]["message"].startswith(f"This model's maximum context length is {MAX_TOTAL}")


def test_the_longest_prompt_leaves_one_token_to_generate() -> None:
    assert context_overflow(MAX_TOTAL - 1, MAX_TOTAL, "messages") is None
    overflow = context_overflow(MAX_TOTAL, MAX_TOTAL, "messages")
    assert overflow is not None and overflow.anthropic_message == f"prompt is too long: {MAX_TOTAL} tokens > " \
        f"{MAX_TOTAL - 1} maximum"


# ------------------------------------------------------------------ count_tokens is the prompt


@pytest.mark.parametrize("case", ["tools", "round-trip", "thinking", "system-turns", "edits"])
def test_count_tokens_is_the_requests_input_tokens(server: LiveServer, case: str,
                                                   script: Callable[[str], None]) -> None:
    script("Done.<turn|>")
    bodies = {
        "tools": {"model": MODEL, "tools": [READ_TOOL, GREP_TOOL], "messages": [{"role": "user", "content": "Hi"}]},
        "round-trip": edited_body([], tool_loop(thoughts=False)),
        "thinking": edited_body([]),
        "system-turns": {"model": MODEL, "system": "S.", "messages": [
            {"role": "user", "content": "Hi"}, {"role": "system", "content": "Mid."}, {"role": "assistant",
                                                                                        "content": "Yo."},
            {"role": "user", "content": "Go"}, {"role": "system", "content": "Last."}]},
        "edits": edited_body([{"type": "clear_thinking_20251015"},
                              {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
                               "keep": {"type": "tool_uses", "value": 1}}]),
    }
    body = bodies[case]
    assert counted(server, body)["input_tokens"] == prompt_tokens(created(server, body))


# ------------------------------------------------------------------ model names


def test_glob_aliases_reach_the_served_model(client: anthropic.Anthropic, server: LiveServer,
                                             script: Callable[[str], None]) -> None:
    script("Hi.<turn|>")
    for name in ("claude-opus-5-5", "claude-haiku-5-5", "claude-sonnet-4-5-20250929"):
        m = client.messages.create(model=name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert m.model == MODEL and m.content[0].type == "text"  # answered under the served id, as aliases are
    chat = post(server, "/v1/chat/completions", {"model": "gpt-5.5-codex", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == MODEL
    assert [card["id"] for card in httpx.get(f"{server.url}/v1/models").json()["data"]] == [MODEL]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="llama-3", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert httpx.get(f"{server.url}/v1/models/claude-haiku-5-5").json()["root"] == MODEL


def test_glob_names_are_checked_at_start() -> None:
    assert served_names(SERVED) == (MODEL, "claude-*", "gpt-*")
    assert served_as("claude-opus-5-5", served_names(SERVED)) and not served_as("Claude-opus", served_names(SERVED))
    assert served_as(MODEL, (MODEL,)) and not served_as("gemma4-tin?", (MODEL,))  # a request's name is no glob
    with pytest.raises(ValueError, match="cannot be a glob"):
        served_names("claude-*,gemma4")


# ------------------------------------------------------------------ keep-alive and disconnects


def long_body(words: int = 200) -> dict[str, Any]:
    return {"model": "claude-opus-5-5", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "lorem ipsum " * words}]}


def test_message_start_at_once_and_pings_while_the_prompt_waits(server: LiveServer, graph: GatedGraph,
                                                                script: Callable[[str], None]) -> None:
    script("Hi.<turn|>")
    graph.waiting.clear()
    graph.gate.clear()
    seen: list[str] = []
    try:
        with httpx.stream("POST", f"{server.url}/v1/messages", json=long_body(), timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: "):
                    seen.append(line.removeprefix("event: "))
                if seen.count("ping") == 3 and not graph.gate.is_set():  # pings while a call is held
                    assert seen[0] == "message_start" and graph.waiting.is_set()
                    graph.gate.set()
            assert graph.gate.is_set(), f"the stream ended with the gate closed: {seen}"
            assert seen[-1] == "message_stop" and "content_block_start" in seen
    finally:
        graph.gate.set()


def test_a_disconnect_during_prefill_cancels_the_work(host: Host) -> None:
    # A server of its own: on the module's, an earlier test's leftovers (a cached prefix, a row still winding down)
    # could decide whether this request's chunks reach the gate at all.
    graph = GatedGraph(graph_loader(host)())
    with gemma4_server(host, graph, settings(served_model_name=SERVED, sse_ping_s=0.2), wait_grammar=False) as server:
        graph.gate.clear()
        try:
            with httpx.stream("POST", f"{server.url}/v1/messages", json=long_body(600), timeout=120) as r:
                assert r.status_code == 200, r.read()
                assert next(r.iter_lines()) == "event: message_start"
                wait_until(graph.waiting.is_set, "a call of the request's to be held", 60)
                chunks = graph.chunks
            wait_until(lambda: any(h.cancelled.is_set() for h in server.engine.in_flight())
                       or not server.engine.in_flight(), "the server to cancel the request of the client that left", 30)
        finally:
            graph.gate.set()
        wait_until(lambda: server.engine.admitted == 0 and server.engine.running == 0, "the row to be freed", 60)
        assert graph.chunks - chunks <= 1  # the held call, and none of the prompt's other chunks, nor a decode
