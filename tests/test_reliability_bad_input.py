"""The bad-input matrix against a live server: every row gets the right 4xx with OpenAI's error JSON (and no
stack trace), is counted once in `/metrics` under its status and logged once, and the next valid request
succeeds. Rows complement tests/test_api_openai.py (which checks the field-naming of common range errors).

Regressions found here: logit_bias keys like "²" (str.isdigit() but not int()) or of more than 4300 digits
were a 500; a client that vanished in the middle of its request body was a 500 with a traceback (now 499).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.support.api_fixtures import LiveServer, live_server, settings
from tests.support.wait import wait_until

HI = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TEN_MB = 10 * 1024 * 1024
SEEN: Counter[str] = Counter()  # errors the matrix rows produced, by status


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(settings()) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        live.client = client  # type: ignore[attr-defined]  # one client: building one costs ~50 ms (TLS context)
        yield live


@dataclass(frozen=True)
class Row:
    id: str
    path: str
    body: Any = None  # a JSON value, or bytes sent as they are, or an iterator factory (chunked)
    status: int = 400
    param: str | None = field(default=None)
    code: str | None = None
    method: str = "POST"
    check_param: bool = True  # False where the param is not the point (routes, sizes)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": HI, "max_tokens": 1, **fields}


def raw_chat(fragment: bytes) -> bytes:
    """A chat body with `fragment` spliced in as one more field, for what json.dumps cannot write."""
    return b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, ' + fragment + b"}"


def ten_mb_chunks() -> Iterator[bytes]:
    yield b'{"prompt": "'
    for _ in range(TEN_MB // 65536):
        yield b"z" * 65536
    yield b'"}'


ROWS = [
    # --- malformed JSON and bytes
    Row("trailing-comma", CHAT, b'{"messages": [],}', code="invalid_json"),
    Row("trailing-garbage", CHAT, json.dumps(chat()).encode() + b" {}", code="invalid_json"),
    Row("single-quotes", CHAT, b"{'messages': []}", code="invalid_json"),
    Row("body-null", CHAT, b"null", code="invalid_json"),
    Row("body-string", COMPLETIONS, b'"Hi"', code="invalid_json"),
    Row("utf8-bom", CHAT, b"\xef\xbb\xbf" + json.dumps(chat()).encode(), code="invalid_json"),
    Row("nested-100k", CHAT, raw_chat(b'"x": ' + b"[" * 100_000 + b"]" * 100_000), code="invalid_json"),
    Row("invalid-utf8-key", CHAT, raw_chat(b'"\xff": 1'), code="invalid_json"),
    Row("overlong-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}', code="invalid_json"),
    Row("lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', code="invalid_json"),
    # --- wrong types
    Row("messages-string", CHAT, {"messages": "Hi"}, param="messages", code="invalid_value"),
    Row("message-int", CHAT, {"messages": [5]}, param="messages[0]"),
    Row("role-int", CHAT, {"messages": [{"role": 5, "content": "x"}]}, param="messages[0].role"),
    Row("content-object", CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]}, param="messages[0].content"),
    Row("text-part-int", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        param="messages[0].content"),
    Row("temperature-string", CHAT, chat(temperature="hot"), param="temperature"),
    Row("max_tokens-fraction", CHAT, chat(max_tokens=1.5), param="max_tokens"),
    Row("max_tokens-string", COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, param="max_tokens"),
    Row("stop-int", CHAT, chat(stop=5), param="stop"),
    Row("stop-list-of-int", CHAT, chat(stop=[1]), param="stop"),
    Row("logit_bias-list", CHAT, chat(logit_bias=[1, 2]), param="logit_bias"),
    Row("stream-list", CHAT, chat(stream=[1]), param="stream"),
    Row("model-int", CHAT, chat(model=5), param="model"),
    Row("seed-string", CHAT, chat(seed="x"), param="seed"),
    Row("stream_options-list", CHAT, chat(stream=True, stream_options=[1]), param="stream_options"),
    Row("detokenize-strings", "/detokenize", {"tokens": ["a"]}, param="tokens[0]"),
    # --- missing fields
    Row("chat-empty-object", CHAT, {}, param="messages"),
    Row("message-without-role", CHAT, {"messages": [{"content": "x"}]}, param="messages[0].role"),
    Row("completions-without-prompt", COMPLETIONS, {"max_tokens": 1}, param="prompt"),
    Row("detokenize-without-tokens", "/detokenize", {}, param="tokens"),
    Row("generate-without-prompt", "/generate", {"max_new_tokens": 1}, param="prompt"),
    Row("tokenize-neither", "/tokenize", {"model": "gemma-test"}, param="prompt"),
    # --- empty, unknown roles, non-text content
    Row("tokenize-empty-messages", "/tokenize", {"messages": []}, param="messages"),
    Row("role-robot", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, param="messages[0].role"),
    Row("role-function", CHAT, {"messages": [*HI, {"role": "function", "content": "x"}]}, param="messages[1].role"),
    Row("audio-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, param="messages[0].content"),
    Row("file-part-with-a-path", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "read this"}, {"type": "file", "file": {"path": "/etc/passwd"}}]}]},
        param="messages[0].content"),
    Row("prompt-empty-list", COMPLETIONS, {"prompt": []}, param="prompt"),
    Row("prompt-nested-lists", COMPLETIONS, {"prompt": [[1, [2]]]}, param="prompt"),  # [[1, 2]] is a list of prompts
    Row("prompt-bools", COMPLETIONS, {"prompt": [True, False]}, param="prompt"),
    # --- absurd, negative, NaN numbers
    Row("temperature-negative", CHAT, chat(temperature=-0.5), param="temperature"),
    Row("temperature-1e308", CHAT, chat(temperature=1e308), param="temperature"),
    Row("temperature-10^400", CHAT, chat(temperature=10**400), param="temperature"),
    Row("top_p-NaN", CHAT, raw_chat(b'"top_p": NaN'), param="top_p", code="invalid_value"),
    Row("top_p-negative", CHAT, chat(top_p=-1), param="top_p"),
    Row("top_p-above-1", CHAT, chat(top_p=1.0000001), param="top_p"),
    Row("presence-minus-Infinity", CHAT, raw_chat(b'"presence_penalty": -Infinity'), param="presence_penalty"),
    Row("frequency_penalty--3", CHAT, chat(frequency_penalty=-3), param="frequency_penalty"),
    Row("min_p-negative", CHAT, chat(min_p=-0.1), param="min_p"),
    Row("top_k-fraction", CHAT, chat(top_k=1.5), param="top_k"),
    Row("max_tokens-negative", CHAT, chat(max_tokens=-5), param="max_tokens"),
    Row("max_completion_tokens-0", CHAT, chat(max_completion_tokens=0), param="max_completion_tokens"),
    Row("max_tokens-5000-digits", CHAT, raw_chat(b'"max_tokens": ' + b"9" * 5000), code="invalid_json"),
    Row("max_new_tokens-negative", "/generate", {"prompt": "x", "max_new_tokens": -1}, param="max_new_tokens"),
    Row("logprobs-negative", COMPLETIONS, {"prompt": "x", "logprobs": -1}, param="logprobs"),
    Row("logprobs-1000", COMPLETIONS, {"prompt": "x", "logprobs": 1000}, param="logprobs"),
    Row("chat-logprobs-int", CHAT, chat(logprobs=2), param="logprobs"),
    Row("top_logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), param="top_logprobs"),
    Row("seed-2^64", CHAT, chat(seed=2**64), param="seed"),
    Row("seed-below-int64", CHAT, chat(seed=-(2**63) - 1), param="seed"),
    Row("logit_bias-superscript-key", CHAT, chat(logit_bias={"²": 1}), param="logit_bias"),
    Row("logit_bias-5000-digit-key", CHAT, chat(logit_bias={"9" * 5000: 1}), param="logit_bias"),
    Row("logit_bias-NaN-value", CHAT, raw_chat(b'"logit_bias": {"5": NaN}'), param="logit_bias.5"),
    Row("logit_bias-word-key", CHAT, chat(logit_bias={"abc": 1}), param="logit_bias"),
    Row("ignored-field-Infinity", CHAT, raw_chat(b'"user": Infinity'), param="user"),
    Row("n-0", CHAT, chat(n=0), param="n"),
    Row("n-9", COMPLETIONS, {"prompt": "x", "n": 9}, param="n"),  # --max-n 8
    Row("prompts-times-n-over-max", COMPLETIONS, {"prompt": ["x"] * 5, "n": 2}, param="prompt"),
    Row("prompt-list-mixed", COMPLETIONS, {"prompt": ["x", [2, 3]]}, param="prompt"),
    Row("prompt-list-empty-ids", COMPLETIONS, {"prompt": [[2], []]}, param="prompt"),
    Row("best_of-3", COMPLETIONS, {"prompt": "x", "best_of": 3}, param="best_of"),
    Row("stop-100", CHAT, chat(stop=[str(i) for i in range(100)]), param="stop"),
    # --- over the context, outside the vocabulary
    Row("generate-over-context", "/generate", {"prompt": "a " * 1100}, param="prompt", code="context_length_exceeded"),
    Row("prompt-ids-over-context", COMPLETIONS, {"prompt": [2] * 5000}, param="prompt",
        code="context_length_exceeded"),
    Row("prompt-id-outside-vocab", COMPLETIONS, {"prompt": [2, 262144]}, param="prompt"),
    Row("prompt-id-negative", COMPLETIONS, {"prompt": [-1]}, param="prompt"),
    Row("prompt-id-2^70", COMPLETIONS, {"prompt": [2**70]}, param="prompt"),
    Row("max_tokens-0-without-echo", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, param="max_tokens"),
    # --- routes and methods
    Row("unknown-route", "/nope", None, 404, code="not_found", method="GET", check_param=False),
    Row("embeddings-route", "/v1/embeddings", {"input": "x"}, 404, code="not_found", check_param=False),
    Row("delete-chat", CHAT, None, 405, code="method_not_allowed", method="DELETE", check_param=False),
    Row("put-health", "/health", None, 405, code="method_not_allowed", method="PUT", check_param=False),
    Row("post-metrics", "/metrics", b"{}", 405, code="method_not_allowed", check_param=False),
    Row("get-completions", COMPLETIONS, None, 405, code="method_not_allowed", method="GET", check_param=False),
    Row("unknown-model", "/v1/models/gpt-4o", None, 404, param="model", code="model_not_found", method="GET"),
    Row("model-path-in-url", "/v1/models/..%2F..%2Fetc%2Fpasswd", None, 404, param="model", code="model_not_found",
        method="GET"),
    Row("model-path-in-body", CHAT, chat(model="../../../../etc/passwd"), 404, param="model", code="model_not_found"),
    # --- sizes (the default limit is 2 MB)
    Row("10MB-with-length", COMPLETIONS, b'{"prompt": "' + b"y" * TEN_MB + b'"}', 413, code="request_too_large",
        check_param=False),
    Row("10MB-chunked", COMPLETIONS, ten_mb_chunks, 413, code="request_too_large", check_param=False),
    Row("10MB-not-json", CHAT, b"\x00\xff" * (TEN_MB // 2), 413, code="request_too_large", check_param=False),
]


def samples(live: LiveServer) -> dict[str, float]:
    text = live.client.get("/metrics").text  # type: ignore[attr-defined]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def errors(live: LiveServer) -> dict[str, float]:
    prefix = 'gemma4_errors_total{status="'
    return {k.removeprefix(prefix).removesuffix('"}'): v for k, v in samples(live).items() if k.startswith(prefix)}


def send(live: LiveServer, row: Row, request_id: str) -> httpx.Response:
    headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
    kwargs: dict[str, Any] = {}
    if isinstance(row.body, bytes):
        kwargs["content"] = row.body
    elif callable(row.body):
        kwargs["content"] = row.body()
    elif row.body is not None:
        kwargs["content"] = json.dumps(row.body).encode()
    return live.client.request(row.method, row.path, headers=headers, **kwargs)  # type: ignore[attr-defined]


def assert_openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"] == "application/json", r.headers
    assert "Traceback" not in r.text and 'File "' not in r.text and "server/" not in r.text, r.text[:500]
    body = r.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert len(r.content) < 4096, "an error body echoing the request back"
    return error


def assert_serving(live: LiveServer) -> None:
    r = live.client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})  # type: ignore[attr-defined]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " a a", r.text


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_gets_its_4xx_is_counted_logged_and_the_server_keeps_serving(
        server: LiveServer, row: Row, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.api")
    request_id = "bad-" + re.sub(r"[^A-Za-z0-9.-]", "_", row.id)
    before = errors(server)
    r = send(server, row, request_id)
    assert r.status_code == row.status, r.text[:500]
    error = assert_openai_error(r)
    if row.check_param:
        assert error["param"] == row.param, error
    if row.code is not None:
        assert error["code"] == row.code, error
    # counted once under its status, nothing else
    after = errors(server)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {str(row.status): 1}, delta
    # logged once, on one line, with the request id and the status
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "server.api" and request_id in rec.getMessage()]
    assert len(lines) == 1 and f"-> {row.status}" in lines[0] and "\n" not in lines[0], lines
    assert len(lines[0]) < 800
    # and the server keeps serving
    assert_serving(server)
    SEEN[str(row.status)] += 1


def test_a_client_gone_in_the_middle_of_its_body_is_a_499_not_a_500(server: LiveServer,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="server.api")
    before = errors(server)
    host, port = server.url.removeprefix("http://").split(":")
    # uvicorn holds a task per request whose head it has read: none before (the last row's task is gone), ours after,
    # so the client leaves in the middle of a body the app is reading, not before the server saw the request.
    requests = server.server.server_state.tasks
    wait_until(lambda: not requests, "the previous requests' tasks to end", 5)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\nX-Request-Id: half-a-body\r\n\r\n" + b'{"prompt": "' + b"a" * 1000)
        wait_until(lambda: requests, "the server to start the half-sent request", 5)
    wait_until(lambda: errors(server) != before, "the half-sent body to be counted", 5)
    after = errors(server)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert {k: v for k, v in delta.items() if v} == {"499": 1}, delta
    assert any("half-a-body" in rec.getMessage() and "-> 499" in rec.getMessage() for rec in caplog.records)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], "a vanished client is not a server error"
    assert_serving(server)


def test_after_the_matrix_the_server_is_healthy_and_idle(server: LiveServer) -> None:
    r = server.client.get("/health")  # type: ignore[attr-defined]
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert server.engine.admitted == 0 and server.engine.queue_depth == 0 and server.engine.running == 0
    assert not server.engine.in_flight()
    counted = errors(server)
    assert "500" not in counted, counted
    # every row that ran above is in the counters (SEEN: what this session's rows produced)
    assert all(counted.get(status, 0) >= n for status, n in SEEN.items()), (counted, SEEN)


def test_a_body_that_never_finishes_arriving_gets_a_408() -> None:
    """A slow sender (slowloris) cannot hold a connection and a handler: the body has a deadline."""
    with live_server(settings(body_timeout_s=0.5)) as live:
        host, port = live.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\nX-Request-Id: slow-body\r\n\r\n" + b'{"prompt": "')
            began = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                more = sock.recv(65536)
                if not more:
                    break
                answer += more
            waited = time.monotonic() - began
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"x-request-id: slow-body" in head.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert 0.4 < waited < 5, waited
        assert httpx.get(f"{live.url}/health", timeout=10).json() == {"status": "ok"}
