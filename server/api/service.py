"""What the routes drive (`Service`): the engine's requests and their answers (a stream, or one JSON body), their
metrics and logging, client disconnects and drain.

The engine's refusals and a Finish's errors become HTTP statuses here (`engine_error`, `finish_error`), nowhere else.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.given import EngineAPI
from server.api.metrics import Metrics
from server.api.sse import GenerationStream
from server.config import Settings
from server.engine.types import (
    Completion,
    Delta,
    EngineError,
    EngineNotReady,
    Event,
    Finish,
    GenerationRequest,
    QueueFull,
    RequestHandle,
    collect,
)
from server.errors import APIError

log = logging.getLogger("server.api")


class Service:
    def __init__(self, settings: Settings, engine: EngineAPI, metrics: Metrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self._waiters: dict[RequestHandle, asyncio.Task[None]] = {}  # released requests awaiting their Finish

    def submit(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """All or none (a request's choices are admitted together, back to back)."""
        try:
            return self.engine.submit_all(requests)
        except EngineError as exc:
            raise engine_error(exc) from None

    async def events(self, handle: RequestHandle) -> AsyncIterator[Event]:
        """The engine's events, with the metrics and the one log line per request. A Finish that is an error (the
        generation failed, or was cancelled at shutdown) is raised as its APIError (`finish_error`) instead.

        A caller that stops listening early (client gone) releases the request (see `release`)."""
        last: float | None = None
        finished = False
        try:
            async for event in handle.events():
                if isinstance(event, Delta) and event.token_id is not None:
                    now = time.monotonic()
                    if last is not None:
                        self.metrics.itl.observe(now - last)
                    last = now
                elif isinstance(event, Finish):
                    finished = True
                    self._finished(handle, event)
                    error = finish_error(event)
                    if error is not None:
                        raise error
                yield event
        finally:
            if not finished:
                self.release(handle)

    def release(self, *handles: RequestHandle) -> None:
        """The caller is gone: cancel the requests (frees the device within one step) and still count and log each
        Finish when it comes. A no-op for requests already finished or released."""
        for handle in handles:
            if handle.delivered or handle in self._waiters:
                continue
            handle.cancel()
            task = asyncio.ensure_future(self._await_finish(handle))
            self._waiters[handle] = task
            task.add_done_callback(functools.partial(self._waiters.pop, handle))  # pop(handle, task): never raises

    async def _await_finish(self, handle: RequestHandle) -> None:
        try:
            async with asyncio.timeout(self.settings.step_timeout_s + 10):
                async for event in handle.events():
                    if isinstance(event, Finish):
                        self._finished(handle, event)
        except TimeoutError:
            log.error("%s: no Finish from the engine after cancelling", handle.request.request_id)

    def _finished(self, handle: RequestHandle, finish: Finish) -> None:
        self.metrics.observe_finish(finish)
        decode_s = finish.total_s - (finish.ttft_s or finish.total_s)
        rate = (finish.completion_tokens - 1) / decode_s if finish.completion_tokens > 1 and decode_s > 0 else 0.0
        ttft = f"{finish.ttft_s:.3f}s" if finish.ttft_s is not None else "-"
        log.info("%s: prompt=%d reused=%d completion=%d ttft=%s tok/s=%.1f queue=%.3fs total=%.3fs finish=%s%s%s",
                 handle.request.request_id, finish.prompt_tokens, finish.reused_tokens, finish.completion_tokens,
                 ttft, rate, finish.queue_wait_s, finish.total_s, finish.reason,
                 " (wall-clock limit)" if finish.timed_out else "", f" error={finish.error}" if finish.error else "")

    async def answer(self, request: Request, handles: Sequence[RequestHandle], stream: AsyncIterator[bytes] | None,
                     whole: Callable[[list[Completion]], dict[str, Any]]) -> Response:
        """How every generation route answers one request's choices: `stream`, released however it ends; or without
        one, the choices run to their end and `whole` of them as the JSON body, all cancelled at once if the client
        disconnects meanwhile (then 499). A choice that ended in an error raises it (see `events`)."""
        if stream is not None:
            return GenerationStream(stream, functools.partial(self.release, *handles), ping_s=self.settings.sse_ping_s)
        consumer = asyncio.ensure_future(asyncio.gather(*(collect(self.events(handle)) for handle in handles)))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((consumer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                for handle in handles:
                    handle.cancel()
                consumer.cancel()
        if not consumer.done() or consumer.cancelled():
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        return JSONResponse(whole(consumer.result()))

    def stream_failure(self, exc: Exception, stream_id: str) -> APIError:
        """A stream that failed after its headers were sent: counted, logged if it is a bug, and the APIError the
        stream reports in-band (each API in its own shape)."""
        if isinstance(exc, APIError):
            self.metrics.errors.labels(str(exc.status)).inc()
            return exc
        self.metrics.errors.labels("500").inc()
        log.error("stream %s failed", stream_id, exc_info=exc)
        return APIError(500, f"Internal error: {type(exc).__name__}")

    async def drain(self, grace_s: float) -> bool:
        """Stop admitting (health says draining, new requests 503); let in-flight requests finish for up to
        `grace_s`, then cancel the rest. True when the engine went idle."""
        self.engine.drain()
        log.info("draining: %d request(s) in flight, up to %g s", self.engine.admitted, grace_s)
        if await self.engine.wait_idle(grace_s):
            return True
        log.warning("cancelling %d request(s) still in flight after %g s", len(self.engine.in_flight()), grace_s)
        self.engine.cancel_all()
        return await self.engine.wait_idle(5.0)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. The body is fully read by now, so the next ASGI message the server
    delivers is `http.disconnect` (on a client disconnect, or once the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def finish_error(finish: Finish) -> APIError | None:
    """The error a finish reason means for the client, if any ("stop" and "length" are answers)."""
    if finish.reason == "error":
        return APIError(500, f"Generation failed: {finish.error or 'unknown error'}", code="generation_error")
    if finish.reason == "cancelled":
        return APIError(503, "The request was cancelled: the server is shutting down.", code="cancelled",
                        headers={"Retry-After": "5"})
    return None


def engine_error(exc: EngineError) -> APIError:
    """The engine's refusals as HTTP statuses: the one place they are chosen."""
    headers = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), code="queue_full", headers=headers)
    state = exc.state if isinstance(exc, EngineNotReady) else "error"
    return APIError(503, str(exc), code=f"model_{state}", headers=headers)
