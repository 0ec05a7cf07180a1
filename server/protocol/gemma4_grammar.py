"""Gemma-4's tool calls as a grammar, what the constraint planner enforces under a forced `tool_choice`: `GEMMA4_CALLS`
is the protocol's `CallFormat`, its arguments written by `GemmaGrammar` (a bounded JSON-schema converter)."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from server.constraints.client_grammar import GRAMMAR_KEY, client_grammars, grammar_name
from server.constraints.constraint import ConstraintError, function_of
from server.protocol.base import TOOL_NAME_RULE, is_tool_name
from server.protocol.gemma4 import CALL_CLOSE, CALL_OPEN, CHANNEL_CLOSE, CHANNEL_OPEN, QUOTE

if TYPE_CHECKING:
    from server.constraints.vocab import ConstraintLimits, GrammarVocab


def tool_call_grammar(vocab: GrammarVocab, tools: Sequence[Mapping[str, Any]], names: Collection[str] | None, *,
                      loose: bool = False) -> str:
    """Lark rules defining `call`: `<|tool_call>call:NAME{args}<tool_call|>`, NAME among `names` (all tools when None),
    args valid for NAME's JSON schema in Gemma's syntax. A string property carrying a client grammar (GRAMMAR_KEY) is
    that grammar, referenced as a sub-grammar (server.constraints.client_grammar). `loose`: only the tools carrying a
    client grammar have their arguments enforced; any other tool's are any object (tool_choice "auto": its calls
    were never schema-enforced, and a call must stay as free as it was)."""
    graded = {i for i, _ in client_grammars(tools)}
    limits = vocab.limits
    if len(tools) > limits.max_tools:
        raise ConstraintError(f"{len(tools)} tools; the limit is {limits.max_tools}", "tools")
    if sum(len(json.dumps(function_of(tool).get("parameters") or {})) for tool in tools) > limits.max_spec_chars:
        raise ConstraintError(f"the tools' parameter schemas exceed {limits.max_spec_chars} characters", "tools")
    builder = GemmaGrammar(vocab.special(QUOTE), limits)
    alternatives = []
    for i, tool in enumerate(tools):
        function = function_of(tool)
        if names is not None and function["name"] not in names:
            continue
        if not is_tool_name(function["name"]):
            raise ConstraintError(f"tools[{i}].function.name {function['name'][:80]!r} cannot be written in Gemma's "
                                  f"call syntax: a name is {TOOL_NAME_RULE}", f"tools[{i}].function.name")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        args = (builder.any_object() if loose and i not in graded
                else builder.arguments(parameters, f"tools[{i}].function.parameters"))
        alternatives.append(f"{_literal(function['name'])} {args}")
    call = f"call: {vocab.special(CALL_OPEN)} \"call:\" ({' | '.join(alternatives)}) {vocab.special(CALL_CLOSE)}"
    return call + "\n" + "\n".join(builder.rules) + "\n"


class Gemma4Calls:
    """Gemma-4's `CallFormat` (server.constraints.constraint)."""

    call_open = CALL_OPEN
    call_close = CALL_CLOSE
    thought = (CHANNEL_OPEN, CHANNEL_CLOSE)
    call_grammar = staticmethod(tool_call_grammar)


GEMMA4_CALLS = Gemma4Calls()


def _literal(text: str) -> str:
    return json.dumps(text)


_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                          "readOnly", "writeOnly", "strict"})
_BY_TYPE = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "string": {"type", "enum", "const", "minLength", "maxLength", GRAMMAR_KEY},
    "integer": {"type", "enum", "const"},
    "number": {"type", "enum", "const"},
    "boolean": {"type", "enum", "const"},
    "null": {"type"},
    "array": {"type", "items", "minItems", "maxItems"},
}
_INTEGER = r"/-?(0|[1-9][0-9]{0,17})/"
# Exponents of two digits at most: every number the grammar allows is a finite float (no "Infinity" in JSON).
_NUMBER = r"/-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,2})?/"
_KEY = re.compile(r"[^\s:{}\[\],<>\"|]+")
_SCALARS = {"integer": _INTEGER, "number": _NUMBER, "boolean": '"true" | "false"', "null": '"null"'}  # Lark bodies


class GemmaGrammar:
    """A JSON schema as Lark rules for Gemma's argument syntax (`{key:<|"|>text<|"|>,n:42,flag:true}`).

    Bounded on purpose: the keywords in `_BY_TYPE` (plus annotations, `enum`/`const`, `anyOf`, a `type` list and
    local `$ref`s into `$defs`, inlined up to `max_depth`); anything else raises ConstraintError naming the keyword.
    Object keys come in sorted order (as the chat template writes arguments), required ones always, optional ones
    maybe; extra keys are never produced (valid under any `additionalProperties`).
    """

    def __init__(self, quote: str, limits: ConstraintLimits) -> None:
        self.quote = quote
        self.limits = limits
        self.rules: list[str] = []
        self._properties = 0
        self._root: Mapping[str, Any] = {}
        self._memo: dict[str, str] = {}

    def arguments(self, schema: Mapping[str, Any], where: str) -> str:
        self._root, self._properties = schema, 0
        if _types(schema, where) != ["object"]:
            raise ConstraintError(f"{where}: a function's parameters must be an object schema", where)
        return self._value(schema, where, 0)

    def _rule(self, body: str) -> str:
        if body in self._memo:
            return self._memo[body]
        name = f"g{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        self._memo[body] = name
        return name

    def _terminal(self, regex_body: str) -> str:
        name = f"G{len(self.rules)}"
        self.rules.append(f"{name}: {regex_body}")
        return name

    def _value(self, schema: Mapping[str, Any] | bool, where: str, depth: int) -> str:
        if depth > self.limits.max_depth:
            raise ConstraintError(f"{where}: nested deeper than {self.limits.max_depth} levels", where)
        if schema is True or schema == {}:
            return self._any(depth)
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"{where}: not a schema", where)
        if "$ref" in schema:
            return self._value(self._resolve(schema, where), where, depth + 1)
        if "anyOf" in schema:
            rest = {key: value for key, value in schema.items() if key != "anyOf"}
            _check_keys(rest, set(), where)
            return self._rule(" | ".join(self._value(option, f"{where}.anyOf[{i}]", depth + 1)
                                         for i, option in enumerate(schema["anyOf"])))
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            _check_keys(schema, {"type", "enum", "const"}, where)
            if not isinstance(values, list) or not values:
                raise ConstraintError(f"{where}.enum must be a non-empty list", where)
            return self._rule(" | ".join(self._constant(value, where) for value in values))
        kinds = _types(schema, where)
        _check_keys(schema, set().union(*(_BY_TYPE[kind] for kind in kinds)), where)
        alternatives = [self._typed(kind, schema, where, depth) for kind in kinds]
        return alternatives[0] if len(alternatives) == 1 else self._rule(" | ".join(alternatives))

    def _typed(self, kind: str, schema: Mapping[str, Any], where: str, depth: int) -> str:
        if kind in _SCALARS:
            return self._rule(_SCALARS[kind])
        if kind == "string":
            return self._string(schema, where)
        if kind == "array":
            return self._array(schema, where, depth)
        return self._object(schema, where, depth)

    def _string(self, schema: Mapping[str, Any], where: str) -> str:
        if isinstance(schema.get(GRAMMAR_KEY), Mapping):  # a client's grammar: the text between the quotes is its
            return self._rule(f"{self.quote} @{grammar_name(schema[GRAMMAR_KEY])} {self.quote}")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ConstraintError(f"{where}: bad minLength/maxLength", where)
        if max(low, high or 0) > self.limits.max_string_length:
            raise ConstraintError(f"{where}: string lengths above {self.limits.max_string_length} are not supported", where)
        repeat = "*" if low == 0 and high is None else f"{{{low},{'' if high is None else high}}}"
        # Text tokens only (special tokens never match a regex), and never the characters of the delimiter's text.
        terminal = self._terminal(f"/(?s:.{repeat})/ & ~/(?s:.*<\\|\"\\|>.*)/")
        return self._rule(f"{self.quote} {terminal} {self.quote}")

    def _constant(self, value: Any, where: str) -> str:
        if isinstance(value, str):
            if QUOTE in value:
                raise ConstraintError(f"{where}: enum strings cannot contain {QUOTE}", where)
            return f"{self.quote} {_literal(value)} {self.quote}" if value else f"{self.quote} {self.quote}"
        if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
            return _literal(json.dumps(value))
        raise ConstraintError(f"{where}: only scalar enum/const values are supported", where)

    def _array(self, schema: Mapping[str, Any], where: str, depth: int) -> str:
        item = self._value(schema.get("items", {}), f"{where}.items", depth + 1)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ConstraintError(f"{where}: bad minItems/maxItems", where)
        if high == 0:
            return self._rule('"[" "]"')
        more_low = max(low - 1, 0)
        if high is None:
            more = " ".join([f'"," {item}'] * more_low + [f'("," {item})*'])
        else:
            more = f'("," {item}){{{more_low},{high - 1}}}'
        body = f'"[" {item} {more} "]"'
        return self._rule(body if low > 0 else f'{body} | "[" "]"')

    def _object(self, schema: Mapping[str, Any], where: str, depth: int) -> str:
        properties = schema.get("properties") or {}
        required = schema.get("required") or []
        if not isinstance(properties, Mapping) or not isinstance(required, list):
            raise ConstraintError(f"{where}: properties must be an object and required a list", where)
        missing = [key for key in required if key not in properties]
        if missing:
            raise ConstraintError(f"{where}: required {missing} are not among the properties", where)
        self._properties += len(properties)
        if self._properties > self.limits.max_properties:
            raise ConstraintError(f"{where}: more than {self.limits.max_properties} properties", where)
        members = []
        for key in sorted(properties):
            if not _KEY.fullmatch(key):
                raise ConstraintError(f"{where}: property name {key!r} cannot be written in Gemma's syntax", where)
            value = self._value(properties[key], f"{where}.properties.{key}", depth + 1)
            members.append((self._rule(f"{_literal(key + ':')} {value}"), key in required))
        # tail[i, first]: members i.. in order, a comma before each but the first written, optional ones maybe left
        # out; as (expression matching the non-empty ways, or None; whether nothing at all is also allowed).
        tail: dict[tuple[int, bool], tuple[str | None, bool]] = {}
        for i in range(len(members), -1, -1):
            for first in (True, False):
                if i == len(members):
                    tail[i, first] = (None, True)
                    continue
                member, needed = members[i]
                written = " ".join(part for part in ("" if first else '","', member, _ref(tail[i + 1, False])) if part)
                if needed:
                    tail[i, first] = (self._rule(written), False)
                else:
                    skip, skip_empty = tail[i + 1, first]
                    tail[i, first] = (self._rule(" | ".join(f"({alt})" for alt in (written, skip) if alt)), skip_empty)
        return self._rule(" ".join(part for part in ('"{"', _ref(tail[0, True]), '"}"') if part))

    def any_object(self) -> str:
        """Any arguments object in Gemma's syntax (keys as the parser reads them, values any JSON)."""
        member = self._rule(f'{self._terminal("/" + _KEY.pattern + "/")} ":" {self._any(1)}')
        return self._rule(f'"{{" ({member} ("," {member})*)? "}}"')

    def _any(self, depth: int) -> str:
        """Any JSON value in Gemma's syntax, nested at most max_depth - depth levels more."""
        levels = self.limits.max_depth - depth
        value = self._rule(f'{self._string({}, "")} | {self._rule(_NUMBER)} | "true" | "false" | "null"')
        key = self._terminal(r"/[A-Za-z_][A-Za-z0-9_]{0,63}/")
        for _ in range(max(levels, 0)):
            member = self._rule(f'{key} ":" {value}')
            value = self._rule(f'{value} | "{{" ({member} ("," {member})*)? "}}" | "[" ({value} ("," {value})*)? "]"')
        return value

    def _resolve(self, schema: Mapping[str, Any], where: str) -> Mapping[str, Any]:
        ref = schema["$ref"]
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        if match is None or len(schema) > 1 + len(set(schema) & _ANNOTATIONS):
            raise ConstraintError(f"{where}: only a plain local $ref into $defs is supported", where)
        target = (self._root.get(match.group(1)) or {}).get(match.group(2))
        if not isinstance(target, Mapping):
            raise ConstraintError(f"{where}: $ref {ref!r} does not resolve", where)
        return target


def _ref(part: tuple[str | None, bool]) -> str | None:
    expression, may_be_empty = part
    return None if expression is None else f"{expression}?" if may_be_empty else expression


def _types(schema: Mapping[str, Any], where: str) -> list[str]:
    kind = schema.get("type")
    if kind is None:
        if "properties" in schema:
            return ["object"]
        _check_keys(schema, {"type"}, where)  # names an unsupported keyword (oneOf, not, ...) if there is one
        raise ConstraintError(f"{where}: a schema without 'type' is not supported here", where)
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if k not in _BY_TYPE:
            raise ConstraintError(f"{where}: type {k!r} is not supported", where)
    return kinds


def _check_keys(schema: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unsupported = sorted(set(schema) - allowed - _ANNOTATIONS - {"$defs", "definitions"})
    if unsupported:
        raise ConstraintError(f"{where}: JSON-schema keyword(s) {unsupported} are not supported in tool arguments "
                              "under a forced tool_choice", where)

