"""Gemma-4's chat protocol: thinking, tool declarations, tool calls and tool responses.

The format (Google's Gemma-4 prompt-formatting guide; the public Gemma-4 parsers of vLLM and llama.cpp):
- turns `<|turn>ROLE\\n...<turn|>\\n`, the assistant being `model`;
- thinking: `<|think|>` at the top of the system turn; the model then writes `<|channel>thought\\n...<channel|>` before
  its answer (the template ends a thinking-off prompt with that channel empty);
- a call: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flag:true,obj:{k:[1,2]}}<tool_call|>`, several concatenated;
  bare keys, strings between `<|"|>` tokens, other values as in JSON; results come back in the same model turn as
  `<|tool_response>response:NAME{...}<tool_response|>` (a stop id: the model waits for the result there).

Request side (`Gemma4Protocol.prompt_inputs`): `role: "tool"` messages are given the called function's `name` (found
by `tool_call_id`) and their content parsed when it is a JSON object (the template renders objects natively);
thinking is off by default. The call grammar, for forced tool calls: gemma4_grammar.py.

Response side (`Gemma4Parser`): fed the text decoded *with* special tokens, in chunks split anywhere. Deliberate
choices (tests/test_protocol_gemma4.py pins each):
- A tool call is held until it is complete and then emitted once, whole (index, id, name, the full JSON arguments):
  a stream cut mid-call can therefore never have sent a partial call. At `finish()` a call cut short (by max_tokens,
  a stop, eos) is dropped and reported as `ParseEnd.cut_call`, never returned as text: its raw syntax
  (`call:NAME{key:"...`) is protocol markup, and its arguments are not the model's (a city cut to "Pa"). The route's
  finish reason says why it ended ("length"); `called_tools` counts complete calls only.
- `<|"|>` never reaches the client: inside a call it is the string delimiter; anywhere else it is written as `"`.
- Recovered, not dropped: a call without the `call:` prefix (`<|tool_call>NAME{...}<tool_call|>`), and a call
  without its opening `<|tool_call>` (`call:NAME{...}` in the text, closed by `<tool_call|>`, or followed by another
  call or the end of the answer when NAME is a declared tool). Whatever does not parse as a call to a declared tool
  (when tool names are given) comes back as content.
- Any thought channel (`<|channel>NAME\\n...<channel|>`) is reasoning; `<|tool_call>` inside a channel closes it.
- Special tokens other than the protocol's markers (`<eos>`, `<turn|>`, ...) are removed from content and reasoning,
  as skip_special_tokens would have done.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from server.json_text import JSONTextError, JSONTooDeep, read_json
from server.protocol.base import (
    TOOL_NAME_CHARS,
    TOOL_NAME_RULE,
    ChatProtocol,
    OutputParser,
    ParsedDelta,
    ParseEnd,
    PromptInputs,
    ProtocolError,
    ToolCallDelta,
    is_tool_name,
    openai_messages,
    template_variables,
    thinking_from,
)

if TYPE_CHECKING:
    from server.constraints.constraint import CallFormat

TURN_OPEN, TURN_CLOSE = "<|turn>", "<turn|>"
CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
THINK = "<|think|>"
QUOTE = '<|"|>'
TOOL_OPEN, TOOL_CLOSE = "<|tool>", "<tool|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
MARKERS = (TURN_OPEN, TURN_CLOSE, CHANNEL_OPEN, CHANNEL_CLOSE, THINK, QUOTE, TOOL_OPEN, TOOL_CLOSE, CALL_OPEN,
           CALL_CLOSE, RESPONSE_OPEN, RESPONSE_CLOSE)
# Stop ids besides eos, by text (the engine resolves them to ids): the end of the model's turn, and the point where it
# waits for a tool's result.
STOP_TOKENS = (TURN_CLOSE, RESPONSE_OPEN)

_SPECIAL_TEXT = re.compile(r"<[^<>\s]{1,40}>")  # the shape of every special token's text; membership decides
_MAX_HELD = 48  # an unclosed "<" this close to the end may still become a special token: hold it
# A call's name: the characters of the tool-name rule (base.TOOL_NAME_PATTERN), every name a request may declare.
_NAME = re.compile(rf"\s*(?:call:)?\s*([{TOOL_NAME_CHARS}]+)\s*(?=\{{)")
_BARE_CALL = re.compile(rf"call:([{TOOL_NAME_CHARS}]+)\{{")
_BARE_START = re.compile(rf"(?<![{TOOL_NAME_CHARS}])call:")
_BARE_PREFIX = re.compile(rf"call:(?:[{TOOL_NAME_CHARS}]+)?")  # may still grow into `call:NAME{{`
_NAME_CHAR = re.compile(rf"[{TOOL_NAME_CHARS}]")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_BARE_KEY = re.compile(r"[^\s:{}\[\],<>]+")
_BARE_VALUE = re.compile(r"[^,}\]<]+")
_MAX_CALL_CHARS = 1 << 20  # a "call" longer than this is not one: release it as content
# Nesting the argument parser follows (recursively) before it calls the text no call: as deep as a request body may be
# (server.json_text), and far from Python's recursion limit, whatever the model writes.
_MAX_DEPTH = 200


def is_gemma4(vocab: Container[str]) -> bool:
    """Gemma-4's protocol markers are all single tokens of this vocabulary."""
    return all(marker in vocab for marker in MARKERS)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class Gemma4Protocol(ChatProtocol):
    supports_tools = True
    keep_special_tokens = True
    stop_tokens = STOP_TOKENS
    thought = (CHANNEL_OPEN, CHANNEL_CLOSE)

    def __init__(self, special_tokens: Collection[str] = ()) -> None:
        """`special_tokens`: the tokenizer's special-token texts, removed from content as skip_special_tokens would."""
        self.special_tokens = frozenset(special_tokens) | frozenset(MARKERS) | {"<bos>", "<eos>", "<pad>"}

    @property
    def calls(self) -> CallFormat:
        # Imported here: the grammar module is built on this module's markers (and it needs numpy; parsing does not).
        from server.protocol.gemma4_grammar import GEMMA4_CALLS

        return GEMMA4_CALLS

    def prompt_inputs(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None, reasoning_effort: str | None = None) -> PromptInputs:
        variables = template_variables(chat_template_kwargs)
        thinking = thinking_from(variables, reasoning_effort)
        converted = openai_messages(messages)
        names_by_id: dict[str, str] = {}
        for i, message in enumerate(converted):
            for call in message.get("tool_calls") or ():
                if isinstance(call.get("id"), str):
                    names_by_id[call["id"]] = call["function"]["name"]
            if message.get("role") == "tool":
                converted[i] = _tool_message(message, names_by_id, i)
        return PromptInputs(converted, _declared(tools), {**variables, "enable_thinking": thinking}, thinking=thinking)

    def parser(self, *, tool_names: Sequence[str] = (), parse_tool_calls: bool = True,
               new_id: Callable[[], str] = call_id) -> Gemma4Parser:
        return Gemma4Parser(tool_names=tool_names, parse_tool_calls=parse_tool_calls,
                            special_tokens=self.special_tokens, new_id=new_id)


def _tool_message(message: dict[str, Any], names_by_id: Mapping[str, str], index: int) -> dict[str, Any]:
    call = message.get("tool_call_id")
    name = message.get("name") or (names_by_id.get(call) if isinstance(call, str) else None)
    if not name:
        raise ProtocolError(f"messages[{index}]: tool_call_id {call!r} matches no earlier assistant tool call",
                            f"messages[{index}].tool_call_id")
    content = message.get("content", "")
    if isinstance(content, list):  # text parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    if isinstance(content, str) and content.lstrip().startswith("{"):
        try:
            parsed = read_json(content, f"messages[{index}].content")
        except JSONTooDeep as exc:  # no body may nest so deep, nor could a template render it: a 400, not text
            raise ProtocolError(exc.message, exc.param) from None
        except JSONTextError:
            parsed = None  # not JSON: the tool's output is text
        if isinstance(parsed, dict):
            content = parsed
    return {**message, "name": name, "content": content}


def _declared(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    declared = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ProtocolError(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ProtocolError(f"tools[{i}].function.name is required", f"tools[{i}].function.name")
        if not is_tool_name(function["name"]):
            raise ProtocolError(f"tools[{i}].function.name: must be {TOOL_NAME_RULE}", f"tools[{i}].function.name")
        declared.append({"type": "function", "function": dict(function)})
    return declared


# --------------------------------------------------------------------- Gemma's argument syntax


class _Syntax(ValueError):
    pass


def parse_call(body: str, tool_names: Collection[str] = ()) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of `call:NAME{...}` (or `NAME{...}`), the whole body; None if it is not exactly one call."""
    match = _NAME.match(body)
    if match is None or (tool_names and match.group(1) not in tool_names):
        return None
    try:
        arguments, end = _object(body, match.end())
    except _Syntax:
        return None
    return (match.group(1), arguments) if not body[end:].strip() else None


def parse_arguments(text: str) -> dict[str, Any]:
    """`{key:value,...}` in Gemma's syntax as a dict; ValueError if it is not exactly that."""
    arguments, end = _object(text, _skip(text, 0))
    if text[end:].strip():
        raise _Syntax(f"trailing text at {end}")
    return arguments


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _items(text: str, i: int, close: str, item: Callable[[str, int, int], tuple[Any, int]],
           depth: int) -> tuple[list[Any], int]:
    """The comma-separated items of the object or array opening at `i` (at nesting `depth`), each read by `item`; and
    the index past it."""
    if depth > _MAX_DEPTH:
        raise _Syntax(f"nested deeper than {_MAX_DEPTH} at {i}")
    items: list[Any] = []
    i = _skip(text, i + 1)
    if text.startswith(close, i):
        return items, i + 1
    while True:
        value, i = item(text, i, depth)
        items.append(value)
        i = _skip(text, i)
        if text.startswith(close, i):
            return items, i + 1
        if not text.startswith(",", i):
            raise _Syntax(f"expected ',' or '{close}' at {i}")
        i = _skip(text, i + 1)


def _object(text: str, i: int, depth: int = 1) -> tuple[dict[str, Any], int]:
    if not text.startswith("{", i):
        raise _Syntax(f"expected '{{' at {i}")
    members, end = _items(text, i, "}", _member, depth)
    return dict(members), end


def _member(text: str, i: int, depth: int) -> tuple[tuple[str, Any], int]:
    if text.startswith(QUOTE, i):
        key, i = _string(text, i)
    else:
        match = _BARE_KEY.match(text, i)
        if match is None:
            raise _Syntax(f"expected a key at {i}")
        key, i = match.group(), match.end()
    i = _skip(text, i)
    if not text.startswith(":", i):
        raise _Syntax(f"expected ':' at {i}")
    value, i = _value(text, _skip(text, i + 1), depth)
    return (key, value), i


def _string(text: str, i: int) -> tuple[str, int]:
    end = text.find(QUOTE, i + len(QUOTE))
    if end < 0:
        raise _Syntax(f"unterminated string at {i}")
    return text[i + len(QUOTE):end], end + len(QUOTE)


def _value(text: str, i: int, depth: int) -> tuple[Any, int]:
    """The value at `i`, inside a container at nesting `depth`."""
    if text.startswith(QUOTE, i):
        return _string(text, i)
    if text.startswith("{", i):
        return _object(text, i, depth + 1)
    if text.startswith("[", i):
        return _items(text, i, "]", _value, depth + 1)
    match = _BARE_VALUE.match(text, i)
    if match is None:
        raise _Syntax(f"expected a value at {i}")
    bare = match.group().strip()
    if bare in ("true", "false", "null"):
        return json.loads(bare), match.end()
    if _NUMBER.fullmatch(bare):
        number = json.loads(bare)
        if math.isinf(number):  # JSON has no infinity: "1e999" is not an argument value we can pass on
            raise _Syntax(f"number out of range at {i}")
        return number, match.end()
    if not bare or any(c in bare for c in "{[:\""):
        raise _Syntax(f"unreadable value {bare!r} at {i}")
    return bare, match.end()  # an unquoted string: unambiguous enough to keep


def format_value(value: Any) -> str:
    """A JSON value in Gemma's syntax (what the chat template writes; the inverse of the parser)."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{key}:{format_value(item)}" for key, item in sorted(value.items())) + "}"
    return "[" + ",".join(format_value(item) for item in value) + "]"


# --------------------------------------------------------------------- the streaming parser


class Gemma4Parser(OutputParser):
    def __init__(self, *, tool_names: Sequence[str] = (), parse_tool_calls: bool = True,
                 special_tokens: Collection[str] = frozenset(MARKERS), new_id: Callable[[], str] = call_id) -> None:
        self._tool_names = frozenset(tool_names)
        self._tools = parse_tool_calls
        self._special = frozenset(special_tokens) | frozenset(MARKERS)
        self._new_id = new_id
        self._buf = ""
        self._mode = "content"  # content | header | reasoning | call
        self._calls = 0
        self._cut = False  # a call was open when the text ended: dropped, never text
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._out_calls: list[ToolCallDelta] = []

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._drain(final=False)
        return self._delta()

    def finish(self) -> ParseEnd:
        self._drain(final=True)
        return ParseEnd(self._delta(), self._calls > 0, cut_call=self._cut)

    # ------------------------------------------------------------- internals

    def _delta(self) -> ParsedDelta:
        delta = ParsedDelta("".join(self._content), "".join(self._reasoning), tuple(self._out_calls))
        self._content, self._reasoning, self._out_calls = [], [], []
        return delta

    def _clean(self, text: str) -> str:
        def replace(match: re.Match[str]) -> str:
            token = match.group()
            return '"' if token == QUOTE else "" if token in self._special else token

        return _SPECIAL_TEXT.sub(replace, text)

    def _held_from(self, text: str) -> int:
        """Where the part of `text` that may still be the start of a marker (or of a bare `call:`) begins."""
        held = len(text)
        lt = text.rfind("<")
        if lt >= 0 and ">" not in text[lt:] and len(text) - lt <= _MAX_HELD:
            held = lt
        if self._tools and self._mode == "content":
            for n in range(1, 5):  # "c", "ca", "cal", "call" at the end, standing where a bare call could start
                start = len(text) - n
                if start >= 0 and "call:"[:n] == text[start:] and (start == 0 or not _NAME_CHAR.match(text[start - 1])):
                    held = min(held, start)
                    break
        return held

    def _emit_text(self, text: str) -> None:
        if text:
            (self._reasoning if self._mode == "reasoning" else self._content).append(self._clean(text))

    def _emit_call(self, name: str, arguments: dict[str, Any]) -> None:
        self._out_calls.append(ToolCallDelta(self._calls, self._new_id(), name, json.dumps(arguments, ensure_ascii=False)))
        self._calls += 1

    def _drain(self, final: bool) -> None:
        while self._buf:
            before = (self._mode, len(self._buf))
            {"content": self._drain_content, "header": self._drain_header, "reasoning": self._drain_reasoning,
             "call": self._drain_call}[self._mode](final)
            if (self._mode, len(self._buf)) == before:
                break  # waiting for more text
        if final and self._buf:  # nothing more will come: what is left is text
            self._mode = "reasoning" if self._mode in ("header", "reasoning") else "content"
            self._emit_text(self._buf)
            self._buf = ""

    def _to_marker(self, patterns: Sequence[str], bare: bool, final: bool) -> str | None:
        """Emit the text before the first of `patterns` (or of a bare `call:`) and return that marker, the buffer now
        starting with it. With none in the buffer: emit it, except a tail that may still become one (all of it when
        final), and return None."""
        found = [(at, pattern) for pattern in patterns if (at := self._buf.find(pattern)) >= 0]
        if bare and (match := _BARE_START.search(self._buf)):
            found.append((match.start(), "call:"))
        # The earliest one (no two of these texts can start at the same index: none is a prefix of another).
        at, marker = min(found, default=None) or (len(self._buf) if final else self._held_from(self._buf), None)
        self._emit_text(self._buf[:at])
        self._buf = self._buf[at:]
        return marker

    def _drain_content(self, final: bool) -> None:
        patterns = [CHANNEL_OPEN, CHANNEL_CLOSE] + ([CALL_OPEN, CALL_CLOSE] if self._tools else [])
        marker = self._to_marker(patterns, bare=self._tools, final=final)
        if marker == CHANNEL_OPEN:
            self._mode, self._buf = "header", self._buf[len(marker):]
        elif marker == CALL_OPEN:
            self._mode, self._buf = "call", self._buf[len(marker):]
        elif marker in (CHANNEL_CLOSE, CALL_CLOSE):  # a closer with nothing open: the marker alone is dropped
            self._buf = self._buf[len(marker):]
        elif marker is not None:
            self._bare_call(self._buf, final)

    def _bare_call(self, rest: str, final: bool) -> None:
        """`rest` (the buffer) starts with `call:` in content: a call whose `<|tool_call>` is missing, or just text."""
        match = _BARE_CALL.match(rest)
        end = None if match is None else _closing_brace(rest, match.end() - 1)
        if end is None:  # not (yet) a whole `call:NAME{...}`: held while it may still become one
            growing = len(rest) <= _MAX_CALL_CHARS if match else len(rest) <= 5 + 128 and _BARE_PREFIX.fullmatch(rest) is not None
            if final and growing and self._may_call(rest[len("call:"):match.end() - 1] if match else
                                                    rest[len("call:"):], whole=match is not None):
                self._cut, self._buf = True, ""  # a call to a declared tool, cut short: the rest is all inside it
            elif final or not growing:
                self._emit_text("call:")
                self._buf = rest[len("call:"):]
            return
        tail = rest[end:].lstrip()
        closed = tail.startswith(CALL_CLOSE)
        if not closed and not final and CALL_CLOSE.startswith(tail):
            return  # wait: the closing token may come next
        ends_answer = not tail or tail.startswith(CALL_OPEN) or _BARE_START.match(tail) is not None
        parsed = parse_call(rest[:end], self._tool_names)
        declared = parsed is not None and parsed[0] in self._tool_names
        if parsed is not None and (closed or (ends_answer and declared)):
            self._emit_call(*parsed)
            self._buf = tail[len(CALL_CLOSE):] if closed else tail
        else:
            self._emit_text("call:")
            self._buf = rest[len("call:"):]

    def _may_call(self, name: str, *, whole: bool) -> bool:
        """`name` (the whole name when `whole`, else what was written of it, no `{` yet) can be a call's: a declared
        tool's; with none declared, any whole name (`call:me maybe` is no call: it has no `{`)."""
        if not self._tool_names:
            return whole
        return name in self._tool_names if whole else any(tool.startswith(name) for tool in self._tool_names)

    def _drain_header(self, final: bool) -> None:
        newline, close = self._buf.find("\n"), self._buf.find(CHANNEL_CLOSE)
        if close >= 0 and (newline < 0 or close < newline):  # no channel name line: the text is the thought
            self._mode = "reasoning"
            self._emit_text(self._buf[:close])
            self._mode, self._buf = "content", self._buf[close + len(CHANNEL_CLOSE):]
        elif newline >= 0:
            self._mode, self._buf = "reasoning", self._buf[newline + 1:]
        elif len(self._buf) > 64 or final:
            self._mode = "reasoning"

    def _drain_reasoning(self, final: bool) -> None:
        marker = self._to_marker([CHANNEL_CLOSE] + ([CALL_OPEN] if self._tools else []), bare=False, final=final)
        if marker is not None:
            self._mode = "content" if marker == CHANNEL_CLOSE else "call"
            self._buf = self._buf[len(marker):]

    def _drain_call(self, final: bool) -> None:
        close, reopen = self._buf.find(CALL_CLOSE), self._buf.find(CALL_OPEN)
        if close >= 0 and (reopen < 0 or close < reopen):
            body, self._buf = self._buf[:close], self._buf[close + len(CALL_CLOSE):]
        elif reopen >= 0:  # the next call began before this one was closed
            body, self._buf = self._buf[:reopen], self._buf[reopen:]
        elif final or len(self._buf) > _MAX_CALL_CHARS:
            body, self._buf = self._buf, ""
        else:
            return
        self._mode = "content"
        parsed = parse_call(body, self._tool_names)
        if parsed is None and final and close < 0 and reopen < 0:
            self._cut = True  # the text ended inside the call: cut short, dropped (never its raw syntax as text)
        elif parsed is None:
            self._emit_text(body)  # a whole block that is no call (to a declared tool): the text comes back as content
        else:
            self._emit_call(*parsed)


def _closing_brace(text: str, start: int) -> int | None:
    """Index just past the brace closing the one at `start`, skipping `<|"|>` strings; None if not (yet) closed."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith(QUOTE, i):
            end = text.find(QUOTE, i + len(QUOTE))
            if end < 0:
                return None
            i = end + len(QUOTE)
            continue
        if text[i] in "{[":
            depth += 1
        elif text[i] in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
