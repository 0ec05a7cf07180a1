"""Server-sent events: the one framing function, and the streaming response that owns one engine request.

Framing is OpenAI's (and vLLM's): `data: <compact JSON>\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end,
keep-alive pings as SSE comments (`: ping\\n\\n`), which every SSE client skips.

`GenerationStream` is sse-starlette's `EventSourceResponse` (disconnect detection, pings, send lock) plus one
guarantee: however the response ends (finished, client gone, send failed, server shutting down), the engine
request is cancelled, so the device moves on within one step. The body generator's own `finally` is not
enough for that: a generator that was never started (client gone before the first chunk) never runs it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from sse_starlette.event import ServerSentEvent
from sse_starlette.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send

DONE = "[DONE]"
T = TypeVar("T")


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


async def with_keepalive(source: AsyncIterator[T], every_s: float) -> AsyncIterator[T | None]:
    """`source`'s items, and None each time `every_s` passes without one (the caller sends its protocol's own ping:
    Anthropic's `ping` event, while a long prompt is prefilled or waits for a slot). The pending item is awaited as a
    task, never cancelled by a timeout (that would close `source` mid-stream); it is cancelled only when the caller
    stops listening, which closes `source` (and so releases its request)."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait((pending,), timeout=every_s)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
