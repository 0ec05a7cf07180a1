"""What every chat protocol offers the API layer, and the plain protocol of a model with no native tool format.

A protocol has two sides:
- request: `prompt_inputs(messages, tools=..., chat_template_kwargs=..., reasoning_effort=...)` turns OpenAI chat
  messages (plain dicts, None-valued keys allowed) into what the model's chat template takes, or raises
  `ProtocolError` (the API's 400, naming the offending field in `param`);
- response: `parser(...)` returns a streaming `OutputParser`: `feed(text) -> ParsedDelta` with text decoded from the
  generated ids *as the protocol needs it* (`keep_special_tokens`), then `finish() -> ParseEnd`.

Torch-free, engine-free, and testable with plain strings.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from server.errors import InvalidRequest
from server.json_text import JSONTextError, read_json

if TYPE_CHECKING:
    from server.constraints.constraint import CallFormat

# The one rule for a tool's name, on every route that takes tools (chat, Responses, and any later one): OpenAI's
# ^[a-zA-Z0-9_-]{1,64}$ plus ".", which Gemma-4's call syntax carries (`call:ns.tool{...}`, as vLLM's Gemma-4 parser
# reads it). A name outside it could be declared but never called: the model's call could not be parsed back.
TOOL_NAME_CHARS = r"A-Za-z0-9_.\-"
TOOL_NAME_PATTERN = rf"^[{TOOL_NAME_CHARS}]{{1,64}}$"
TOOL_NAME_RULE = "1 to 64 characters, each a letter, a digit, '_', '-' or '.'"
_TOOL_NAME = re.compile(TOOL_NAME_PATTERN)

# Template variables the server sets itself when it renders a prompt: a client's `chat_template_kwargs` may not set
# them (they would collide with the server's own arguments, or replace the template, the conversation or the tools
# the request declared and the server parses output against).
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_assistant_tokens_mask", "return_dict", "add_special_tokens",
})

# OpenAI's reasoning_effort values; "none" turns thinking off, every other one on (Gemma-4 has no effort levels).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# What each effort caps the thought at, in tokens, when the request gives no reasoning_budget of its own. low, medium,
# high: Google's own mapping of OpenAI's reasoning_effort onto Gemini's thinking budgets (its OpenAI-compatible API:
# 1K, 8K, 24K); xhigh: 32,768, the largest thinking budget Gemini 2.5 takes; minimal: 512, half of low. Gemma-4 is
# Google's open model family: its users meet the same numbers there. "none" turns thinking off (nothing to cap).
EFFORT_BUDGETS = {"minimal": 512, "low": 1024, "medium": 8192, "high": 24576, "xhigh": 32768}
UNLIMITED = -1  # a reasoning budget of -1: no cap


class ProtocolError(InvalidRequest):
    """A request the protocol cannot honour: the API answers 400 with this message and `param`."""


@dataclass(frozen=True)
class ToolCallDelta:
    """One tool call in OpenAI's streaming shape. This parser emits each call once, complete: `id` and `name` set and
    `arguments` the whole JSON object text (OpenAI clients accumulate fragments by `index`; one fragment is valid)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedDelta:
    """What one `feed()` adds to the answer: visible text, thought-channel text, completed tool calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass(frozen=True)
class ParseEnd:
    """`finish()`'s answer: the last delta, whether any complete call was made (finish_reason "tool_calls", unless
    the engine stopped for length: the caller keeps "length" then), and whether a call was cut short (dropped: no
    partial call and none of its syntax reaches the client; the finish reason says why the text ended)."""

    delta: ParsedDelta
    called_tools: bool
    cut_call: bool = False


@dataclass(frozen=True)
class PromptInputs:
    """Arguments for `HostTokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
    **template_kwargs)`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking: bool = False


@dataclass
class ParsedMessage:
    """A whole answer, for non-streaming responses: `collect(parser, text)`."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    called_tools: bool = False
    cut_call: bool = False

    def add(self, delta: ParsedDelta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.tool_calls.extend(delta.tool_calls)


class OutputParser(ABC):
    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """Text the detokenizer released since the last call (any split, even inside a special token's text)."""

    @abstractmethod
    def finish(self) -> ParseEnd:
        """The stream ended (stop, eos or length): flush what was held back."""


def collect(parser: OutputParser, *chunks: str) -> ParsedMessage:
    message = ParsedMessage()
    for chunk in chunks:
        message.add(parser.feed(chunk))
    end = parser.finish()
    message.add(end.delta)
    message.called_tools = end.called_tools
    message.cut_call = end.cut_call
    return message


class ChatProtocol(ABC):
    supports_tools: bool
    # The detokenizer must decode with skip_special_tokens=False for this protocol's parser (its markers are specials).
    keep_special_tokens: bool
    # Stop tokens besides eos, by text (the host resolves them to ids): where the format ends a turn or waits.
    stop_tokens: tuple[str, ...] = ()
    # The thought channel's (opening, closing) markers, by text: what a thinking budget counts between and forces the
    # closing one of (server.constraints.thought); None: the format has no thought channel.
    thought: tuple[str, str] | None = None

    @property
    def calls(self) -> CallFormat | None:
        """The format's tool calls as the constraint planner needs them; None: no native tool-call format."""
        return None

    @abstractmethod
    def prompt_inputs(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None,
                      reasoning_effort: str | None = None) -> PromptInputs: ...

    @abstractmethod
    def parser(self, *, tool_names: Sequence[str] = (), parse_tool_calls: bool = True) -> OutputParser: ...


def is_tool_name(name: object) -> bool:
    """`name` follows the tool-name rule (`TOOL_NAME_PATTERN`)."""
    return isinstance(name, str) and _TOOL_NAME.fullmatch(name) is not None


def template_variables(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's `chat_template_kwargs` as template variables; ProtocolError for one the server sets itself."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
    if reserved:
        name = reserved[0]
        raise ProtocolError(f"chat_template_kwargs.{name}: reserved: the server sets this template variable itself "
                            f"(reserved names: {', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})",
                            f"chat_template_kwargs.{name}")
    return kwargs


def thinking_from(chat_template_kwargs: Mapping[str, Any] | None, reasoning_effort: str | None, default: bool = False) -> bool:
    """enable_thinking from `chat_template_kwargs` and `reasoning_effort` ("none" = off); contradictions are refused."""
    kwargs = chat_template_kwargs or {}
    explicit = kwargs.get("enable_thinking")
    if explicit is not None and not isinstance(explicit, bool):
        raise ProtocolError("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    from_effort = None
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise ProtocolError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}", "reasoning_effort")
        from_effort = reasoning_effort != "none"
    if explicit is not None and from_effort is not None and explicit != from_effort:
        raise ProtocolError(f"reasoning_effort={reasoning_effort!r} contradicts chat_template_kwargs.enable_thinking="
                            f"{str(explicit).lower()}", "reasoning_effort")
    return next((value for value in (explicit, from_effort) if value is not None), default)


def reasoning_budget(requested: int | None, reasoning_effort: str | None, default: int = UNLIMITED) -> int:
    """The thought's cap in tokens (UNLIMITED: none): the request's own `reasoning_budget`, else its effort's
    (`EFFORT_BUDGETS`; "none" turns thinking off, so nothing is capped), else the server's default
    (--reasoning-budget). An unknown effort is refused where thinking is decided (`thinking_from`)."""
    if requested is not None:
        return requested
    if reasoning_effort is not None:
        return EFFORT_BUDGETS.get(reasoning_effort, UNLIMITED)
    return default


def openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat templates take them: None-valued keys dropped, `reasoning` named
    `reasoning_content`, tool-call arguments (JSON strings on the wire) parsed into objects."""
    converted: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        plain = {key: value for key, value in message.items() if value is not None}
        if "reasoning" in plain:
            plain.setdefault("reasoning_content", plain.pop("reasoning"))
        calls = plain.get("tool_calls")
        if calls:
            plain["tool_calls"] = [_call_with_object_arguments(call, f"messages[{i}].tool_calls[{j}]")
                                   for j, call in enumerate(calls)]
        converted.append(plain)
    return converted


def _call_with_object_arguments(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ProtocolError(f"{where}.function.name is required", f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:  # bounded as the body is: a 50,000-deep string is a 400, not a RecursionError
            arguments = read_json(arguments or "{}", f"{where}.function.arguments")
        except JSONTextError as exc:
            raise ProtocolError(exc.message, exc.param) from None
    if not isinstance(arguments, dict):
        raise ProtocolError(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
    return {**call, "function": {**function, "arguments": arguments}}


class PlainProtocol(ChatProtocol):
    """A model without a native tool or thought format (both demo models: SmolLM2-135M-Instruct, Gemma-3 270M): text in, text out.

    Its detokenizer keeps today's skip_special_tokens=True; tools, tool messages and thinking are refused (400).
    """

    supports_tools = False
    keep_special_tokens = False

    def prompt_inputs(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None, reasoning_effort: str | None = None) -> PromptInputs:
        if tools:
            raise ProtocolError("tools: this model has no native tool-call format", "tools")
        for i, message in enumerate(messages):
            if message.get("role") == "tool" or message.get("tool_calls"):
                raise ProtocolError(f"messages[{i}]: this model has no native tool-call format", f"messages[{i}]")
        kwargs = template_variables(chat_template_kwargs)
        if thinking_from(kwargs, reasoning_effort):
            raise ProtocolError("this model has no thinking mode", "reasoning_effort" if reasoning_effort else
                                "chat_template_kwargs")
        return PromptInputs(openai_messages(messages), None, kwargs, thinking=False)

    def parser(self, *, tool_names: Sequence[str] = (), parse_tool_calls: bool = True) -> OutputParser:
        return PlainParser()


class PlainParser(OutputParser):
    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self) -> ParseEnd:
        return ParseEnd(ParsedDelta(), False)
