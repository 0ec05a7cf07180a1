"""The body of `POST /v1/responses` as pydantic models: `ResponsesRequest`, its input items (`InputItem`), tools and
settings. What OpenAI has and this server cannot honour (`conversation`, hosted tools, `truncation: "auto"`,
background responses, `include` of anything but `reasoning.encrypted_content`) is a 400 naming it, never silently
dropped. Codex CLI's defaults are taken: `custom` tools (freeform input, a grammar enforced), `namespace` tools, and
`web_search` / `tool_search`, which are accepted and not offered to the model (`UNOFFERED_TOOLS`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from server.api.http import IGNORED_TYPES, BodyPart, OpenAITier, RequestBody
from server.api.schemas import MinP, RepetitionPenalty, Seed, ToolName, TopK, joined_text_parts

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
              "custom_tool_call_output")
# What `include` may ask for: reasoning items are always returned with their text (`content`), which this server reads
# back when a client sends them again (Codex, `store: false`); there is nothing encrypted to add.
INCLUDABLE = ("reasoning.encrypted_content",)
# Tools that are not the model's to call here, accepted because Codex CLI sends them by default and left out of the
# prompt (the model is never offered them): `web_search` needs a search backend this server does not have,
# `tool_search` (client-executed) only searches deferred tools, which this server does not take.
UNOFFERED_TOOLS = ("web_search", "tool_search")
MAX_METADATA = 16  # OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512
REFUSED = {
    "conversation": "the Conversations API is not served; continue a conversation with previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "top_logprobs": "logprobs are not returned by /v1/responses (use /v1/chat/completions)",
    "max_tool_calls": "not supported: tool calls are the client's to run, one response at a time",
    "stream_options": "not supported",
}


def _text(*allowed: str) -> BeforeValidator:
    """A string, or text parts of the `allowed` types joined as chat content parts are; any other part is refused."""

    def text(value: Any) -> str:
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of {' / '.join(allowed)} parts")
        return joined_text_parts(value, allowed)

    return BeforeValidator(text)


def _message_content(value: Any) -> Any:
    """A message item's content: a string, text parts joined as `_text` joins them, or, when it holds `input_image`
    parts, the chat content parts it means (text and image_url, in order), which the chat path reads."""
    # (chat parts are taken as they are too: a stored conversation is validated again with its next turn)
    if not isinstance(value, list) or not any(isinstance(p, dict) and p.get("type") in ("input_image", "image_url")
                                              for p in value):
        return _text("input_text", "output_text").func(value)  # type: ignore[attr-defined]
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            if part.get("file_id") is not None:
                raise ValueError(f"content part {index}: file_id is not supported; send the image as image_url (a "
                                 "data: URL)")
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url"), "detail": part.get("detail")}})
        elif kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":  # already read (a stored turn)
            parts.append(part)
        else:
            raise ValueError(f"content part {index} has type {kind!r}; only 'input_text', 'output_text' and "
                             "'input_image' parts are supported")
    return parts


class _Item(BodyPart):
    id: str | None = Field(default=None, max_length=256)  # kept as sent (e.g. this server's output items sent back)


class MessageItem(_Item):
    type: Literal["message"]
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[dict[str, Any]], BeforeValidator(_message_content)]  # a list: with images


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object's text, parsed (and refused if it is not one) by the protocol


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[str, _text("input_text")]


class CustomToolCallItem(_Item):
    type: Literal["custom_tool_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: str  # the raw text the model wrote (a freeform tool's input is not JSON)


class CustomToolCallOutputItem(_Item):
    type: Literal["custom_tool_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[str, _text("input_text")]


class ReasoningText(BodyPart):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[ReasoningText] = []
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _ours(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("this server issues no encrypted reasoning and cannot read another's; send the "
                             "reasoning item as this server returned it (its text in content)")
        return value

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ()) or "\n".join(part.text for part in self.summary)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | CustomToolCallItem
                      | CustomToolCallOutputItem, Field(discriminator="type")]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])  # a conversation (stored dicts) back as items


class FunctionTool(BodyPart):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class GrammarFormat(BodyPart):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class FreeTextFormat(BodyPart):
    type: Literal["text"]


class CustomTool(BodyPart):
    """A freeform tool: its input is raw text (a grammar's language, or any text), not a JSON object."""

    type: Literal["custom"]
    name: ToolName
    description: str | None = None
    format: Annotated[FreeTextFormat | GrammarFormat, Field(discriminator="type")] = FreeTextFormat(type="text")


class NamespaceTool(BodyPart):
    """A group of tools under one name (Codex's `multi_agent_v1`): each of its tools is offered as itself; a call to
    one is returned with `namespace` set."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    tools: list[Annotated[FunctionTool | CustomTool, Field(discriminator="type")]]


class UnofferedTool(BodyPart):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)  # echoed back as sent
    type: Literal["web_search", "tool_search"]

    @model_validator(mode="after")
    def _client_search(self) -> UnofferedTool:
        if self.type == "tool_search" and (self.model_extra or {}).get("execution", "client") != "client":
            raise ValueError("tool_search with execution 'server' is not supported: this server has no deferred tools")
        return self


Tool = Annotated[FunctionTool | CustomTool | NamespaceTool | UnofferedTool, Field(discriminator="type")]


class FunctionChoice(BodyPart):
    type: Literal["function", "custom"]
    name: str = Field(min_length=1)


class TextFormat(BodyPart):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs its 'schema' object")
        return self

    def chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "response", "schema": self.json_schema, "strict": self.strict,
                "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(BodyPart):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; it changes nothing here


class ReasoningConfig(BodyPart):
    effort: str | None = None  # checked by the protocol (REASONING_EFFORTS)
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of `summary`

    @property
    def asked_summary(self) -> str | None:
        return self.summary or self.generate_summary


class ResponsesRequest(RequestBody):
    refused_hints = REFUSED
    # The Responses API's tiers are chat's and one more (the openai SDK's responses ServiceTier).
    ignored_types = {**IGNORED_TYPES, "service_tier": TypeAdapter(Literal[OpenAITier, "ultrafast"] | None)}

    model: str | None = None
    input: list[InputItem] = []
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Not OpenAI's, vLLM's (which takes them here as on chat): the same fields, checks and meaning as chat's.
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    include: list[str] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of items")
        items = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                kind = item.get("type", "message" if "role" in item else None)
                if kind not in ITEM_TYPES:
                    raise ValueError(f"item {i} has type {kind!r}; supported: {', '.join(ITEM_TYPES)}")
                item = {**item, "type": kind}
            items.append(item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in ("function", "custom", "namespace", *UNOFFERED_TOOLS):
                raise ValueError(f"tool {i} has type {kind!r}: only function, custom and namespace tools are supported "
                                 "(this server runs no hosted tools; web_search and tool_search are accepted and not "
                                 "offered to the model)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") not in ("function", "custom"):
            raise ValueError("must be 'none', 'auto', 'required' or {'type': 'function' | 'custom', 'name': ...}, got "
                             f"type {value.get('type')!r}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > MAX_METADATA or any(len(k) > 64 or len(v) > 512
                                                                   for k, v in value.items())):
            raise ValueError(f"at most {MAX_METADATA} pairs, keys up to 64 characters, values up to 512")
        return value

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("'auto' is not supported: nothing is dropped from a conversation; one longer than the "
                             "context is a 400 (context_length_exceeded)")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: list[str] | None) -> list[str] | None:
        refused = [name for name in value or () if name not in INCLUDABLE]
        if refused:
            raise ValueError(f"cannot include {', '.join(refused)[:200]} (only {', '.join(INCLUDABLE)}, which adds "
                             "nothing: reasoning text is always in the reasoning item's content); no logprobs")
        return value

    def offered_tools(self) -> list[FunctionTool | CustomTool]:
        """The tools the model is offered: namespaces' tools as themselves, web_search and tool_search left out."""
        tools: list[FunctionTool | CustomTool] = []
        for tool in self.tools or ():
            if isinstance(tool, NamespaceTool):
                tools += tool.tools
            elif isinstance(tool, (FunctionTool, CustomTool)):
                tools.append(tool)
        return tools

    def namespaces(self) -> dict[str, str]:
        """A namespaced tool's name -> its namespace."""
        return {inner.name: tool.name for tool in self.tools or () if isinstance(tool, NamespaceTool)
                for inner in tool.tools}
