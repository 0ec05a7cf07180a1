"""The server's exceptions, and how `APIError` maps to OpenAI's error JSON (and `AnthropicError` to Anthropic's).

Everything a client can cause raises `APIError` (or `InvalidRequest` below the API, which maps it to a 400); one
handler in `api/` turns it into `{"error": {"message", "type", "param", "code"}}` with the right status. Internal
invariants use `assert`. One exception type per wire protocol: the routes of Anthropic's Messages API answer every
error (theirs, or one raised by the shared code they call: auth, body limits, the queue, the model name) as
`AnthropicError`, which the same handler picks by route (`AnthropicError.of`).
"""

from __future__ import annotations

from typing import Any

# OpenAI's error types by status; any other is invalid_request_error (4xx) or server_error (5xx).
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 408: "timeout_error",
          429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Anthropic's error types by status (its "Errors" page); any other 4xx is invalid_request_error, 5xx api_error. A server
# that is loading or draining (503) is "overloaded" in Anthropic's words (its own status for that is 529).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                    403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


class AnthropicError(APIError):
    """An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}, "request_id"}`, the status kept.
    The message names the field (Anthropic's error has no `param`); `param` and `code` stay for the logs."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:  # noqa: A002
        super().__init__(status, message, param=param, code=code, headers=headers,
                         type=type or _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                                           else "invalid_request_error"))
        self.request_id: str | None = None

    @classmethod
    def of(cls, exc: APIError, request_id: str | None = None) -> AnthropicError:
        """`exc` in Anthropic's terms (its type from the status: OpenAI's names differ)."""
        made = exc if isinstance(exc, AnthropicError) else cls(exc.status, exc.message, param=exc.param, code=exc.code,
                                                              headers=exc.headers)
        made.request_id = request_id
        return made

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "error", "error": {"type": self.type, "message": self.message}}
        if self.request_id is not None:
            body["request_id"] = self.request_id
        return body


class ContextOverflow(APIError):
    """A prompt longer than the context can take (it needs one token of room to generate): OpenAI's 400
    `context_length_exceeded`; the Messages API words it as Anthropic does (`anthropic_message`), the one text Claude
    Code acts on (it compacts the conversation). Raised before any engine work, by `context_overflow`."""

    def __init__(self, prompt_tokens: int, max_total: int, param: str | None) -> None:
        super().__init__(400, f"This model's maximum context length is {max_total} tokens and at least one must remain "
                         f"for the completion, but the prompt has {prompt_tokens} tokens.", param=param,
                         code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.maximum = max_total - 1  # the longest prompt that still leaves one token to generate

    @property
    def anthropic_message(self) -> str:
        return f"prompt is too long: {self.prompt_tokens} tokens > {self.maximum} maximum"


def context_overflow(prompt_tokens: int, max_total: int, param: str | None) -> ContextOverflow | None:
    """The error for a prompt of `prompt_tokens` in a context of `max_total`, or None when it fits (leaves at least
    one token for the completion). Every route that renders a prompt checks it here (chat, completions, Messages,
    Responses)."""
    return ContextOverflow(prompt_tokens, max_total, param) if prompt_tokens > max_total - 1 else None


class InvalidRequest(ValueError):
    """A request that a layer below the API cannot honour (the chat protocol, the output constraints): the API
    answers 400 with `message`, naming the offending field in `param`. Shared so that those layers need not know
    each other, nor HTTP."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ArtifactError(Exception):
    """The artifact directory is incomplete or malformed; the message names every problem."""
