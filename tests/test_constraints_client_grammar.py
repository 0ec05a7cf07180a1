"""A client's grammar for a tool's input (server.constraints.client_grammar), enforced through the planner with the real
Gemma tokenizer and llguidance: Codex CLI's real `apply_patch` Lark grammar (captured from `codex exec`,
tests/data/agents/codex/) as a custom tool's one string argument, under tool_choice "auto" (free text, then calls: the
grammar holds once that tool's call begins; other tools' calls stay free) and forced; a regex grammar; bounds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from server.constraints.client_grammar import GRAMMAR_KEY, unmarked
from server.constraints.constraint import ConstraintError, Grammar, allowed_ids, build_matcher
from server.constraints.planner import plan_constraint
from server.constraints.vocab import ConstraintLimits, GrammarVocab
from server.model.tokenizer import HostTokenizer
from server.protocol.gemma4_grammar import GEMMA4_CALLS
from tests import test_constraints
from tests.support.gemma4_tokenizer import GEMMA4_TOKENS, STOP_IDS
from tests.test_constraints import V

tokenizer, vocab = test_constraints.tokenizer, test_constraints.vocab  # the module fixtures

CODEX = json.loads((Path(__file__).parent / "data" / "agents" / "codex" / "exec-first-turn.json").read_text())
LARK = next(tool for tool in CODEX["tools"] if tool["type"] == "custom")["format"]["definition"]
Q = '<|"|>'
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return 1\n+    return 2\n*** End Patch\n"


def custom(name: str, syntax: str, definition: str) -> dict[str, Any]:
    """A custom tool as the Responses translation makes it (server.api.responses.translate.chat_tool)."""
    field = {"type": "string", GRAMMAR_KEY: {"syntax": syntax, "definition": definition}}
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"input": field}, "required": ["input"]}}}


SHELL = {"type": "function", "function": {"name": "exec_command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}},
    "required": ["cmd"]}}}
TOOLS = [SHELL, custom("apply_patch", "lark", LARK)]


def ids_of(tokenizer: HostTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(vocab: GrammarVocab, spec: Any, ids: list[int]) -> tuple[int, bool]:
    """How many of `ids` the constraint accepts in a row, and whether a stop is then allowed."""
    matcher = build_matcher(vocab, spec)
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    for i, token in enumerate(ids):
        matcher.fill_mask(mask)
        if token not in set(allowed_ids(mask, V).tolist()):
            return i, False
        assert matcher.accept(token)
    matcher.fill_mask(mask)
    return len(ids), bool(set(allowed_ids(mask, V).tolist()) & set(STOP_IDS))


def call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


def test_auto_lets_text_and_free_calls_through_and_holds_a_patch_to_its_grammar(vocab, tokenizer) -> None:
    spec = plan_constraint(vocab, GEMMA4_CALLS, tools=TOOLS, tool_choice="auto")
    assert isinstance(spec, Grammar)
    good = [
        "Just text, no call at all.",
        "Let me look." + call("exec_command", f"cmd:{Q}ls -la{Q},yield_time_ms:1000"),
        call("exec_command", f"zzz:{Q}keys the schema does not know{Q}"),  # "auto": another tool's call is free
        "Patching." + call("apply_patch", f"input:{Q}{PATCH}{Q}"),
        call("apply_patch", f"input:{Q}{PATCH}{Q}") + call("exec_command", f"cmd:{Q}pytest{Q}"),
    ]
    for text in good:
        ids = ids_of(tokenizer, text)
        assert run(vocab, spec, ids) == (len(ids), True), text
    for bad in ("*** Begin Patch\nrm -rf /\n", "not a patch", "*** Begin Patch\n*** End Patch\n"):  # hunk+ needed
        text = call("apply_patch", f"input:{Q}{bad}{Q}")
        ids = ids_of(tokenizer, text)
        accepted, _ = run(vocab, spec, ids)
        assert accepted < len(ids), bad
        assert tokenizer.decode(ids[:accepted]).startswith("<|tool_call>call:apply_patch{input:")  # held in the input


def test_forced_custom_tool_and_parallel_calls_off(vocab, tokenizer) -> None:
    named = plan_constraint(vocab, GEMMA4_CALLS, tools=TOOLS,
                            tool_choice={"type": "function", "function": {"name": "apply_patch"}})
    ids = ids_of(tokenizer, call("apply_patch", f"input:{Q}{PATCH}{Q}"))
    assert run(vocab, named, ids) == (len(ids), True)
    assert run(vocab, named, ids_of(tokenizer, "Text first."))[0] == 0  # forced: the call comes first
    assert run(vocab, named, ids_of(tokenizer, call("exec_command", f"cmd:{Q}ls{Q}")))[0] < 5
    single = plan_constraint(vocab, GEMMA4_CALLS, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    two = ids_of(tokenizer, call("apply_patch", f"input:{Q}{PATCH}{Q}") * 2)
    accepted, _ = run(vocab, single, two)
    assert accepted == len(two) // 2  # one call, then only a stop


def test_a_regex_grammar_and_the_thought_channel(vocab, tokenizer) -> None:
    tools = [custom("set_flag", "regex", "(on|off)/[0-9]{1,3}")]
    spec = plan_constraint(vocab, GEMMA4_CALLS, tools=tools, tool_choice="auto", thinking=True)
    for value, ok in (("on/12", True), ("off/7", True), ("maybe", False), ("on/1234", False)):
        text = "<|channel>thought\nA flag.<channel|>" + call("set_flag", f"input:{Q}{value}{Q}")
        ids = ids_of(tokenizer, text)
        assert (run(vocab, spec, ids) == (len(ids), True)) is ok, value


def test_bad_grammars_are_named_errors(vocab) -> None:
    cases = {"start: undefined_rule\n": "tools[1].format.definition", "start: (\n": "tools[1].format.definition"}
    for definition, param in cases.items():
        with pytest.raises(ConstraintError) as caught:
            plan_constraint(vocab, GEMMA4_CALLS, tools=[SHELL, custom("t", "lark", definition)], tool_choice="auto")
        assert caught.value.param == param, caught.value.message
    small = GrammarVocab(vocab.tokenizer, lambda text: GEMMA4_TOKENS.get(text), V, STOP_IDS,
                         ConstraintLimits(max_spec_chars=100))
    with pytest.raises(ConstraintError) as caught:
        plan_constraint(small, GEMMA4_CALLS, tools=[custom("t", "lark", LARK)], tool_choice="auto")
    assert caught.value.param == "tools[0].format.definition" and "limit is 100" in caught.value.message
    with pytest.raises(ConstraintError) as caught:  # fuel-bounded: a grammar too large to compile is refused
        huge = "start: " + " | ".join(f'"w{i}"' for i in range(60_000))
        tiny_fuel = GrammarVocab(vocab.tokenizer, lambda text: GEMMA4_TOKENS.get(text), V, STOP_IDS,
                                 ConstraintLimits(max_spec_chars=10**7, grammar_size=20_000))
        plan_constraint(tiny_fuel, GEMMA4_CALLS, tools=[custom("t", "lark", huge)], tool_choice="auto")
    assert caught.value.param == "tools[0].format.definition"


def test_the_prompt_declares_a_grammar_tool_without_its_grammar_key() -> None:
    declared = unmarked(TOOLS[1])
    assert GRAMMAR_KEY not in json.dumps(declared) and GRAMMAR_KEY in json.dumps(TOOLS[1])
    assert declared["function"]["parameters"]["required"] == ["input"]
    assert unmarked(SHELL) is SHELL
