"""A client's grammar for a tool's freeform input (the Responses API's `custom` tools with a `grammar` format): where it
rides in a function schema (`GRAMMAR_KEY` on a string property), its name as a sub-grammar (`grammar_name`), its text as
llguidance reads it (`lark_of`), and the top-level grammar that joins the server's call grammar with the clients' ones
(`joined`).

Why sub-grammars: llguidance compiles several named grammars as one (`{"grammars": [...]}`, referenced as `@name` from
a rule), each with its own rule names and lexer, so a client's Lark (Codex's `apply_patch` uses `start`, `%import
common.LF`, ...) is used as written: no renaming, no textual merging. Its work is bounded like any grammar's: its
text by `ConstraintLimits.max_spec_chars`, its compile by the vocabulary's fuel limits (server.constraints.vocab).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from server.constraints.constraint import ConstraintError

# The key of a string property's schema that carries {"syntax": "lark" | "regex", "definition": text}: set by the
# Responses translation (server.api.responses.translate), read by a protocol's call grammar and by the planner.
GRAMMAR_KEY = "x-grammar"
SYNTAXES = ("lark", "regex")


def grammar_name(spec: Mapping[str, Any]) -> str:
    """The sub-grammar's name: from its content, so the same grammar sent twice is one sub-grammar (and one cache entry)."""
    digest = hashlib.sha256(f"{spec.get('syntax')}\0{spec.get('definition')}".encode()).hexdigest()
    return f"client_{digest[:16]}"


def lark_of(spec: Mapping[str, Any], max_chars: int, where: str) -> str:
    """The grammar as llguidance Lark; ConstraintError (naming `where`) when it is not one we take."""
    syntax, definition = spec.get("syntax"), spec.get("definition")
    if syntax not in SYNTAXES or not isinstance(definition, str):
        raise ConstraintError(f"{where}: a grammar needs syntax 'lark' or 'regex' and a definition string", where)
    if len(definition) > max_chars:
        raise ConstraintError(f"{where}: the grammar is {len(definition)} characters; the limit is {max_chars}", where)
    if not definition.strip():
        raise ConstraintError(f"{where}: the grammar is empty", where)
    if syntax == "lark":
        return definition
    return "start: /" + definition.replace("\\/", "/").replace("/", "\\/") + "/\n"


def client_grammars(tools: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(tool index, grammar spec) for every string property of a tool's top-level parameters that carries one."""
    for i, tool in enumerate(tools):
        function = tool.get("function")
        parameters = function.get("parameters") if isinstance(function, Mapping) else None
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        for schema in (properties or {}).values():
            if isinstance(schema, Mapping) and isinstance(schema.get(GRAMMAR_KEY), Mapping):
                yield i, schema[GRAMMAR_KEY]


def unmarked(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """`tool` without the grammars it carries, as the prompt declares it: the grammar is for the engine (the tool's
    description shows it to the model, server.api.responses.translate.chat_tool), not a schema keyword to render."""
    if not any(True for _ in client_grammars([tool])):
        return tool
    function = dict(tool["function"])
    parameters = dict(function["parameters"])
    parameters["properties"] = {key: {k: v for k, v in schema.items() if k != GRAMMAR_KEY}
                                if isinstance(schema, Mapping) else schema
                                for key, schema in parameters["properties"].items()}
    function["parameters"] = parameters
    return {**tool, "function": function}


def joined(lark: str, tools: Sequence[Mapping[str, Any]], max_chars: int) -> str:
    """`lark` alone when no tool carries a grammar, else the top-level grammar of `lark` and each client grammar under
    its `grammar_name` (what `@name` in `lark` refers to)."""
    subs: dict[str, str] = {}
    for i, spec in client_grammars(tools):
        subs.setdefault(grammar_name(spec), lark_of(spec, max_chars, f"tools[{i}].format.definition"))
    if not subs:
        return lark
    return json.dumps({"grammars": [{"lark_grammar": lark},
                                    *({"name": name, "lark_grammar": text} for name, text in subs.items())]})
