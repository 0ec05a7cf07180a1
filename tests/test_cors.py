"""CORS (issue 17): Starlette's CORSMiddleware, off by default, around the whole app, so that error answers (401, 404,
429, and a 500 from Starlette's outermost error middleware) carry the headers too; the preflight needs no key, the real
request still does. The browser half of the proof is tests/test_cors_browser.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.testclient import TestClient

from server.__main__ import build_parser
from server.api.app import create_app
from server.app.page import chat_page_html
from server.app.runtime import build_engine
from server.config import Settings
from tests.support.api_fixtures import API_KEY, LiveServer, live_server, null_host, settings, slow_loader

ORIGIN = "http://front.example:3000"
HI = [{"role": "user", "content": "hi"}]


def preflight(url: str, origin: str = ORIGIN, headers: str = "authorization,content-type") -> httpx.Response:
    return httpx.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": headers}, timeout=10)


@pytest.fixture(scope="module")
def keyed() -> Iterator[LiveServer]:
    with live_server(settings(api_key=API_KEY, allowed_origins=(ORIGIN,))) as live:
        yield live


def test_preflight_is_answered_without_the_key(keyed: LiveServer) -> None:
    r = preflight(f"{keyed.url}/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    # `*` allowed headers: Starlette echoes what the browser asked for, Authorization included
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "Origin" in r.headers["vary"]


def test_the_real_request_still_needs_the_key_and_its_errors_carry_cors(keyed: LiveServer) -> None:
    url = f"{keyed.url}/v1/chat/completions"
    body = {"messages": HI, "max_tokens": 2}
    r = httpx.post(url, json=body, headers={"Origin": ORIGIN}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["access-control-allow-origin"] == ORIGIN  # the page can read why
    r = httpx.post(url, json=body, headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert {"x-request-id", "retry-after"} <= set(r.headers["access-control-expose-headers"].lower().split(", "))
    r = httpx.get(f"{keyed.url}/v1/nothing", headers={"Origin": ORIGIN}, timeout=10)
    assert r.status_code == 404 and r.headers["access-control-allow-origin"] == ORIGIN


def test_another_origin_gets_no_cors_headers(keyed: LiveServer) -> None:
    r = preflight(f"{keyed.url}/v1/chat/completions", origin="http://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{keyed.url}/v1/models", headers={"Origin": "http://evil.example",
                                                        "Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_off_by_default() -> None:
    with live_server(settings()) as live:
        r = preflight(f"{live.url}/v1/chat/completions")
        assert r.status_code == 405 and not any(h.startswith("access-control-") for h in r.headers)
        r = httpx.get(f"{live.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


def test_star_allows_any_origin() -> None:
    with live_server(settings(allowed_origins=("*",))) as live:
        r = preflight(f"{live.url}/v1/completions", origin="http://anywhere.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.get(f"{live.url}/v1/models", headers={"Origin": "http://anywhere.example"}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_methods_and_headers_settings_restrict_the_preflight() -> None:
    config = settings(allowed_origins=(ORIGIN,), allowed_methods=("POST",), allowed_headers=("content-type",))
    with live_server(config) as live:
        assert preflight(f"{live.url}/v1/completions", headers="content-type").status_code == 200
        assert preflight(f"{live.url}/v1/completions", headers="authorization").status_code == 400


def test_queue_full_429_carries_cors() -> None:
    config = settings(allowed_origins=(ORIGIN,), max_queue=1)
    load, _ = slow_loader(null_host(), 0.05)
    live = LiveServer(config, build_engine(null_host(), config, load=load), null_host()).start()
    try:
        with httpx.stream("POST", f"{live.url}/v1/completions", timeout=30,
                          json={"prompt": "A", "max_tokens": 300, "stream": True, "temperature": 0}) as running:
            lines = running.iter_lines()  # kept: a collected iterator would close the stream (and cancel it)
            assert next(line for line in lines if line.startswith("data: "))  # it holds the queue
            r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "B", "max_tokens": 1},
                           headers={"Origin": ORIGIN}, timeout=10)
            assert r.status_code == 429 and r.headers["access-control-allow-origin"] == ORIGIN
    finally:
        live.stop()


def test_a_500_from_the_outermost_error_middleware_carries_cors() -> None:
    config = settings(allowed_origins=(ORIGIN,))
    app = create_app(config, build_engine(null_host(), config), null_host().info, page=chat_page_html())

    async def bug(request: Request) -> Response:  # a bug anywhere in a route: Starlette's ServerErrorMiddleware answers
        raise RuntimeError("a bug")

    app.add_route("/bug", bug)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: this route needs no engine
    r = client.get("/bug", headers={"Origin": ORIGIN})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_settings_from_flags_and_env() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", "http://a.example, http://b.example"])
    config = Settings.from_cli(args, {"ALLOWED_METHODS": "GET,POST,OPTIONS", "ALLOWED_ORIGINS": "http://ignored"})
    assert config.allowed_origins == ("http://a.example", "http://b.example")  # the flag wins
    assert config.allowed_methods == ("GET", "POST", "OPTIONS") and config.allowed_headers == ("*",)
    assert Settings.from_cli(parser.parse_args(["serve"]), {}).allowed_origins == ()  # off


# ------------------------------------------------------------------ --allow-credentials (issue 26)

COOKIE = {"Cookie": "session=abc"}  # what a page's fetch(..., {credentials: 'include'}) sends along


def test_credentials_are_off_by_default() -> None:
    with live_server(settings(allowed_origins=(ORIGIN,))) as live:
        r = preflight(f"{live.url}/v1/chat/completions")
        assert r.status_code == 200 and "access-control-allow-credentials" not in r.headers
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                       headers={"Origin": ORIGIN, **COOKIE}, timeout=30)
        assert r.status_code == 200 and "access-control-allow-credentials" not in r.headers


def test_a_credentialed_preflight_and_request_from_an_allowed_origin() -> None:
    with live_server(settings(api_key=API_KEY, allowed_origins=(ORIGIN,), allow_credentials=True)) as live:
        url = f"{live.url}/v1/chat/completions"
        r = preflight(url)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-origin"] == ORIGIN  # never `*` with credentials
        r = httpx.post(url, json={"messages": HI, "max_tokens": 2}, timeout=30,
                       headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}", **COOKIE})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-origin"] == ORIGIN and "Origin" in r.headers["vary"]
        # Credentials are no key: a cookie alone is still a 401, readable by the page.
        r = httpx.post(url, json={"messages": HI, "max_tokens": 2}, headers={"Origin": ORIGIN, **COOKIE}, timeout=30)
        assert r.status_code == 401 and r.headers["access-control-allow-credentials"] == "true"
        # Another origin is not allowed, credentials or not.
        r = preflight(url, origin="http://evil.example")
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_star_with_credentials_echoes_every_origin() -> None:
    """Starlette's behaviour, documented in docs/api.md: a browser refuses `*` with credentials, so the middleware
    answers each origin with itself, and every page may call with its credentials."""
    with live_server(settings(allowed_origins=("*",), allow_credentials=True)) as live:
        anywhere = "http://anywhere.example"
        r = preflight(f"{live.url}/v1/completions", origin=anywhere)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == anywhere
        assert r.headers["access-control-allow-credentials"] == "true"
        r = httpx.get(f"{live.url}/v1/models", headers={"Origin": anywhere, **COOKIE}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == anywhere
        assert r.headers["access-control-allow-credentials"] == "true"


def test_allow_credentials_flag_and_env() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--allowed-origins", ORIGIN, "--allow-credentials"])
    assert Settings.from_cli(args, {}).allow_credentials is True
    args = parser.parse_args(["serve"])
    assert Settings.from_cli(args, {"ALLOW_CREDENTIALS": "1"}).allow_credentials is True
    assert Settings.from_cli(args, {}).allow_credentials is False
