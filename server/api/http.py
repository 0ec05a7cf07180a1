"""The HTTP edge both route families share: a request body read within its bounds (`read_body`), the pydantic bases
of every body (`BodyPart`, `RequestBody`) and `parse`, which maps every failure to one 400.

Deliberate choices (do not "fix" these without reading why):
- No silent drops: a top-level field that would change the output is implemented or refused with a 400 naming it.
  Only the fields in `IGNORED_FIELDS` (they change nothing in the output: bookkeeping, caching, tracing hints) are
  accepted and ignored; any other unknown field is a 400 (`suffix`, `functions`, `audio`, ...). Inside messages,
  tools and schemas unknown keys are passed through to the template and the grammar compiler, which decide.
- NaN and +-inf are rejected everywhere (`allow_inf_nan=False`), by the JSON parser as well as the fields.
- A body is read only when it is declared `application/json` (else 415, `check_json_content_type`): the one guard
  against a web page's cross-site POST, which browsers send as text/plain or a form without a preflight.
- JSON text inside a field is read by `server.json_text.read_json`: the same parser and limits as the body.
- Strict wire types (`parse` validates in pydantic's strict mode): `"max_tokens": "16"`, `"stream": "true"` or
  `"logprobs": 1` is a 400 naming the field, as OpenAI's and Anthropic's APIs answer, never coerced. JSON has one
  number type, so an integer is taken where a float is declared (`"temperature": 1`); not the reverse: OpenAI
  refuses `"max_tokens": 16.0` ("expected an integer, but got a decimal number"), and so does this server. The
  ignored fields are held to their documented types too (`IGNORED_TYPES`, the SDKs' request params).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from starlette.requests import ClientDisconnect, Request

from server.api.content_encoding import codings, decoded
from server.errors import APIError
from server.json_text import finite

# Request fields that do not change the output: accepted and ignored (README "Thinking, tools and JSON" lists them).
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "prediction", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "parallel_tool_calls_hint", "modalities", "verbosity",
    "client_metadata",  # the Responses API's (Codex CLI sends its session and turn ids there)
})
# The ignored fields' types as the `openai` SDK declares them on CompletionCreateParams and ResponseCreateParams: a
# value outside them is a 400 as OpenAI answers it, though the field changes nothing here (null: unset, as anywhere).
# `modalities` may only ask for text: audio output is not something this model writes.
OpenAITier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
IGNORED_TYPES: Mapping[str, TypeAdapter[Any]] = {
    "user": TypeAdapter(str | None), "store": TypeAdapter(bool | None),
    "metadata": TypeAdapter(dict[str, str] | None),
    "service_tier": TypeAdapter(OpenAITier | None),
    "safety_identifier": TypeAdapter(str | None), "prompt_cache_key": TypeAdapter(str | None),
    "prompt_cache_retention": TypeAdapter(Literal["in_memory", "24h"] | None),
    "verbosity": TypeAdapter(Literal["low", "medium", "high"] | None),
    "modalities": TypeAdapter(list[Literal["text"]] | None),
    "prediction": TypeAdapter(dict[str, Any] | None),
}
REFUSED_HINTS = {
    "suffix": "Gemma has no fill-in-the-middle format",
    "functions": "use `tools` (the legacy `functions` field is not supported)",
    "function_call": "use `tool_choice` (the legacy `function_call` field is not supported)",
}


def check_json_content_type(request: Request) -> None:
    """415 unless the body is declared `application/json` (any parameters, e.g. `; charset=utf-8`).

    Why: a browser sends a cross-origin POST as `text/plain`, `application/x-www-form-urlencoded` or
    `multipart/form-data` without asking first (no CORS preflight). Read as JSON anyway, any web page a user opens could
    make a server with no API key (the default) generate text: a cross-site drain. `application/json` always needs a
    preflight, which only the origins of --allowed-origins pass (none by default). Every JSON route reads its body
    through `read_body`, so this one check covers them all; it runs before a byte of the body is read."""
    declared = request.headers.get("content-type")
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = "none" if declared is None else repr(declared[:100])
        raise APIError(415, f"Content-Type must be application/json (got {shown}).", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The raw body of a JSON route: declared as JSON (415, `check_json_content_type`), refusing more than `limit` bytes
    both by Content-Length and as it streams in (413), and a body that takes longer than `timeout_s` to arrive (408).
    A body sent with `Content-Encoding` gzip, deflate or zstd is decoded, its decoded size bounded by `limit` too (413;
    server.api.content_encoding); any other encoding is a 415 before a byte is read."""
    check_json_content_type(request)
    encoding = request.headers.get("content-encoding")
    codings(encoding)  # an unsupported coding is refused before the body is read
    too_large = APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, "Invalid Content-Length header.", code="invalid_request")
        if int(declared) > limit:
            raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except ClientDisconnect:  # gone before the body was complete: nobody to answer, and not a server error
        raise APIError(499, "The client closed the connection before the request body was complete.",
                       code="client_closed_request") from None
    return decoded(bytes(body), encoding, limit) if encoding else bytes(body)


class BodyPart(BaseModel):
    """An object inside a request body (a message, a tool, an item): unknown keys ignored, frozen, finite numbers."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)


def _described_as_closed(schema: dict[str, Any]) -> None:
    """A body's JSON Schema (/openapi.json) says what `_no_silent_drops` enforces: its fields and the ignored ones, no
    others (pydantic would describe `extra="allow"` as any additional property)."""
    properties = schema.setdefault("properties", {})
    for name in sorted(IGNORED_FIELDS - set(properties)):
        properties[name] = {"description": "Accepted and ignored: it does not change the output."}
    schema["additionalProperties"] = False


class RequestBody(BodyPart):
    """A top-level request body: unknown fields are refused unless they are in IGNORED_FIELDS."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, frozen=True, json_schema_extra=_described_as_closed)
    refused_hints: ClassVar[Mapping[str, str]] = REFUSED_HINTS  # a route's own reasons for the fields it refuses
    ignored_types: ClassVar[Mapping[str, TypeAdapter[Any]]] = IGNORED_TYPES  # a route's own, where its SDK differs

    @model_validator(mode="after")
    def _no_silent_drops(self) -> RequestBody:
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS:
                if not finite(value):  # the JSON parser reads Infinity/NaN into untyped fields: refused everywhere
                    raise PydanticCustomError("finite_number", "{name}: NaN and infinity are not valid JSON numbers",
                                              {"name": name, "param": name})
                _check_ignored(name, value, self.ignored_types.get(name))
                continue
            why = self.refused_hints.get(name, "this server does not support it, and ignoring it could change the "
                                         "output")
            raise PydanticCustomError("unsupported_field", "{name}: unsupported field: {why}",
                                      {"name": name[:64], "why": why, "param": name[:64]})
        return self


def _check_ignored(name: str, value: Any, adapter: TypeAdapter[Any] | None) -> None:
    """An ignored field's value against its documented type (strict: a string is not a bool); a 400 naming it."""
    if adapter is None:
        return
    try:
        adapter.validate_python(value, strict=True)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = _param((name, *error["loc"]))
        raise PydanticCustomError("invalid_value", "{where}: {why}", {"where": where, "why": error["msg"],
                                                                     "param": name}) from None


Body = TypeVar("Body", bound=BaseModel)


def _param(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def _untagged(loc: tuple[int | str, ...], raw: bytes) -> tuple[int | str, ...]:
    """`loc` without the tags pydantic inserts for a discriminated union's member: ('tools', 0, 'function', 'name')
    for a flat `{"type": "function", "name": ...}` is the client's `tools[0].name`. A part is a tag where the body's
    object there has no such key and its `type` is that part (a chat tool's real `function` key is kept)."""
    try:
        node: Any = json.loads(raw)
    except (ValueError, RecursionError):  # what pydantic parsed, Python's parser may still refuse (nesting depth)
        return loc
    kept: list[int | str] = []
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part not in node and node.get("type") == part:
            continue  # a union tag: the same object, one level down in pydantic's path only
        kept.append(part)
        if isinstance(node, dict):
            node = node.get(part) if isinstance(part, str) else None
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(kept)


def parse(model: type[Body], raw: bytes, *, untagged: bool = False) -> Body:
    """Validate a raw JSON body; any problem (bad UTF-8, bad JSON, bad field) is an APIError 400. `untagged`: the
    param leaves out discriminated unions' tags (`_untagged`): the Responses API names a flat tool's field
    `tools[0].name`, while the Messages API's params keep them (`messages[0].content[1].image.source.base64.data`,
    the block's and the source's type, as its tests and docs name them)."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"The body is not valid JSON: {error['msg']}", code="invalid_json") from None
        if error["type"] == "model_type" and not error["loc"]:
            raise APIError(400, "The body must be a JSON object.", code="invalid_json") from None
        ctx = error.get("ctx") or {}
        loc = _untagged(tuple(error["loc"]), raw) if untagged else tuple(error["loc"])
        named = ctx.get("param", ctx.get("loc"))  # our custom errors name their field in ctx
        param = _param(loc if named is None else (*loc, named))
        message = error["msg"].removeprefix("Value error, ")
        if named is not None:  # the message already names the field; prefix the path that leads to it
            prefix = _param(loc)
            message = f"{prefix}.{message}" if prefix else message
        elif param:
            message = f"{param}: {message}"
        raise APIError(400, message, param=param, code="invalid_value") from None
