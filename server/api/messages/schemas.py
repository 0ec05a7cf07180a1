"""The bodies of `POST /v1/messages` and `/v1/messages/count_tokens` as pydantic models (Anthropic's Messages API).

Deliberate choices (do not "fix" these without reading why):
- What Anthropic has and this server cannot honour is a 400 naming it, never dropped: document and search result
  blocks, `file` image sources (there is no Files API here), citations, redacted thinking (encrypted by another
  server), server tools (web search, code execution, Anthropic's own tool search, ...), MCP servers, containers, an
  assistant prefill (the chat path always opens a new assistant turn), a context-management edit of another type.
- `system` turns may sit anywhere in `messages` (Claude Code sends a trailing one); the last *user or assistant* turn
  is the one that must be the user's. A turn may carry its own `output_config.effort` (Claude Code's per-turn control).
- `context_management.edits` are honoured (context.py applies them to the prompt); `thinking.display` "updates" is
  taken as "omitted" (this model writes no progress updates apart from its thought).
- `image` blocks (a user turn's, or inside a `tool_result`) are read by the chat path's image reader (translate.py
  makes them chat `image_url` parts). A base64 source's `media_type` must be one Anthropic allows (JPEG, PNG, GIF,
  WebP) and must be what the data is: a mismatch is a 400, as Anthropic answers it, rather than trusting either side.
  The data's format is told by its first bytes (the four formats' fixed signatures), so the check decodes 12 bytes
  here, not the image (the reader decodes it later on a worker thread). A `url` source must be http(s); whether this
  server downloads it (--allow-image-urls) is the route's check, as on chat.
- `cache_control` (on the body, a block or a tool; `ephemeral`, its `ttl` 5m or 1h, as the SDK declares it) is
  accepted and ignored: this server caches the longest common
  prompt prefix on its own (`usage.cache_read_input_tokens` says how much was reused), with no markers needed.
  So are `metadata`, `service_tier`, `inference_geo`, `speed`, `diagnostics`, and a thinking block's `signature`:
  none changes the output here.
- `temperature`, `top_p` and `top_k` are taken when sent (LiteLLM and older SDKs send them; the 2026 SDK passes them
  through `extra_body`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.api.http import BodyPart, RequestBody
from server.api.schemas import ToolName

USER_BLOCKS = ("text", "image", "tool_result")
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's image media types
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking")
SYSTEM_BLOCKS = ("text",)
REFUSED = {
    "container": "code execution containers are not supported (this server runs no server tools)",
    "mcp_servers": "MCP servers are not supported: declare their tools as client tools",
}
# Anthropic's server-side tool search: a model of theirs searching a catalogue on their servers.
TOOL_SEARCH_TYPES = ("tool_search_tool_regex", "tool_search_tool_bm25")
_WHY_NOT = {
    "document": "document blocks are not supported (send the text as a text block)",
    "search_result": "search result blocks are not supported (send the text as a text block)",
    "redacted_thinking": "this server issues no redacted thinking and cannot read another's",
}


def _blocks(allowed: tuple[str, ...]) -> BeforeValidator:
    """A string (one text block) or a list of blocks of the `allowed` types; any other type is refused naming it."""

    def blocks(value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "text", "text": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content blocks")
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                why = _WHY_NOT.get(kind, f"supported here: {', '.join(allowed)}") if isinstance(kind, str) else \
                    f"supported: {', '.join(allowed)}"
                raise ValueError(f"block {index} has type {kind!r}: {why}")
        return value

    return BeforeValidator(blocks)


class CacheControl(BodyPart):
    """A cache breakpoint (the SDK's CacheControlEphemeralParam): checked against its documented values, then ignored
    (see the module docstring)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Metadata(BodyPart):
    user_id: str | None = None


class TextBlock(BodyPart):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("citations are not supported")
        return value


class ToolUseBlock(BodyPart):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def sniffed_type(data: str) -> str | None:
    """The image media type base64 `data` starts with (by the format's signature), or None: none of Anthropic's."""
    head = data[:16]  # 12 bytes: the longest signature (WebP's RIFF....WEBP)
    try:
        first = base64.b64decode(head[: len(head) // 4 * 4], validate=True)
    except (binascii.Error, ValueError):
        return None
    if first.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if first.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if first.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if first[:4] == b"RIFF" and first[8:12] == b"WEBP":
        return "image/webp"
    return None


class Base64Source(BodyPart):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)

    @model_validator(mode="after")
    def _the_data_is_that_type(self) -> Base64Source:
        found = sniffed_type(self.data)
        if found is None:
            raise PydanticCustomError("image_data", "data: not a JPEG, PNG, GIF or WebP image in base64 (the image "
                                      "types this API takes)", {"loc": "data"})
        if found != self.media_type:
            raise PydanticCustomError("image_media_type", "media_type: the image was sent as {sent}, but its data is "
                                      "{found}", {"sent": self.media_type, "found": found, "loc": "media_type"})
        return self

    @property
    def url(self) -> str:
        """The chat path's image URL for it: a data: URL."""
        return f"data:{self.media_type};base64,{self.data}"


class UrlSource(BodyPart):
    type: Literal["url"]
    url: str

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not value.lower().startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL (send an image's bytes as a base64 source)")
        return value


def _source(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "file":
        raise ValueError("file sources are not supported (this server has no Files API): send the image as a "
                         "base64 source")
    if kind not in ("base64", "url"):
        raise ValueError(f"source type {kind!r}: supported here: base64, url")
    return value


class ImageBlock(BodyPart):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type"), BeforeValidator(_source)]
    cache_control: CacheControl | None = None


ResultBlock = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(BodyPart):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Annotated[list[ResultBlock], _blocks(("text", "image"))] = Field(default_factory=list)
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(BodyPart):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server's are empty; any is accepted and ignored


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class TurnOutputConfig(BodyPart):
    """A turn's own `output_config` (the per-turn-control beta): its effort; anything else in it is a 400."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class InputMessage(BodyPart):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], _blocks(tuple(dict.fromkeys(USER_BLOCKS + ASSISTANT_BLOCKS)))]
    output_config: TurnOutputConfig | None = None

    @model_validator(mode="after")
    def _the_roles_blocks(self) -> InputMessage:
        allowed = {"user": USER_BLOCKS, "assistant": ASSISTANT_BLOCKS, "system": SYSTEM_BLOCKS}[self.role]
        for index, block in enumerate(self.content):
            if block.type not in allowed:
                raise PydanticCustomError("block_role", "content: block {index} has type '{kind}', which {role} "
                                          "messages cannot have ({role} messages have {allowed})",
                                          {"index": index, "kind": block.type, "role": self.role,
                                           "allowed": " / ".join(allowed), "loc": "content"})
        return self


class CustomTool(BodyPart):
    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # forced calls follow the schema by grammar in any case
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None  # left out of the prompt until the conversation surfaces it (translate.py)
    input_examples: list[dict[str, Any]] | None = None  # accepted and ignored: the schema is what the model reads


class ToolChoice(BodyPart):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1)
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice", "name: required with type 'tool' (and only with it)",
                                      {"loc": "name"})
        return self


class ThinkingConfig(BodyPart):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)  # Anthropic's floor of 1,024 does not apply here
    # summarized: the thought itself (there is no summarizer); updates: progress notes between tool calls, which this
    # model does not write apart from its thought, so its thought is not shown (as "omitted")
    display: Literal["summarized", "omitted", "updates"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise PydanticCustomError("thinking", "budget_tokens: required with type 'enabled' (and only with it)",
                                      {"loc": "budget_tokens"})
        return self


class OutputFormat(BodyPart):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BodyPart):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # "max": chat's highest, "xhigh"
    format: OutputFormat | None = None


class InputTokens(BodyPart):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(BodyPart):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ThinkingTurns(BodyPart):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearThinking(BodyPart):
    """`clear_thinking_20251015`: thinking blocks of all but the last `keep` assistant turns that have them (Anthropic's
    default: 1), or none with `keep: "all"`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns = ThinkingTurns(type="thinking_turns", value=1)


class ClearToolUses(BodyPart):
    """`clear_tool_uses_20250919`: once the prompt passes `trigger` (Anthropic's default: 100,000 input tokens), the
    results of all but the last `keep` tool uses (default 3) are replaced by a placeholder, their inputs too with
    `clear_tool_inputs` (true, or the tools' names), uses of `exclude_tools` kept; not applied unless that clears at
    least `clear_at_least` tokens."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] = InputTokens(type="input_tokens",
                                                                                           value=100_000)
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] = False


EDIT_TYPES = ("clear_thinking_20251015", "clear_tool_uses_20250919")


def _edit_types(value: Any) -> Any:
    for i, edit in enumerate(value if isinstance(value, list) else ()):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in EDIT_TYPES:
            raise ValueError(f"edit {i} has type {kind!r}: supported here: {', '.join(EDIT_TYPES)}")
    return value


class ContextManagement(BodyPart):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
    edits: Annotated[list[Annotated[ClearThinking | ClearToolUses, Field(discriminator="type")]],
                     BeforeValidator(_edit_types)] = Field(default_factory=list, max_length=8)


class PromptBody(RequestBody):
    """What both routes render: the model, the conversation, the tools and the thinking switch."""

    refused_hints = REFUSED

    model: str | None = None  # Anthropic's SDKs always send one; unset, as on chat: the served model
    messages: list[InputMessage] = Field(min_length=1)
    system: Annotated[list[TextBlock], _blocks(("text",))] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    # Accepted and ignored: they change nothing in the output here (see the module docstring).
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _roles(cls, value: Any) -> Any:
        for i, message in enumerate(value if isinstance(value, list) else ()):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ("user", "assistant", "system"):
                raise ValueError(f"message {i} has role {role!r}: 'user', 'assistant' or 'system'")
        return value

    @field_validator("messages")
    @classmethod
    def _ends_with_the_user(cls, value: list[Any]) -> list[Any]:
        turns = [message.role for message in value if message.role != "system"]  # a system turn is not the last turn
        if not turns:
            raise ValueError("no user message: system turns alone are not a conversation")
        if turns[-1] == "assistant":
            raise ValueError("the last message must be the user's: continuing an assistant prefill is not supported")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _custom_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind.startswith(TOOL_SEARCH_TYPES):
                raise ValueError(f"tool {i} has type {kind!r}: Anthropic's server-side tool search is not run here; "
                                 "mark tools `defer_loading: true` and give the model a custom tool that searches "
                                 "them (as Claude Code's ToolSearch does): a deferred tool joins the prompt once the "
                                 "conversation names it")
            if kind not in (None, "custom"):
                raise ValueError(f"tool {i} has type {kind!r}: only custom tools (name, description, input_schema) are "
                                 "supported (this server runs no server tools)")
        return value


class MessagesRequest(PromptBody):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # 0: off
    stream: bool | None = False
    metadata: Metadata | None = None  # accepted and ignored
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None


class CountTokensRequest(PromptBody):
    """`/v1/messages/count_tokens`: the prompt's parts only (Anthropic's own body has no max_tokens)."""
