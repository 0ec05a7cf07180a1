"""Server-sent events: the one framing function, and the streaming response that owns one engine request.

Framing is OpenAI's (and vLLM's): `data: <compact JSON>\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end,
keep-alive pings as SSE comments (`: ping\\n\\n`), which every SSE client skips.

`GenerationStream` is sse-starlette's `EventSourceResponse` (disconnect detection, pings, send lock) plus one
guarantee: however the response ends (finished, client gone, send failed, server shutting down), the engine
request is cancelled, so the device moves on within one step. The body generator's own `finally` is not
enough for that: a generator that was never started (client gone before the first chunk) never runs it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable, Mapping
from typing import Any

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send

DONE = "[DONE]"


def frame(payload: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE event: a JSON object (compact, UTF-8) or the literal `[DONE]`; `event`: its `event:` line (the
    Responses API names each event by its type, as OpenAI does)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False,
                                                                  separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


class GenerationStream(EventSourceResponse):
    def __init__(self, body: AsyncIterable[bytes], release: Callable[[], None], *, ping_s: float,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(body, headers=headers, ping=ping_s, sep="\n",
                         ping_message_factory=lambda: ServerSentEvent(comment="ping", sep="\n"))
        self._release = release  # cancels the engine request unless it already finished

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
