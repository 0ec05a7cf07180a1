"""Token-level constraints: what a request allows the model to write, enforced as a vocabulary mask every step.

Built from the request by `build_constraint(...)` (None for a request without one: zero cost), then per step:
`fill_mask(bitmask)` (1 bit per token id, set = allowed), the sampler sets every disallowed logit to -inf
(server/constraint_mask.py, the only part that touches torch), and `accept(token_id)` advances it. `is_finished`
says that only a stop id can follow. Torch-free, so the API layer can build and validate constraints.

Sources of constraints:
- `response_format` `json_object` / `json_schema`: llguidance's JSON-schema compiler (compact separators
  `", "` and `": "`, no free whitespace, so a weak model cannot wander off into blanks), optionally after a
  Gemma-4 thought channel when thinking is on;
- Gemma-4 tool calls with `tool_choice` "required" or a named function: a grammar of
  `<|tool_call>call:NAME{...}<tool_call|>` (one or more; exactly one with `parallel_tool_calls: false`) to the
  declared functions, whose arguments follow Gemma's syntax and the function's JSON schema (`gemma_arguments`,
  a bounded converter: unsupported keywords raise `ConstraintError`);
- `tool_choice` "none": the call-opening token is banned (no grammar);
- `tool_choice` "auto" with `parallel_tool_calls: false`: free until the first `<tool_call|>`, then only a stop id.

Why llguidance, not xgrammar (both measured on this host, 2 cores shared with other jobs at load 8-11, the real 262k
Gemma tokenizer, 3 JSON documents forced through a 6-property schema, 215 mask fills each):
                      compile json_schema   compile json_object   fill p50 / p99 (ms)
    llguidance 1.9.1       9-13 ms               1.4-9.5 ms        0.015-0.021 / 2-8 (first pass builds lexer states)
    xgrammar 0.2.9       420-880 ms            430-800 ms          0.003-0.010 / 0.3-1.2
Both fill a mask far under the 0.5 ms goal; xgrammar precomputes a per-grammar cache over the whole vocabulary, so
each new schema costs ~0.5 s of CPU, where llguidance compiles in milliseconds with its work bounded by fuel limits.
Its Lark grammars also reference special tokens by id (`<[48]>`) and intersect regexes (`& ~/.../`), which Gemma's
`<|"|>`-delimited strings need. Its one-time tokenizer build is slow (13-20 s here, more under load; see
`GrammarVocab`): do it once, off the device thread. Per-token cost with the torch side: server/constraint_bench.py.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from server.protocol.base import ProtocolError
from server.protocol.gemma4 import CALL_CLOSE, CALL_OPEN, CHANNEL_CLOSE, CHANNEL_OPEN, QUOTE


class ConstraintError(ProtocolError):
    """The request's schema, tools or tool_choice cannot be enforced: the API answers 400 naming `param`."""


@dataclass(frozen=True)
class ConstraintLimits:
    max_spec_chars: int = 64 * 1024  # JSON text of a schema, or of all tools' parameters together
    max_depth: int = 8  # nesting of objects/arrays (and $ref inlining) in a tool's arguments
    max_properties: int = 256  # over one tool's whole schema
    max_string_length: int = 8192  # maxLength above this is refused (a lexer state per character)
    max_tools: int = 128
    max_compile_s: float = 2.0  # measured after the fact; fuel limits below are what actually bound the work
    grammar_size: int = 200_000  # llguidance: symbols in productions
    lexer_fuel: int = 2_000_000  # llguidance: work to build the lexer (~50k/ms)
    cache_entries: int = 64  # compiled grammars kept for reuse (a copy per request)


# --------------------------------------------------------------------- the vocabulary


class GrammarVocab:
    """The tokenizer as the grammar engine needs it, built once per model.

    Seconds of work (13-20 s on this 2-core host for Gemma's 262k tokens, up to a minute under heavy load; building
    it from a `llguidance.TokenizerWrapper` over the token bytes measured ~8 s): build it at start-up in a thread, or
    lazily on the first constrained request (never on the device thread). `stop_ids` are the ids that end generation
    (eos plus the generation config's extra stops): a finished grammar allows exactly those.
    """

    def __init__(self, tokenizer_json: str, vocab: Mapping[str, int], vocab_size: int, stop_ids: Sequence[int],
                 limits: ConstraintLimits = ConstraintLimits()) -> None:
        self.vocab_size = vocab_size
        self.stop_ids = tuple(dict.fromkeys(stop_ids))
        self.limits = limits
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(self.stop_ids))
        self.markers = {text: vocab[text] for text in (CALL_OPEN, CALL_CLOSE, CHANNEL_OPEN, CHANNEL_CLOSE, QUOTE)
                        if text in vocab}
        self._parser_limits = llguidance.LLParserLimits(max_grammar_size=limits.grammar_size,
                                                        initial_lexer_fuel=limits.lexer_fuel, verbose_errors=False)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                       limits: ConstraintLimits = ConstraintLimits()) -> GrammarVocab:
        """From a `HostTokenizer` (or a transformers fast tokenizer): its Rust tokenizer serialised, as llguidance's
        own transformers adapter does."""
        return cls(tokenizer.backend_tokenizer.to_str(), tokenizer.get_vocab(), vocab_size, stop_ids, limits)

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar` (a copy of a cached compiled one); ConstraintError if it does not compile."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled.deep_copy()
        start = time.perf_counter()
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._parser_limits)
        elapsed = time.perf_counter() - start
        if compiled.is_error():
            raise ConstraintError(f"cannot enforce this schema: {_first_line(compiled.get_error())}")
        if elapsed > self.limits.max_compile_s:
            raise ConstraintError(f"schema too complex to enforce (compiling took {elapsed:.1f} s)")
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self.limits.cache_entries:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def special(self, text: str) -> str:
        """The Lark reference to a special token of this vocabulary, by id."""
        if text not in self.markers:
            raise ConstraintError(f"this model's tokenizer has no {text} token")
        return f"<[{self.markers[text]}]>"


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


# --------------------------------------------------------------------- constraints


class Constraint:
    """One request's constraint: per step `fill_mask`, then `accept` the sampled token."""

    def fill_mask(self, bitmask: np.ndarray) -> None:
        """Write the allowed set into `bitmask` (int32, `ceil(V / 32)` words; bit i of word w is token 32 w + i)."""
        raise NotImplementedError

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; False if the constraint did not allow it (the request must end)."""
        raise NotImplementedError

    @property
    def is_finished(self) -> bool:
        """Only a stop id may follow (the engine may end the request here with finish_reason "stop")."""
        return False


class GrammarConstraint(Constraint):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())


class BannedTokens(Constraint):
    """A fixed set of ids that may never be sampled (tool_choice "none": the call-opening token)."""

    def __init__(self, banned: Iterable[int], mask_words: int) -> None:
        self.banned = tuple(sorted(set(banned)))
        self._mask = _bitmask(self.banned, mask_words, allowed=False)

    def fill_mask(self, bitmask: np.ndarray) -> None:
        bitmask[:] = self._mask

    def accept(self, token_id: int) -> bool:
        return token_id not in self.banned


class StopAfterCall(Constraint):
    """parallel_tool_calls false under tool_choice "auto": anything until the first call closes, then only a stop."""

    def __init__(self, call_close: int, stop_ids: Sequence[int], mask_words: int) -> None:
        self._close = call_close
        self._closed = False
        self._all = np.full(mask_words, -1, dtype=np.int32)
        self._stops = _bitmask(stop_ids, mask_words, allowed=True)
        self._stop_ids = frozenset(stop_ids)

    def fill_mask(self, bitmask: np.ndarray) -> None:
        bitmask[:] = self._stops if self._closed else self._all

    def accept(self, token_id: int) -> bool:
        if self._closed:
            return token_id in self._stop_ids
        self._closed = token_id == self._close
        return True

    @property
    def is_finished(self) -> bool:
        return self._closed


def _bitmask(ids: Iterable[int], mask_words: int, *, allowed: bool) -> np.ndarray:
    """A bitmask (the layout of `Constraint.fill_mask`) allowing exactly `ids`, or everything but `ids`."""
    bits = np.full(mask_words * 32, not allowed, dtype=np.uint8)
    bits[list(ids)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def allowed_ids(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask allows (for tests and diagnostics; the sampler expands masks in torch)."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


# --------------------------------------------------------------------- building a request's constraint


def build_constraint(vocab: GrammarVocab, *, response_format: Mapping[str, Any] | None = None,
                     tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
                     parallel_tool_calls: bool = True, thinking: bool = False,
                     native_tools: bool = True) -> Constraint | None:
    """The request's constraint, or None when it has none. Raises ConstraintError (a 400) for what cannot be enforced.

    `native_tools`: the model's protocol has Gemma-4's tool format (tools on a plain model are refused earlier, by
    the protocol). `thinking`: a thought channel may precede the constrained output. Compiles a grammar (milliseconds,
    bounded): call it off the device thread.
    """
    fmt = (response_format or {}).get("type", "text")
    if fmt not in ("text", "json_object", "json_schema"):
        raise ConstraintError(f"response_format.type {fmt!r} is not supported", "response_format")
    choice = _tool_choice(tools, tool_choice)
    if fmt != "text" and choice in ("required", "named"):
        raise ConstraintError("response_format cannot be combined with a tool_choice that forces a call", "tool_choice")
    thought = thinking and native_tools
    if fmt != "text":
        schema = _response_schema(response_format or {}, vocab.limits)
        grammar = _with_thought(vocab, f"%json {json.dumps(schema)}", thought)
        return GrammarConstraint(vocab.matcher(grammar))
    if not tools or choice == "auto" and parallel_tool_calls:
        return None
    if not native_tools:
        raise ConstraintError("tools: this model has no native tool-call format", "tools")
    if choice == "none":
        return BannedTokens([vocab.markers[CALL_OPEN]], vocab.mask_words)
    if choice == "auto":
        return StopAfterCall(vocab.markers[CALL_CLOSE], vocab.stop_ids, vocab.mask_words)
    names = [tool_choice["function"]["name"]] if choice == "named" else None  # type: ignore[index]
    grammar = tool_call_grammar(vocab, tools, names, parallel=parallel_tool_calls, thought=thought)
    return GrammarConstraint(vocab.matcher(grammar))


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
    if name not in {_function(tool)["name"] for tool in tools or ()}:
        raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return "named"


def _response_schema(response_format: Mapping[str, Any], limits: ConstraintLimits) -> dict[str, Any]:
    if response_format["type"] == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise ConstraintError("response_format.json_schema must be an object with a 'schema' object",
                                  "response_format")
        schema = dict(spec.get("schema") or {})
    text = json.dumps(schema)
    if len(text) > limits.max_spec_chars:
        raise ConstraintError(f"response_format schema is {len(text)} characters; the limit is {limits.max_spec_chars}",
                              "response_format")
    # Compact separators and no free whitespace: a weak (or random) model cannot fill its budget with blanks.
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                     "lenient": False}}


def _with_thought(vocab: GrammarVocab, body: str, thought: bool) -> str:
    if not thought:
        return f"start: {body}\n"
    return (f"start: thought? main\nmain: {body}\n"
            f'thought: {vocab.special(CHANNEL_OPEN)} THOUGHT {vocab.special(CHANNEL_CLOSE)}\n'
            "THOUGHT: /(?s:.*)/\n")


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ConstraintError("tools must be function tools with a name", "tools")
    return function


# --------------------------------------------------------------------- Gemma-4 tool calls


def tool_call_grammar(vocab: GrammarVocab, tools: Sequence[Mapping[str, Any]], names: Collection[str] | None, *,
                      parallel: bool = True, thought: bool = False) -> str:
    """Lark for `(thought)? <|tool_call>call:NAME{args}<tool_call|>` (+ more calls when `parallel`), NAME among
    `names` (all tools when None), args valid for NAME's JSON schema in Gemma's syntax."""
    limits = vocab.limits
    if len(tools) > limits.max_tools:
        raise ConstraintError(f"{len(tools)} tools; the limit is {limits.max_tools}", "tools")
    if sum(len(json.dumps(_function(tool).get("parameters") or {})) for tool in tools) > limits.max_spec_chars:
        raise ConstraintError(f"the tools' parameter schemas exceed {limits.max_spec_chars} characters", "tools")
    builder = GemmaGrammar(vocab.special(QUOTE), limits)
    alternatives = []
    for i, tool in enumerate(tools):
        function = _function(tool)
        if names is not None and function["name"] not in names:
            continue
        if not re.fullmatch(r"[A-Za-z_][\w.\-]*", function["name"]):
            raise ConstraintError(f"tools[{i}].function.name {function['name']!r} cannot be written in Gemma's call "
                                  "syntax", f"tools[{i}].function.name")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        args = builder.arguments(parameters, f"tools[{i}].function.parameters")
        alternatives.append(f"{_literal(function['name'])} {args}")
    call = (f"call: {vocab.special(CALL_OPEN)} \"call:\" ({' | '.join(alternatives)}) {vocab.special(CALL_CLOSE)}")
    body = "call+" if parallel else "call"
    head = _with_thought(vocab, body, thought)
    return head + call + "\n" + "\n".join(builder.rules) + "\n"


def _literal(text: str) -> str:
    return json.dumps(text)


_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                          "readOnly", "writeOnly", "strict"})
_BY_TYPE = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "string": {"type", "enum", "const", "minLength", "maxLength"},
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
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
            raise ConstraintError(f"{where}: bad minLength/maxLength", where)
        if max(low, high or 0) > self.limits.max_string_length:
            raise ConstraintError(f"{where}: string lengths above {self.limits.max_string_length} are not supported",
                                  where)
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


# --------------------------------------------------------------------- building the vocabulary in the background


class VocabLoader:
    """Builds the `GrammarVocab` once, on its own thread, after start-up (never on the device thread, never delaying
    readiness): `start()` is idempotent, `wait(timeout)` gives the vocabulary or None if it is not ready in time.

    Nothing is cached on disk: llguidance has no way to serialise a built tokenizer (LLTokenizer), so each start
    builds it again (13-20 s for Gemma's 262k tokens on a 2-core host). The constructor holds the GIL for most of
    that (one ~10 s stall measured), which is why the server starts it together with the graph load.
    """

    def __init__(self, build: Any) -> None:
        self._build = build  # () -> GrammarVocab
        self._vocab: GrammarVocab | None = None
        self._error: str | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-vocab", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            self._vocab = self._build()
        except Exception as exc:  # noqa: BLE001 - reported to every constrained request, the server keeps serving
            self._error = f"{type(exc).__name__}: {exc}"
        self._done.set()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def wait(self, timeout: float) -> GrammarVocab | None:
        """The vocabulary, or None when it is still building after `timeout`; raises RuntimeError if it failed."""
        self.start()
        if not self._done.wait(timeout):
            return None
        if self._vocab is None:
            raise RuntimeError(f"the grammar vocabulary failed to build: {self._error}")
        return self._vocab
