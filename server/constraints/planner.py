"""Planning a request's constraint: OpenAI's `response_format`, `tools`, `tool_choice` and `parallel_tool_calls` as one
`ConstraintSpec` value (or None), any grammar compiled once so that what cannot be enforced is the request's 400.

`response_format` json_object / json_schema: the schema's grammar (json_schema.py); `tool_choice` "required" or a
named function: the protocol's grammar of calls to the declared functions (`CallFormat.call_grammar`); "none": the
call-opening token banned; "auto" with `parallel_tool_calls: false`: free until the first call closes, then only a
stop id. Either grammar may follow a thought when thinking is on.

A tool whose string parameter carries a client grammar (a Responses `custom` tool with a `grammar` format,
server.constraints.client_grammar) has that grammar enforced whenever its call is written: under a forcing
tool_choice as part of the call grammar, and under "auto" too, where the output is free text (text tokens only) and
calls, each call's name free among the tools but a grammar tool's input held to its grammar from the call's start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from server.constraints.client_grammar import client_grammars, joined, lark_of
from server.constraints.constraint import BannedIds, ConstraintError, Grammar, StopAfter, function_of
from server.constraints.json_schema import json_grammar

if TYPE_CHECKING:
    from server.constraints.constraint import CallFormat, ConstraintSpec
    from server.constraints.vocab import GrammarVocab


def plan_constraint(vocab: GrammarVocab, calls: CallFormat | None, *,
                    response_format: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                    tool_choice: str | Mapping[str, Any] | None = None, parallel_tool_calls: bool = True,
                    thinking: bool = False) -> ConstraintSpec | None:
    """The request's constraint, or None when it has none. Raises ConstraintError (a 400) for what cannot be enforced.

    `calls`: the model's tool-call format (None: the model has none; tools on such a model are refused earlier, by
    the protocol). `thinking`: a thought channel may precede the constrained output. Compiles a grammar (milliseconds,
    bounded; cached for the matchers built from it later): call it off the event loop and the device thread.
    """
    fmt = (response_format or {}).get("type", "text")
    if fmt not in ("text", "json_object", "json_schema"):
        raise ConstraintError(f"response_format.type {fmt!r} is not supported", "response_format")
    choice = _tool_choice(tools, tool_choice)
    if fmt != "text" and choice in ("required", "named"):
        raise ConstraintError("response_format cannot be combined with a tool_choice that forces a call", "tool_choice")
    channel = calls.thought if thinking and calls is not None else None
    if fmt != "text":
        param = "response_format.json_schema.schema" if fmt == "json_schema" else "response_format"
        return _compiled(vocab, json_grammar(response_format or {}, vocab.limits), channel, param)
    graded = _checked_client_grammars(vocab, tools or ())
    if not tools or choice == "auto" and parallel_tool_calls and not graded:
        return None
    if calls is None:
        raise ConstraintError("tools: this model has no native tool-call format", "tools")
    if choice == "none":
        return BannedIds((vocab.token_id(calls.call_open),))
    if choice == "auto" and graded:  # free text, then calls; a grammar tool's input enforced once its call begins
        # The thought channel is allowed even with thinking off: free text was free to open it before.
        rules = calls.call_grammar(vocab, tools, None, loose=True) + "FREE: /(?s:.+)/\n"
        return _compiled(vocab, "FREE? (call FREE?)*" if parallel_tool_calls else "FREE? call?", calls.thought,
                         "tools", rules, tools)
    if choice == "auto":
        return StopAfter(vocab.token_id(calls.call_close))
    names = [tool_choice["function"]["name"]] if choice == "named" else None  # type: ignore[index]
    rules = calls.call_grammar(vocab, tools, names)
    return _compiled(vocab, "call+" if parallel_tool_calls else "call", channel, "tools", rules, tools)


def _with_thought(vocab: GrammarVocab, body: str, channel: tuple[str, str] | None) -> str:
    """A Lark start rule for `body`, optionally preceded by a thought in `channel` (opening, closing token texts)."""
    if channel is None:
        return f"start: {body}\n"
    opening, closing = channel
    return (f"start: thought? main\nmain: {body}\n"
            f'thought: {vocab.special(opening)} THOUGHT {vocab.special(closing)}\n'
            "THOUGHT: /(?s:.*)/\n")


def _compiled(vocab: GrammarVocab, body: str, channel: tuple[str, str] | None, param: str, rules: str = "",
              tools: Sequence[Mapping[str, Any]] = ()) -> Grammar:
    """The grammar of `body` (after a thought in `channel`, if given) as a value, compiled once now: what does not
    compile, or can never be satisfied, is the request's error naming `param`, not the engine's. With `tools`, the
    client grammars they carry join it as sub-grammars (a top-level grammar, server.constraints.client_grammar).

    With a thought channel the start state allows the thought's opening token whatever follows it, so the output
    after the thought is compiled alone too: its start state is where an unsatisfiable schema shows (vocab.compile)."""
    limit = vocab.limits.max_spec_chars
    lark = joined(_with_thought(vocab, body, channel) + rules, tools, limit)
    try:
        if channel is not None:
            vocab.compile(joined(_with_thought(vocab, body, None) + rules, tools, limit))
        vocab.compile(lark)
    except ConstraintError as exc:
        if exc.param is not None:
            raise
        raise ConstraintError(f"{param}: {exc.message}", param) from None
    return Grammar(lark)


def _checked_client_grammars(vocab: GrammarVocab, tools: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any tool carries a client grammar; each compiled alone first (before the call grammar that joins them),
    so that its mistakes and its size are named as its own."""
    found = False
    for i, spec in client_grammars(tools):
        where = f"tools[{i}].format.definition"
        try:
            vocab.compile(lark_of(spec, vocab.limits.max_spec_chars, where))
        except ConstraintError as exc:
            raise ConstraintError(exc.message if exc.param else f"{where}: {exc.message}", where) from None
        found = True
    return found


def _tool_choice(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ConstraintError(f"tool_choice {tool_choice!r} is not one of none, auto, required", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ConstraintError("tool_choice 'required' needs tools", "tool_choice")
        return tool_choice
    name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ConstraintError("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in {function_of(tool)["name"] for tool in tools or ()}:
        raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return "named"
