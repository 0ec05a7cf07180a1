"""The thinking budget (issue 26), one mechanism for every route: when the thought reaches its budget, the sampler
forces the protocol's closing marker and the answer follows.

- The matcher alone (`BudgetedThought`): what it counts, a marker of several tokens forced in order, a thought the
  model closes itself, a second thought after the budget is spent, the wrapped constraint advanced with every token.
- Served: the tiny random Gemma-4, made to think (`ThinkingGraph`: its first tokens open the thought channel as
  Gemma-4 does, `<|channel>thought\\n`, and it never closes the channel nor stops on its own, as a random model would
  not), through the real engine on a two-slot graph: exactly N tokens inside the channel, then `<channel|>`, then
  the answer; usage counts it all and max_tokens bounds it all; chat and Responses (`reasoning.effort`), streamed and
  not; --reasoning-budget as the server's default, a request's value over it, an effort's budget over it; with a
  JSON-schema or tool-call grammar after the thought; two budgets side by side in one decode batch; invalid values
  are 400s.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anthropic
import httpx
import jsonschema
import numpy as np
import pytest
import torch

from server.app.runtime import Host, graph_loader
from server.config import Settings, add_options
from server.constraints.constraint import Constraint, StopAfterCall, allowed_ids
from server.constraints.thought import BudgetedThought, ThoughtBudget
from server.protocol.base import EFFORT_BUDGETS, reasoning_budget
from tests.support.api_fixtures import LiveServer, WrappedGraph, live_server, settings
from tests.support.gemma4_app import MODEL, chat_chunks, gemma4_host, gemma4_server
from tests.support.gemma4_tokenizer import GEMMA4_TOKENS

MAX_TOTAL = 640  # room for the "minimal" effort's 512-token budget and an answer after it
SERVER_BUDGET = 6  # the live server's --reasoning-budget
OPEN, CLOSE = GEMMA4_TOKENS["<|channel>"], GEMMA4_TOKENS["<channel|>"]
HI = [{"role": "user", "content": "Hi"}]
THINK = {"chat_template_kwargs": {"enable_thinking": True}}

# --------------------------------------------------------------------- the matcher alone

V = 256
WORDS = (V + 31) // 32


class Recorder(Constraint):
    """A wrapped constraint that allows everything but `banned` and records what it was advanced with."""

    def __init__(self, banned: int | None = None) -> None:
        self.seen: list[int] = []
        self.banned = banned

    def fill_mask(self, bitmask: np.ndarray) -> None:
        bitmask[:] = -1
        if self.banned is not None:
            bitmask[self.banned // 32] &= ~np.int32(1 << (self.banned % 32))

    def accept(self, token_id: int) -> bool:
        self.seen.append(token_id)
        return token_id != self.banned


def allowed(matcher: Constraint) -> list[int]:
    bits = np.zeros(WORDS, dtype=np.int32)
    matcher.fill_mask(bits)
    return allowed_ids(bits, V).tolist()


def run(matcher: Constraint, tokens: Sequence[int]) -> list[bool]:
    """Which steps were forced (one token allowed), feeding `tokens` where free and the forced token where not."""
    forced, fed = [], list(tokens)
    while fed:
        options = allowed(matcher)
        forced.append(len(options) == 1)
        token = options[0] if len(options) == 1 else fed.pop(0)
        assert matcher.accept(token)
    return forced


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_budget_counts_the_tokens_inside_the_channel_then_forces_its_marker(budget: int) -> None:
    matcher = BudgetedThought(ThoughtBudget((9,), (7, 8), budget), None, WORDS)  # a two-token closing marker
    assert matcher.free and not matcher.is_finished
    steps = run(matcher, [5, 9] + [20] * budget + [30, 31])
    # 5, the opening 9, `budget` thought tokens, then 7 and 8 forced in order, then the answer (30, 31) free again.
    assert steps == [False, False] + [False] * budget + [True, True, False, False]
    assert matcher.free


def test_a_thought_the_model_closes_itself_leaves_the_rest_for_the_next_one() -> None:
    matcher = BudgetedThought(ThoughtBudget((9,), (7,), 4), None, WORDS)
    # One thought token, closed by the model; an answer token; a second thought gets the 3 tokens left.
    assert run(matcher, [9, 1, 7, 2, 9, 1, 1, 1]) == [False] * 8
    assert not matcher.free and allowed(matcher) == [7]  # spent: the closing marker now
    assert run(matcher, [3, 9]) == [True, False, False]  # and a later thought closes as soon as it opens
    assert allowed(matcher) == [7]


def test_the_wrapped_constraint_decides_free_steps_and_sees_every_token() -> None:
    inner = Recorder(banned=3)
    matcher = BudgetedThought(ThoughtBudget((9,), (7,), 1), inner, WORDS)
    assert not matcher.free  # the inner constraint masks
    assert 3 not in allowed(matcher)
    run(matcher, [9, 1, 2])
    assert inner.seen == [9, 1, 7, 2]  # the forced marker too
    assert not matcher.accept(3)  # the inner constraint's refusal is the matcher's
    stop_after = BudgetedThought(ThoughtBudget((9,), (7,), 0), StopAfterCall(4, [0], WORDS), WORDS)
    run(stop_after, [9, 4])
    assert stop_after.is_finished and allowed(stop_after) == [0]


def test_precedence_of_the_budgets() -> None:
    assert reasoning_budget(None, None, -1) == -1 and reasoning_budget(None, None, 6) == 6
    assert reasoning_budget(5, "high", 6) == 5 and reasoning_budget(-1, "low", 6) == -1
    assert reasoning_budget(None, "low", 6) == EFFORT_BUDGETS["low"] == 1024
    assert reasoning_budget(None, "none", 6) == -1  # thinking off: nothing to cap
    assert list(EFFORT_BUDGETS) == ["minimal", "low", "medium", "high", "xhigh"]
    assert list(EFFORT_BUDGETS.values()) == sorted(EFFORT_BUDGETS.values())


# --------------------------------------------------------------------- served


class ThinkingGraph(WrappedGraph):
    """The tiny random Gemma-4 (protocol v3, several slots) made to think: a generation's first tokens are `forced`
    (the channel opening and its name line), and afterwards the `suppressed` ids (every marker and stop id) are pushed
    far down but kept finite, so the model never closes the thought, opens another or stops on its own, and a forced
    marker can still be drawn. Everything else is the random model's own logits."""

    def __init__(self, inner: Any, forced: Sequence[int], suppressed: Sequence[int]) -> None:
        super().__init__(inner, "thinking")
        self.slots, self.decode_batches, self.prefill_buckets = inner.slots, inner.decode_batches, inner.prefill_buckets
        self.forced = list(forced)
        self.suppressed = torch.tensor(sorted(set(suppressed)))
        self.starts = [0] * inner.slots  # per slot: its prompt's length, the first generated token's position
        self.batches: list[int] = []  # rows of each decode call

    def _steer(self, row: torch.Tensor, position: int, slot: int) -> torch.Tensor:
        """The logits [V] at input `position` of `slot`: those of the generation's token number position+1-start."""
        index = position + 1 - self.starts[slot]
        if 0 <= index < len(self.forced):
            forced = torch.full_like(row, -20.0)
            forced[self.forced[index]] = 20.0
            return forced
        return row.index_fill(0, self.suppressed, -1e4)

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        logits = self.inner.prefill(embeds, positions, slot, last_only=last_only, on_submit=on_submit).clone()  # [1, T, V]
        self.starts[slot] = int(positions[0, -1]) + 1
        logits[0, -1] = self._steer(logits[0, -1], int(positions[0, -1]), slot)
        return logits

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        logits = self.inner.decode(embeds, positions, slots, on_submit=on_submit)  # [B, V]
        self.batches.append(len(slots))
        return torch.stack([self._steer(logits[b], int(positions[b, 0]), slot) for b, slot in enumerate(slots)])

    def rewind_slot(self, slot: int, position: int) -> int:
        return self.inner.rewind_slot(slot, position)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return gemma4_host(tmp_path_factory.mktemp("thinking"), max_total=MAX_TOTAL)


@pytest.fixture(scope="module")
def header(host: Host) -> list[int]:
    """Gemma-4's channel name line, `thought\\n`: the first tokens inside the channel (they count)."""
    return host.tokenizer.encode("thought\n", add_special_tokens=False)


@pytest.fixture(scope="module")
def graph(host: Host, header: list[int]) -> ThinkingGraph:
    return ThinkingGraph(graph_loader(host, Settings(max_batch=2))(), [OPEN, *header],
                         [*GEMMA4_TOKENS.values(), *host.stop_token_ids])


@pytest.fixture(scope="module")
def server(host: Host, graph: ThinkingGraph) -> Iterator[LiveServer]:
    config = settings(served_model_name=MODEL, reasoning_budget=SERVER_BUDGET)
    with gemma4_server(host, graph, config, prefix_reuse=False, wait_grammar=False) as live:
        yield live


def chat(server: LiveServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": HI, **body}, timeout=120)


def answer(server: LiveServer, **body: Any) -> dict[str, Any]:
    r = chat(server, temperature=0.0, logprobs=True, **body)
    assert r.status_code == 200, r.text
    return r.json()


def thought_of(tokens: Sequence[str]) -> int | None:
    """How many tokens the thought channel held (between its markers), None if it never closed; asserts the shape:
    the opening first, at most one closing, and no marker elsewhere."""
    assert tokens[0] == "<|channel>" and "<|channel>" not in tokens[1:]
    assert tokens.count("<channel|>") <= 1
    return tokens.index("<channel|>") - 1 if "<channel|>" in tokens else None


def tokens_of(body: dict[str, Any]) -> list[str]:
    return [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]


def stream_chat(server: LiveServer, **body: Any) -> dict[str, Any]:
    """The stream gathered: reasoning, content, the tokens (from the logprobs), finish_reason and usage."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "tokens": [], "finish_reason": None, "usage": None}
    for chunk in chat_chunks(server, {"model": MODEL, "messages": HI, "stream": True, "stream_options": {
            "include_usage": True}, "temperature": 0.0, "logprobs": True, **body}):
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            out["reasoning"] += choice["delta"].get("reasoning_content") or ""
            out["content"] += choice["delta"].get("content") or ""
            out["tokens"] += [entry["token"] for entry in (choice.get("logprobs") or {}).get("content") or ()]
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


@pytest.mark.parametrize("budget", [0, 2, 9])
def test_a_budget_of_n_closes_the_thought_after_n_tokens_and_the_answer_follows(server: LiveServer, header: list[int],
                                                                                budget: int) -> None:
    body = answer(server, max_tokens=30, reasoning_budget=budget, **THINK)
    tokens = tokens_of(body)
    assert thought_of(tokens) == budget
    message = body["choices"][0]["message"]
    assert message["content"] and "<channel|>" not in message["content"]  # the answer, after the marker
    assert body["usage"]["completion_tokens"] == len(tokens) == 30  # thought, marker and answer: max_tokens bounds all
    assert body["choices"][0]["finish_reason"] == "length"
    if budget > len(header):  # the name line is inside the channel: what follows it is the reasoning
        assert message["reasoning_content"] == "".join(tokens[1 + len(header):1 + budget])
    else:
        assert not message.get("reasoning_content")

    streamed = stream_chat(server, max_tokens=30, reasoning_budget=budget, **THINK)
    assert streamed["tokens"] == tokens  # greedy: the same tokens, the same budget
    assert streamed["reasoning"] == (message.get("reasoning_content") or "")
    assert streamed["content"] == message["content"]
    assert streamed["finish_reason"] == "length" and streamed["usage"]["completion_tokens"] == 30


def test_the_server_default_applies_and_a_request_overrides_it(server: LiveServer) -> None:
    assert thought_of(tokens_of(answer(server, max_tokens=20, **THINK))) == SERVER_BUDGET
    assert thought_of(tokens_of(answer(server, max_tokens=20, reasoning_budget=3, **THINK))) == 3
    assert thought_of(tokens_of(answer(server, max_tokens=20, reasoning_budget=-1, **THINK))) is None  # unlimited
    # An effort's budget comes before the server's default: "high" (24,576) leaves this thought uncut.
    assert thought_of(tokens_of(answer(server, max_tokens=20, reasoning_effort="high"))) is None
    assert thought_of(tokens_of(answer(server, max_tokens=20, reasoning_effort="high", reasoning_budget=4))) == 4


def test_max_tokens_below_the_budget_cuts_the_thought(server: LiveServer) -> None:
    body = answer(server, max_tokens=5, reasoning_budget=50, **THINK)
    assert thought_of(tokens_of(body)) is None and body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


def test_an_effort_budget_ends_the_thought_on_the_responses_api(server: LiveServer, header: list[int]) -> None:
    budget = EFFORT_BUDGETS["minimal"]
    total = budget + 8
    r = httpx.post(f"{server.url}/v1/responses", timeout=300, json={
        "model": MODEL, "input": "Hi", "reasoning": {"effort": "minimal"}, "max_output_tokens": total,
        "temperature": 0.0, "store": False})
    assert r.status_code == 200, r.text
    response = r.json()
    reasoning, message = (next(item for item in response["output"] if item["type"] == kind)
                          for kind in ("reasoning", "message"))
    assert reasoning["content"][0]["text"] and message["content"][0]["text"]  # a thought, then the answer
    assert response["usage"]["output_tokens"] == total
    # The thought: the opening, the `budget` tokens inside (the name line among them), the closing; then the answer.
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 1 + budget + 1

    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=300, json={
            "model": MODEL, "input": "Hi", "reasoning": {"effort": "minimal"}, "max_output_tokens": total,
            "temperature": 0.0, "store": False, "stream": True}) as stream:
        assert stream.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in stream.iter_lines() if line.startswith("data: ")]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, text) == (reasoning["content"][0]["text"], message["content"][0]["text"])
    done = next(e for e in events if e["type"] == "response.completed" or e["type"] == "response.incomplete")
    assert done["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 1 + budget + 1


def test_thinking_budget_tokens_ends_the_thought_on_the_messages_api(server: LiveServer) -> None:
    """The official `anthropic` SDK, unmodified: `thinking.budget_tokens` is the same budget as chat's
    `reasoning_budget` (the same greedy thought, cut at the same token), streamed as thinking_delta events."""
    budget = 7
    reference = answer(server, max_tokens=24, reasoning_budget=budget, **THINK)
    assert thought_of(tokens_of(reference)) == budget
    message = reference["choices"][0]["message"]
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    fields: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "messages": HI,
                              "thinking": {"type": "enabled", "budget_tokens": budget},
                              "extra_body": {"temperature": 0.0}}
    reply = client.messages.create(**fields)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == message["reasoning_content"]  # the thought, cut where chat's was
    assert reply.content[1].text == message["content"]  # and the answer after it
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 24  # the budget counts in max_tokens

    with client.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == message["reasoning_content"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == message["content"]
    assert [block.type for block in final.content] == ["thinking", "text"]

    # adaptive: thinking on with no budget of its own, so the server's --reasoning-budget applies, as on chat
    adaptive = client.messages.create(**{**fields, "thinking": {"type": "adaptive"}})
    default = answer(server, max_tokens=24, **THINK)
    assert thought_of(tokens_of(default)) == SERVER_BUDGET
    assert adaptive.content[0].thinking == default["choices"][0]["message"]["reasoning_content"]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def grammar(server: LiveServer) -> None:
    server.app.state.grammar.wait(600)  # the grammar vocabulary: once per module (13-60 s)


@pytest.mark.parametrize("seed", range(2))
def test_the_budget_composes_with_a_json_schema_after_the_thought(server: LiveServer, grammar: None, seed: int) -> None:
    r = chat(server, max_tokens=120, reasoning_budget=5, temperature=1.0, seed=seed, logprobs=True,
             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, **THINK)
    assert r.status_code == 200, r.text
    body = r.json()
    assert thought_of(tokens_of(body)) == 5
    if body["choices"][0]["finish_reason"] == "stop":  # else a long string ran out of tokens: still a prefix
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize("seed", range(2))
def test_the_budget_composes_with_a_forced_tool_call(server: LiveServer, grammar: None, seed: int) -> None:
    r = chat(server, max_tokens=150, reasoning_budget=4, temperature=1.0, seed=seed, logprobs=True, tools=[WEATHER],
             tool_choice="required", parallel_tool_calls=False, **THINK)
    assert r.status_code == 200, r.text
    body = r.json()
    assert thought_of(tokens_of(body)) == 4
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = body["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_two_budgets_side_by_side_in_one_decode_batch(server: LiveServer, graph: ThinkingGraph) -> None:
    graph.batches.clear()
    results: dict[int, dict[str, Any]] = {}

    def one(budget: int) -> None:
        results[budget] = answer(server, max_tokens=40, reasoning_budget=budget, **THINK)

    threads = [threading.Thread(target=one, args=(budget,)) for budget in (3, 11)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 2 in graph.batches  # they ran in one batch...
    for budget, body in results.items():  # ...each with its own budget
        assert thought_of(tokens_of(body)) == budget
        assert body["usage"]["completion_tokens"] == 40


@pytest.mark.parametrize("value", [-2, 1.5, "many", [3]])
def test_an_invalid_budget_is_a_400_naming_it(server: LiveServer, value: Any) -> None:
    r = chat(server, reasoning_budget=value, **THINK)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "reasoning_budget"


def test_a_budget_with_thinking_off_is_no_error(server: LiveServer) -> None:
    # Thinking off: no budget is attached (the prompt ends with an empty thought channel). This stand-in still opens a
    # channel, and nothing closes it: nothing was forced.
    body = answer(server, max_tokens=6, reasoning_budget=2)
    assert body["usage"]["completion_tokens"] == 6
    assert thought_of(tokens_of(body)) is None


def test_a_model_without_a_thought_channel_has_nothing_to_cap() -> None:
    with live_server(settings(reasoning_budget=3)) as live:  # the Gemma-3 demo on the null graph: no thought channel
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                       json={"messages": HI, "max_tokens": 4, "reasoning_budget": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4


def test_the_flag_and_its_environment_variable() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_options(parser)
    assert Settings.from_cli(parser.parse_args(["--reasoning-budget", "0"]), {}).reasoning_budget == 0
    assert Settings.from_cli(parser.parse_args([]), {"REASONING_BUDGET": "128"}).reasoning_budget == 128
    assert Settings.from_cli(parser.parse_args([]), {}).reasoning_budget == -1  # unlimited
    with pytest.raises(ValueError, match="REASONING_BUDGET"):
        Settings.from_cli(parser.parse_args([]), {"REASONING_BUDGET": "-2"})
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--reasoning-budget", "-2"])
