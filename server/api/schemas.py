"""Request bodies of the chat-shaped routes (chat and legacy completions, /generate, tokenize) as pydantic models;
`ChatCompletionRequest` is also what the Responses API translates into. Their bases and `parse` are `server.api.http`'s.

Deliberate choices (do not "fix" these without reading why):
- Range checks sit on the fields, so pydantic names the field and `parse` turns that into OpenAI's `param`.
- Shapes that OpenAI lets vary (`stop`, `prompt`, message `content`) are normalised by "before" validators into
  one type, so a wrong value gives one clear message instead of a union's error for every member.
- Explicit nulls mean "unset" (some clients send `"temperature": null`).
- Nothing here knows the model: vocabulary and context checks happen in the routes, against the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from server.api.http import BodyPart, RequestBody
from server.protocol.base import TOOL_NAME_PATTERN, TOOL_NAME_RULE, is_tool_name

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOPS = 4
MAX_TOKEN_ID_DIGITS = 18  # any vocabulary is smaller; int() of a longer key is never needed

Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


def _check_top_k(value: int) -> int:
    if value < -1:
        raise ValueError("must be -1 or 0 (off) or >= 1")
    return value


# The sampling fields chat, completions and the Responses API share, each checked once here (the Responses API takes
# them as vLLM does there, with the same meaning: server.api.responses.translate hands them to the chat request).
TopK = Annotated[int, AfterValidator(_check_top_k)]  # -1 or 0: off
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def check_tool_name(name: str) -> str:
    """The tool-name rule (server.protocol.base.TOOL_NAME_PATTERN) as a field check: every route that takes tools
    validates its tool names with this (`ToolName`), so a tool the model could never call is refused where it is
    declared."""
    if not is_tool_name(name):
        raise ValueError(f"must be {TOOL_NAME_RULE} (got {name[:80]!r}{'...' if len(name) > 80 else ''})")
    return name


ToolName = Annotated[str, AfterValidator(check_tool_name),
                     WithJsonSchema({"type": "string", "pattern": TOOL_NAME_PATTERN})]


def joined_text_parts(parts: list[Any], allowed: tuple[str, ...]) -> str:
    """Content parts of the `allowed` text types, their texts joined with "\n" (as vLLM does); any other part (an
    image, audio, ...) is refused: this is a text-only model."""
    texts: list[str] = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise ValueError(f"text-only model: content part {index} has type {kind!r}; only "
                             f"{' and '.join(repr(a) for a in allowed)} parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {index}: 'text' must be a string")
        texts.append(text)
    return "\n".join(texts)


# Where an image part sat in a message's text: server.api.chat.prompts swaps each for the image's tokens after the
# chat template rendered the turn (no text may hold it: a text part with it is refused, and the count is checked).
IMAGE_MARK = "\x00image\x00"
DETAILS = ("low", "auto", "high")


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image part of a message, as sent: its URL (data: or http(s)), OpenAI's `detail`, its index in the content."""

    url: str
    detail: str | None
    part: int


def image_ref(part: dict[str, Any], index: int) -> ImageRef:
    """A chat `image_url` part ({"type": "image_url", "image_url": {"url": ..., "detail": ...}}; the url alone as a
    string is taken too), checked."""
    value = part.get("image_url")
    url, detail = (value, None) if isinstance(value, str) else \
        (value.get("url"), value.get("detail")) if isinstance(value, dict) else (None, None)
    if not isinstance(url, str) or not url:
        raise ValueError(f"content part {index}: image_url.url must be a string (a data: URL)")
    if detail is not None and detail not in DETAILS:
        raise ValueError(f"content part {index}: image_url.detail must be one of {', '.join(DETAILS)}, got {detail!r}")
    return ImageRef(url, detail, index)


def split_parts(parts: list[Any]) -> tuple[str, tuple[ImageRef, ...]]:
    """Chat content parts -> their text (parts joined with "\n", each image an IMAGE_MARK) and their images."""
    pieces: list[str] = []
    images: list[ImageRef] = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            images.append(image_ref(part, index))
            pieces.append(IMAGE_MARK)
            continue
        if kind != "text":
            raise ValueError(f"content part {index} has type {kind!r}; only 'text' and 'image_url' parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {index}: 'text' must be a string")
        if IMAGE_MARK in text:
            raise ValueError(f"content part {index}: 'text' holds NUL characters")
        pieces.append(text)
    return "\n".join(pieces), tuple(images)


class StreamOptions(BodyPart):
    include_usage: bool | None = False


class FunctionCall(BodyPart):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON string on the wire; an object is accepted too


class ToolCall(BodyPart):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BodyPart):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # text parts are joined with "\n" (as vLLM does); anything else is a 400
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant: its thought, sent back (the template may drop it)
    reasoning: str | None = None  # the same, as some clients name it
    # The content's image parts, in order (its text holds an IMAGE_MARK where each sat); set by `_image_parts`.
    _images: tuple[ImageRef, ...] = PrivateAttr(default=())

    @property
    def images(self) -> tuple[ImageRef, ...]:
        return self._images

    @model_validator(mode="wrap")
    @classmethod
    def _image_parts(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Message:
        # A content list becomes text here (with IMAGE_MARKs), its images kept beside it: every consumer of a
        # message reads its content as one string, as before images.
        images: tuple[ImageRef, ...] = ()
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            try:
                text, images = split_parts(data["content"])
            except ValueError as exc:
                raise PydanticCustomError("invalid_content", "content: {message}",
                                          {"message": str(exc), "loc": "content"}) from None
            data = {**data, "content": text}
        message: Message = handler(data)
        if images:
            message._images = images
        return message

    @model_validator(mode="after")
    def _content_where_needed(self) -> Message:
        # Only an assistant message may omit its content (a turn that only called tools); a user, system or tool
        # message without one is a client bug, refused naming the field rather than rendered as an empty turn.
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing_content", "content: required for a {role} message",
                                      {"role": self.role, "loc": "content"})
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("missing_tool_call_id", "tool_call_id: required for a tool message",
                                      {"loc": "tool_call_id"})
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (None-valued keys dropped)."""
        data = self.model_dump(exclude_none=True)
        if data["role"] == "developer":
            data["role"] = "system"
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return joined_text_parts(value, ("text",)) if isinstance(value, list) else value


class SamplingFields(RequestBody):
    """The fields shared by chat and legacy completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, Bias] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)  # choices per prompt; the route bounds it (--max-n)
    ignore_eos: bool | None = False  # vLLM's: stop ids do not end the generation
    min_tokens: int | None = Field(None, ge=0)  # vLLM's: stop ids are masked out until this many tokens

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "stream_options: only allowed when stream is true",
                                      {"loc": "stream_options"})
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        if len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(value)}")
        if not all(value):
            raise ValueError("stop sequences must not be empty")
        return tuple(value)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        # ASCII digits only, and few of them: str.isdigit() also accepts "²" and "٣", and int() refuses the first
        # and any string of more than 4300 digits, which would surface later as a 500.
        for key in value or {}:
            text = key.strip()
            if not (text.isascii() and text.isdigit()):
                raise ValueError(f"keys must be token ids, got {key[:32]!r}")
            if len(text) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"token id {text[:32]}... is outside the vocabulary")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ResponseFormat(BodyPart):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (not isinstance(self.json_schema, dict)
                                           or not isinstance(self.json_schema.get("schema", {}), dict)):
            raise PydanticCustomError("json_schema", "json_schema: an object with a 'schema' object is required",
                                      {"loc": "json_schema"})
        return self


# A chat tool's `function` as it is described (/openapi.json); it is validated by `Tool._named` and kept a plain dict,
# passed on whole to the template and the grammar compiler.
_FUNCTION_SCHEMA = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": TOOL_NAME_PATTERN}, "description": {"type": "string"},
    "parameters": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}


class Tool(BodyPart):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True)
    type: Literal["function"]
    function: Annotated[dict[str, Any], WithJsonSchema(_FUNCTION_SCHEMA)]

    @field_validator("function")
    @classmethod
    def _named(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(value.get("name"), str):
            raise PydanticCustomError("tool_name", "name: required, a string", {"loc": "name"})
        try:
            check_tool_name(value["name"])
        except ValueError as exc:
            raise PydanticCustomError("tool_name", "name: {why}", {"why": str(exc), "loc": "name"}) from None
        if not isinstance(value.get("parameters", {}), dict):
            raise ValueError("function.parameters must be a JSON schema object")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # A cap on the thought's tokens (-1 = unlimited; default: --reasoning-budget, then reasoning_effort's budget); the
    # Messages API's thinking.budget_tokens arrives here.
    reasoning_budget: int | None = Field(None, ge=-1)


class CompletionRequest(SamplingFields):
    # One prompt (a string or a list of token ids) or a list of them, normalised to a list: every prompt gets n choices.
    prompt: list[str | list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)  # legacy: how many alternatives per token (the prompt's with echo)
    # 0 only with echo (vLLM's): the prompt alone, scored with logprobs (what evaluation harnesses ask for).
    max_tokens: int | None = Field(None, ge=0)
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        def token_ids(item: Any) -> bool:
            return isinstance(item, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in item)

        if isinstance(value, str) or (token_ids(value) and value):
            return [value]
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if not isinstance(value, list) or not (all(isinstance(p, str) for p in value)
                                               or all(token_ids(p) and p for p in value)):
            raise ValueError("must be a string, a list of token ids, or a non-empty list of either")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only best_of=1 is supported")
        return value

    @model_validator(mode="after")
    def _prompt_alone_is_echoed(self) -> CompletionRequest:
        if self.token_limit == 0 and not self.echo:
            raise PydanticCustomError("max_tokens", "max_tokens: 0 asks for the prompt alone, which needs echo=true",
                                      {"loc": "max_tokens"})
        return self


class GenerateRequest(RequestBody):
    """The seed server's route: chat-templated, greedy."""

    prompt: str
    max_new_tokens: int = Field(128, ge=1)


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    # With messages only (vLLM's TokenizeChatRequest): rendered as a chat request with them renders its prompt.
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has BOS)
    add_generation_prompt: bool | None = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
