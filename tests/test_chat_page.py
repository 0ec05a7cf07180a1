"""The chat page at `GET /`, in a real headless browser (Debian's `chromium`, driven by Playwright; no browser
download) against live servers on 127.0.0.1: the demo model for streaming and prefix reuse, the null graph for
Stop (slowed by `null_step_ms`), auth and errors.

`reasoning_content` is tested twice: against the real server (the tiny Gemma-4 behind a graph that forces a thought,
then an answer) and, for what the page re-sends, against a stand-in API defined here (a tiny Starlette app that
serves the real page and streams chunks carrying it).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from playwright.sync_api import Page
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server.__main__ import build_parser
from server.api.page import chat_page
from server.app.page import chat_page_html
from server.app.runtime import build_engine
from server.config import Settings
from tests.support import browser as support_browser
from tests.support.api_fixtures import API_KEY, LiveServer, hf_host, live_server, metric, null_host, settings, slow_loader
from tests.support.wait import wait_until

# ------------------------------------------------------------------ helpers


browser, page = support_browser.browser, support_browser.page  # shared fixtures (pytest finds them by name)


def record_answer_states(page: Page) -> None:
    """Every text the last assistant message shows, in order, collected in the page as it changes."""
    page.evaluate("""() => {
        window.__states = [];
        new MutationObserver(() => {
            const boxes = document.querySelectorAll('.msg.assistant .content');
            const text = boxes.length ? boxes[boxes.length - 1].textContent : '';
            if (window.__states.at(-1) !== text) window.__states.push(text);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")


def say(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page: Page) -> Any:
    return page.locator(".msg.assistant").last


STATS = re.compile(r"TTFT (\d+\.\d\d) s · (\d+) tokens · (\d+(?:\.\d+)?) tokens/s")


# ------------------------------------------------------------------ serving the page (HTTP only)


def test_page_is_served_without_the_key_while_the_api_still_needs_it() -> None:
    with live_server(settings(api_key=API_KEY)) as live:
        r = httpx.get(f"{live.url}/", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        assert httpx.get(f"{live.url}/v1/models", timeout=10).status_code == 401
        # one self-contained file: nothing to load from anywhere, this server's API only
        assert not re.search(r"https?://|\b(?:src|href)\s*=", r.text)
        assert "<script>" in r.text and "<style>" in r.text


def test_no_ui_turns_the_page_off() -> None:
    with live_server(settings(no_ui=True)) as live:
        r = httpx.get(f"{live.url}/", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    ([], {}, False),
    (["--no-ui"], {}, True),
    ([], {"NO_UI": "1"}, True),
    ([], {"NO_UI": "false"}, False),
    (["--no-ui"], {"NO_UI": "0"}, True),  # the flag wins
])
def test_no_ui_flag_and_env(argv: list[str], environ: dict[str, str], expected: bool) -> None:
    args = build_parser().parse_args(["serve", *argv])
    assert Settings.from_cli(args, environ).no_ui is expected


def test_no_ui_env_refuses_a_value_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="NO_UI"):
        Settings.from_cli(build_parser().parse_args(["serve"]), {"NO_UI": "maybe"})


# ------------------------------------------------------------------ the page in a browser, real servers


@pytest.fixture(scope="module")
def real() -> Iterator[LiveServer]:
    host = hf_host()
    config = settings(graph="hf")
    with live_server(config, build_engine(host, config), host) as live:
        yield live


def test_browser_streams_the_demo_model_and_resends_the_conversation(real: LiveServer, page: Page,
                                                                     tmp_path: Path) -> None:
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{real.url}/")
    page.wait_for_selector("#model:has-text('gemma-test')")
    page.fill("#system", "You are terse.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    record_answer_states(page)
    say(page, "Name three colours.")
    answer = last_answer(page)
    answer.locator(".stats").wait_for()

    text = answer.locator(".content").text_content()
    expected = httpx.post(f"{real.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
        "max_tokens": 24, "temperature": 0}).json()
    assert text == expected["choices"][0]["message"]["content"] and text
    # streamed: the answer grew on screen through several partial texts before the last one
    states = [s for s in page.evaluate("window.__states") if s]
    assert len(states) >= 3 and states[-1] == text, states
    assert all(text.startswith(s) for s in states)
    stats = STATS.search(answer.locator(".stats").text_content() or "")
    assert stats, answer.locator(".stats").text_content()
    assert int(stats.group(2)) == expected["usage"]["completion_tokens"] and float(stats.group(3)) > 0

    # The second turn re-sends the first (system, question, answer): the server reuses that prefix from its cache.
    reused = metric(real.url, "gemma4_prefix_cache_hit_tokens_total")
    say(page, "Three more?")
    page.locator(".msg.assistant .stats").nth(1).wait_for()
    assert metric(real.url, "gemma4_prefix_cache_hit_tokens_total") - reused >= expected["usage"]["prompt_tokens"]

    # the page fetched nothing but this server's page and API
    assert requested and all(url.startswith(f"{real.url}/") for url in requested), requested
    assert f"{real.url}/v1/chat/completions" in requested

    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"screenshot: {shot}")


def test_browser_stop_cancels_the_request_on_the_server(page: Page, tmp_path: Path) -> None:
    host = null_host()
    config = settings(null_step_ms=40.0)  # the null graph made slow: ~25 tokens/s, an answer of 2000 never ends
    with live_server(config, build_engine(host, config), host) as live:
        page.goto(f"{live.url}/")
        page.fill("#max-tokens", "2000")
        say(page, "Talk for a long time.")
        answer = last_answer(page)
        page.wait_for_function("() => document.querySelector('.msg.assistant .content').textContent.length >= 10")
        assert metric(live.url, "gemma4_requests_running") == 1
        page.click("#stop")

        # The server saw the disconnect and cancelled the request: the device is free again.
        wait_until(lambda: metric(live.url, "gemma4_requests_finished_total", reason="cancelled") == 1,
                   "the request to be cancelled on the server", timeout=60)
        assert metric(live.url, "gemma4_requests_running") == 0
        assert metric(live.url, "gemma4_generation_tokens_total") < 2000
        assert "stopped" in (answer.locator(".stats").text_content() or "")
        assert page.is_enabled("#send") and page.is_disabled("#stop")
        page.screenshot(path=str(tmp_path / "stopped.png"))


def test_browser_asks_for_the_key_on_401_and_shows_the_servers_errors(page: Page) -> None:
    with live_server(settings(api_key=API_KEY)) as live:
        page.goto(f"{live.url}/")
        page.wait_for_selector("#key-box", state="visible")  # /v1/models answered 401
        unauthorized = httpx.get(f"{live.url}/v1/models", timeout=10).json()["error"]["message"]
        assert page.text_content("#notice") == unauthorized

        say(page, "Hello")  # without the key: the turn is taken back, ready to send again
        page.wait_for_function("() => document.getElementById('prompt').value === 'Hello'")
        assert page.locator(".msg").count() == 0

        page.fill("#api-key", API_KEY)
        page.fill("#max-tokens", "5")
        page.press("#prompt", "Enter")
        answer = last_answer(page)
        answer.locator(".stats").wait_for()
        assert (answer.locator(".content").text_content() or "").strip()
        assert " 5 tokens " in (answer.locator(".stats").text_content() or "")
        assert page.locator(".msg.user").count() == 1

        # An invalid field: the page shows the server's own message.
        page.fill("#temperature", "5")
        say(page, "Again")
        error = last_answer(page).locator(".error")
        error.wait_for()
        refused = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                             json={"messages": [{"role": "user", "content": "Again"}], "temperature": 5},
                             timeout=10).json()["error"]["message"]
        assert error.text_content() == refused


def test_browser_shows_an_in_band_stream_error(page: Page) -> None:
    host = null_host()
    load, _ = slow_loader(host, 0.02, fail_after=4)  # the device fails mid-answer, after the headers were sent
    config = settings()
    with live_server(config, build_engine(host, config, load=load), host) as live:
        page.goto(f"{live.url}/")
        page.fill("#max-tokens", "50")
        say(page, "Hello")
        answer = last_answer(page)
        answer.locator(".error").wait_for()
        assert (answer.locator(".content").text_content() or "").strip()  # tokens came before the fault
        # the page shows the message the server sent in-band (the device keeps failing: ask again to read it)
        stream = httpx.post(f"{live.url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50, "stream": True}).text
        in_band = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith('data: {"error"')]
        assert len(in_band) == 1 and "simulated device fault" in in_band[0]["error"]["message"]
        assert answer.locator(".error").text_content() == in_band[0]["error"]["message"]


# ------------------------------------------------------------------ reasoning_content, against a stand-in API


REASONING = ["Let me think.", " The user greets me."]
ANSWER = ["Hello", " there!"]


def standin_api(bodies: list[dict[str, Any]]) -> Starlette:
    """What our API will stream once reasoning lands: `delta.reasoning_content` chunks, then `delta.content`."""

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model", "max_model_len": 512}]})

    async def chat(request: Request) -> Response:
        bodies.append(await request.json())

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            body = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 0, "model": "standin",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(body)}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            yield chunk({"role": "assistant", "content": ""})
            for piece in REASONING:
                yield chunk({"reasoning_content": piece})
            for piece in ANSWER:
                yield chunk({"content": piece})
            yield chunk({}, "stop")
            usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/", chat_page(chat_page_html())), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"])])


@contextmanager
def serving(app: Starlette) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the stand-in to start")
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_browser_shows_reasoning_collapsed_above_the_answer(page: Page, tmp_path: Path) -> None:
    bodies: list[dict[str, Any]] = []
    with serving(standin_api(bodies)) as url:
        page.goto(f"{url}/")
        page.wait_for_selector("#model:has-text('standin')")
        page.fill("#system", "Be kind.")
        page.fill("#temperature", "0.7")
        page.fill("#max-tokens", "64")
        say(page, "Hi")
        answer = last_answer(page)
        answer.locator(".stats").wait_for()

        details = answer.locator("details.reasoning")
        assert details.count() == 1 and details.get_attribute("open") is None  # collapsed
        assert not answer.locator(".thoughts").is_visible()
        assert answer.locator(".thoughts").text_content() == "".join(REASONING)
        assert answer.locator(".content").text_content() == "".join(ANSWER)
        # above the answer
        assert answer.evaluate("box => box.querySelector('details').compareDocumentPosition("
                               "box.querySelector('.content')) & Node.DOCUMENT_POSITION_FOLLOWING") != 0
        assert STATS.search(answer.locator(".stats").text_content() or "")
        answer.locator("summary").click()
        assert answer.locator(".thoughts").is_visible()
        page.screenshot(path=str(tmp_path / "reasoning.png"))

        # The next turn re-sends the whole conversation (the answer, not its reasoning) with the settings.
        say(page, "And you?")
        page.locator(".msg.assistant .stats").nth(1).wait_for()
        assert bodies[1]["messages"] == [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "".join(ANSWER)},
            {"role": "user", "content": "And you?"},
        ]
        assert bodies[1]["temperature"] == 0.7 and bodies[1]["max_tokens"] == 64 and bodies[1]["stream"] is True


# ------------------------------------------------------------------ reasoning from the real server (Gemma-4 protocol)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any, Any]]:
    """The tiny random Gemma-4 with the Gemma-4 tokenizer and template, behind a graph that forces a script."""
    from server.app.runtime import graph_loader
    from tests.support.gemma4_app import gemma4_host, gemma4_server
    from tests.test_api_gemma4 import ScriptedGraph

    host = gemma4_host(tmp_path_factory.mktemp("gemma4"))
    graph = ScriptedGraph(graph_loader(host)())
    with gemma4_server(host, graph, prefix_reuse=False, wait_grammar=False) as live:
        yield live, host, graph


def test_browser_shows_the_servers_reasoning_collapsed_above_the_answer(gemma4: tuple[LiveServer, Any, Any],
                                                                         page: Page, tmp_path: Path) -> None:
    """The page against the real API: Gemma-4's thought channel arrives as delta.reasoning_content and is shown
    collapsed above the answer, never inside it."""
    live, host, graph = gemma4
    graph.script = host.tokenizer.encode("<|channel>thought\nTwo plus two is four.<channel|>It is 4.<turn|>",
                                         add_special_tokens=False)
    try:
        page.goto(f"{live.url}/")
        say(page, "What is 2 + 2?")
        answer = last_answer(page)
        answer.locator(".stats").wait_for()
        details = answer.locator("details.reasoning")
        assert details.count() == 1 and details.get_attribute("open") is None  # collapsed
        assert answer.locator(".thoughts").text_content() == "Two plus two is four."
        assert answer.locator(".content").text_content() == "It is 4."
        assert answer.evaluate("box => box.querySelector('details').compareDocumentPosition("
                               "box.querySelector('.content')) & Node.DOCUMENT_POSITION_FOLLOWING") != 0
        answer.locator("summary").click()
        assert answer.locator(".thoughts").is_visible()
        page.screenshot(path=str(tmp_path / "reasoning-real.png"))
    finally:
        graph.script = None
