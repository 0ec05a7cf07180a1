"""CORS in a real browser (issue 17's proof): a page served from a second local origin (another 127.0.0.1 port) calls
the API with `fetch`, in Debian's chromium driven by Playwright (as tests/test_chat_page.py). Allowed when that origin
is configured (and the key, sent as a header, still checked); refused by the browser when it is not."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from playwright.sync_api import Browser
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import Route

from tests.support.api_fixtures import API_KEY, free_port, live_server, settings
from tests.support.browser import launched_chromium
from tests.support.wait import wait_until

# What a front-end on another origin does: a JSON POST with a bearer key (both make the browser send a preflight).
CALL = """async ([url, key, credentials]) => {
    try {
        const r = await fetch(url + '/v1/chat/completions', {
            method: 'POST', credentials: credentials,
            headers: {'Content-Type': 'application/json', ...(key ? {'Authorization': 'Bearer ' + key} : {})},
            body: JSON.stringify({messages: [{role: 'user', content: 'hi'}], max_tokens: 3}),
        });
        return {status: r.status, body: await r.json(), requestId: r.headers.get('X-Request-Id')};
    } catch (e) {
        return {failed: String(e)};
    }
}"""


@contextmanager
def front_end() -> Iterator[str]:
    """A tiny page on a second origin: http://127.0.0.1:<another port>/."""

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse("<!doctype html><title>front end</title><p>another origin</p>")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/", index)]), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="front-end", daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the front-end server to start", 30, alive=thread.is_alive)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launched_chromium() as launched:
        yield launched


def call_from(browser: Browser, origin: str, api_url: str, key: str | None, credentials: str = "same-origin") -> Any:
    """`credentials`: fetch's mode ("same-origin", its default; "include": cookies and HTTP auth go along)."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{origin}/")
        assert page.evaluate("location.origin") == origin and origin != api_url  # two origins
        return page.evaluate(CALL, [api_url, key, credentials])
    finally:
        context.close()


def test_a_configured_origin_may_call_the_api_with_its_key(browser: Browser) -> None:
    with front_end() as origin, live_server(settings(allowed_origins=(origin,), api_key=API_KEY)) as api:
        answer = call_from(browser, origin, api.url, API_KEY)
        assert answer.get("status") == 200, answer
        assert answer["body"]["choices"][0]["message"]["content"] and answer["requestId"]  # exposed header
        # without the key: the browser is let through CORS, and reads the server's 401
        answer = call_from(browser, origin, api.url, None)
        assert answer.get("status") == 401 and answer["body"]["error"]["code"] == "invalid_api_key", answer


def test_an_origin_not_configured_is_refused_by_the_browser(browser: Browser) -> None:
    with front_end() as origin:
        for config in (settings(), settings(allowed_origins=("http://127.0.0.1:1",))):  # off; another origin only
            with live_server(config) as api:
                answer = call_from(browser, origin, api.url, None)
                assert answer == {"failed": "TypeError: Failed to fetch"}, answer


def test_a_credentialed_call_needs_allow_credentials(browser: Browser) -> None:
    """fetch with `credentials: 'include'` (a page behind a cookie-checking proxy): the browser refuses the answer
    unless it says Access-Control-Allow-Credentials: true (issue 26's --allow-credentials)."""
    with front_end() as origin:
        with live_server(settings(allowed_origins=(origin,))) as api:
            assert call_from(browser, origin, api.url, None, "include") == {"failed": "TypeError: Failed to fetch"}
            assert call_from(browser, origin, api.url, None).get("status") == 200  # the same call, without credentials
        for allowed in ((origin,), ("*",)):  # `*`: Starlette echoes the origin, which a credentialed call needs
            with live_server(settings(allowed_origins=allowed, allow_credentials=True)) as api:
                answer = call_from(browser, origin, api.url, None, "include")
                assert answer.get("status") == 200 and answer["body"]["choices"][0]["message"]["content"], answer
