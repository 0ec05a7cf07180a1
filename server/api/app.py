"""`create_app(settings, engine, model) -> Starlette`: routes, auth, request ids, metrics, one error handler.

The lifespan starts the engine (which loads the graph on its own thread: `/health` answers `loading`
meanwhile) and stops it on shutdown. `app.state.drain(grace_s)` is the graceful-shutdown entry point that
`serve()` calls on SIGTERM (and tests call in-process).

Deliberate choices:
- Every error, ours (`APIError`) or Starlette's (404 unknown route, 405 wrong method) or a bug (500), goes
  through `error_response`, so clients always get OpenAI's `{"error": {...}}`, or Anthropic's shape
  (`{"type": "error", "error": {...}}`) under the Messages API's paths (`ANTHROPIC_PATHS`): one shape per wire protocol,
  picked by route, whoever raised the error (auth, the body limits, the queue, the model name).
- Auth wraps the protected endpoints rather than being a middleware, so a bad key is an `APIError` like any
  other. `/health` and `/metrics` stay open (load balancers and scrapers carry no key), and so does the chat page
  at `/` (it holds no secret; it asks for the key when the API says 401).
- Middlewares are plain ASGI (not `BaseHTTPMiddleware`), so streams and disconnect detection pass untouched.
- CORS (off unless `allowed_origins` is set) is Starlette's `CORSMiddleware`, wrapped around the whole stack,
  Starlette's own outermost error middleware included: every answer carries the CORS headers, a 500 too (a browser
  cannot read an error it is not allowed to see). A preflight is answered there, before auth (browsers send no
  credentials on it); the real request still needs the key. Credentials (`--allow-credentials`) are off by default.
"""

from __future__ import annotations

import functools
import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.chat.constraints import OutputConstraints
from server.api.chat.prompts import Prompts
from server.api.chat.routes import OpenAIRoutes
from server.api.given import EngineAPI, ModelInfo
from server.api.messages.routes import MessagesRoutes
from server.api.metrics import Metrics, MetricsMiddleware
from server.api.openapi import describe
from server.api.page import chat_page
from server.api.responses.routes import ResponsesRoutes
from server.api.responses.store import ResponseStore
from server.api.service import Service
from server.config import Settings
from server.errors import AnthropicError, APIError

Endpoint = Callable[[Request], Awaitable[Response]]

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
ANTHROPIC_PATHS = ("/v1/messages",)  # this prefix and below: Anthropic's error shape

log = logging.getLogger("server.api")


async def error_response(request: Request, exc: Exception) -> Response:
    """The one error handler: APIError as is; Starlette's HTTP errors and unexpected exceptions mapped to it."""
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            exc = APIError(404, f"Not found: {request.method} {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            exc = APIError(405, f"Method {request.method} is not allowed for {request.url.path}",
                           code="method_not_allowed", headers=dict(exc.headers or {}))
        else:
            exc = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    request_id = request.scope.get("state", {}).get("request_id", "-")
    if not isinstance(exc, APIError):  # a bug: Starlette re-raises it after this answer, and uvicorn logs it
        # This answer leaves through Starlette's outermost middleware, outside RequestIdMiddleware: add the id here.
        exc = APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error",
                       headers={"X-Request-Id": request_id})
    # One line per error response: client mistakes at info, back-pressure (429, 503 not ready) at warning, ours at error.
    level = logging.WARNING if exc.status in (429, 503) else logging.ERROR if exc.status >= 500 else logging.INFO
    log.log(level, "%s: %s %s -> %d %s: %s", request_id, request.method, _clip(request.url.path, 200), exc.status,
            exc.code or exc.type, _clip(exc.message, 300))
    path = request.url.path
    if any(path == prefix or path.startswith(prefix + "/") for prefix in ANTHROPIC_PATHS):
        exc = AnthropicError.of(exc, request_id)
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=exc.headers)


def _clip(text: str, limit: int) -> str:
    """Client-supplied text as one bounded log line (a 2 MB model name, or a newline, must not flood or forge lines)."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text


class RequestIdMiddleware:
    """Takes the client's `X-Request-Id` (if sane) or makes one, and a fresh `completion_id` (unique per request
    whatever the client sends): both in `request.state`, the id in every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        fresh = uuid.uuid4().hex
        request_id = given if _REQUEST_ID.fullmatch(given) else fresh
        # The client's id is echoed, never reused as a completion id: a client that sends one value twice must still
        # get two distinct `chatcmpl-`/`cmpl-` ids. Without a client id, the two are the same fresh one.
        scope.setdefault("state", {}).update(request_id=request_id, completion_id=fresh)
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _require_key(api_key: str | None, endpoint: Endpoint) -> Endpoint:
    """`Authorization: Bearer KEY` or `X-Api-Key: KEY` (Anthropic's clients send the one or the other: `ANTHROPIC_AUTH_TOKEN`
    / `ANTHROPIC_API_KEY`), compared in constant time."""
    if not api_key:
        return endpoint
    expected = api_key.encode()

    async def guarded(request: Request) -> Response:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        candidates = [token.strip()] if scheme.lower() == "bearer" else []
        candidates.append(request.headers.get("x-api-key", ""))
        # Starlette decodes header bytes as latin-1; encoding back gives the bytes the client sent (UTF-8 for a
        # non-ASCII key), compared in constant time with the key's UTF-8 bytes.
        if not any(hmac.compare_digest(c.encode("latin-1"), expected) for c in candidates if c):
            raise APIError(401, "Invalid or missing API key (send `Authorization: Bearer <key>` or `X-Api-Key`).",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await endpoint(request)

    return guarded


class _App(Starlette):
    """Starlette with CORS (when `allowed_origins` is set) outside its whole middleware stack, error middleware included."""

    def __init__(self, *args: object, settings: Settings, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._settings = settings

    def build_middleware_stack(self) -> ASGIApp:
        stack = super().build_middleware_stack()
        s = self._settings
        if not s.allowed_origins:
            return stack
        # The key travels in a header, which the allowed headers must include; credentials (cookies, HTTP auth: what a
        # proxy in front may check) only with --allow-credentials. Starlette then answers a `*` origin list with the
        # request's own origin (a browser refuses `*` with credentials): every origin may call with its credentials.
        return CORSMiddleware(stack, allow_origins=list(s.allowed_origins), allow_methods=list(s.allowed_methods),
                              allow_headers=list(s.allowed_headers), allow_credentials=s.allow_credentials,
                              expose_headers=["X-Request-Id", "Retry-After"], max_age=600)


def create_app(settings: Settings, engine: EngineAPI, model: ModelInfo, *, page: bytes | None = None) -> Starlette:
    """`page`: the chat page's HTML served at `/` (server.app.page reads it; None or `--no-ui`: no page)."""
    metrics = Metrics(engine)
    service, prompts = Service(settings, engine, metrics), Prompts(model)
    constraints = OutputConstraints(model.protocol, model.grammar)
    api = OpenAIRoutes(service, prompts, constraints)
    responses = ResponsesRoutes(service, api, ResponseStore(settings.responses_store_max, settings.responses_store_bytes))
    messages = MessagesRoutes(service, api, images_off=None if model.images is not None else model.images_off)

    async def health(request: Request) -> Response:
        state = engine.state
        body = {"status": state} if state == "ok" else {"status": state, "reason": engine.state_reason or state}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(description)

    protected = functools.partial(_require_key, settings.api_key)
    routes = [
        Route("/v1/chat/completions", protected(api.chat_completions), methods=["POST"]),
        Route("/v1/completions", protected(api.completions), methods=["POST"]),
        Route("/v1/responses", protected(responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", protected(responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}/input_items", protected(responses.input_items), methods=["GET"]),
        Route("/v1/responses/{response_id}", protected(responses.delete), methods=["DELETE"]),
        Route("/v1/messages", protected(messages.create), methods=["POST"]),
        Route("/v1/messages/count_tokens", protected(messages.count_tokens), methods=["POST"]),
        Route("/generate", protected(api.generate), methods=["POST"]),
        Route("/v1/models", protected(api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", protected(api.model), methods=["GET"]),
        Route("/tokenize", protected(api.tokenize), methods=["POST"]),
        Route("/detokenize", protected(api.detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        *([] if settings.no_ui or page is None else [Route("/", chat_page(page), methods=["GET"])]),  # open: no secret
    ]
    # Open like /health: the description holds no secret, and clients and fuzzers read it before they have a key.
    routes.append(Route("/openapi.json", openapi_json, methods=["GET"]))
    # Built once from the route table itself (a route without a description fails here, at start-up, not in a client).
    description = describe(routes, title=f"gemma4-optb: {model.name}", version="0.1.0", keyed=bool(settings.api_key))
    known = frozenset(r.path for r in routes if "{" not in r.path)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()  # loads the graph on the device thread; /health says "loading" meanwhile
        if not settings.lazy_grammar:
            constraints.start()  # the grammar vocabulary, alongside the graph load (see README)
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(engine.stop)

    app = _App(
        routes=routes,
        settings=settings,
        middleware=[Middleware(MetricsMiddleware, metrics=metrics, routes=known), Middleware(RequestIdMiddleware)],
        exception_handlers={APIError: error_response, HTTPException: error_response, Exception: error_response},
        lifespan=lifespan,
    )
    app.state.drain = service.drain
    app.state.service, app.state.prompts, app.state.grammar = service, prompts, model.grammar
    app.state.response_store = responses.store
    return app
