"""`GET /`: the chat page, one static file (server/app/static/chat.html) served as it is.

Deliberate choices:
- No API key: the page holds no secret; it asks for a key only when the API answers 401.
- The Content-Security-Policy lets the page talk to this server alone and load nothing from anywhere: the box may
  be offline, and a page that cannot fetch cannot leak a conversation either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def chat_page(html: bytes) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint serving `html` (the page's bytes, read before serving)."""

    async def page(request: Request) -> Response:
        return Response(html, media_type="text/html; charset=utf-8", headers=_HEADERS)

    return page
