"""The server's exceptions, and how `APIError` maps to OpenAI's error JSON.

Everything a client can cause raises `APIError` (or `InvalidRequest` below the API, which maps it to a 400); one
handler in `api/` turns it into `{"error": {"message", "type", "param", "code"}}` with the right status. Internal
invariants use `assert`.
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
