"""Lifecycle: /health while the graph loads (HTTP listens meanwhile), a graph that fails to load, draining
in-process (in-flight requests finish, new ones get 503, the grace period cancels stragglers), and SIGTERM on
a real `python -m server serve` process, which must drain and exit 0.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from server.app.runtime import build_engine, graph_loader
from server.app.serve import serve
from server.graphs.base import Graph
from tests.support.api_fixtures import LiveServer, live_server, null_host, settings, slow_loader, spawn_serve
from tests.support.wait import wait_for_value

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


def test_health_says_loading_until_the_graph_is_ready() -> None:
    host = null_host()
    release = threading.Event()

    def load() -> Graph:
        assert release.wait(60), "the test never released the load"
        return graph_loader(host)()

    config = settings()
    live = LiveServer(config, build_engine(host, config, load=load), host).start(wait_ready=False)
    try:
        r = httpx.get(f"{live.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and "reason" in r.json()
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="gemma-test", messages=HI)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "model_loading"  # type: ignore[index]
        assert caught.value.response.headers["retry-after"]
        # the host side answers already
        assert [m.id for m in client.models.list().data] == ["gemma-test"]
        assert httpx.post(f"{live.url}/tokenize", json={"prompt": "Hello"}).json()["count"] == 2
        assert httpx.get(f"{live.url}/metrics").status_code == 200

        release.set()
        live.wait_state("ok")
        r = httpx.get(f"{live.url}/health")
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert client.chat.completions.create(model="gemma-test", messages=HI, max_tokens=1).usage is not None
    finally:
        release.set()
        live.stop()


def test_health_reports_a_graph_that_failed_to_load() -> None:
    def load() -> Graph:
        raise RuntimeError("no NeuronCore found")

    config = settings()
    with live_server(config, build_engine(null_host(), config, load=load), wait_ready=False) as live:
        live.wait_state("error")
        r = httpx.get(f"{live.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        assert "no NeuronCore found" in r.json()["reason"]
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def _data(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def test_drain_lets_in_flight_requests_finish_and_refuses_new_ones() -> None:
    config = settings()
    load, _ = slow_loader(null_host(), 0.05)
    with live_server(config, build_engine(null_host(), config, load=load)) as live:
        body = {"prompt": "Hi", "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            received = [next(line for line in lines if line.startswith("data: "))]
            assert live.loop is not None
            drained = asyncio.run_coroutine_threadsafe(live.app.state.drain(10.0), live.loop)
            live.wait_state("draining", timeout=5)
            r = httpx.get(f"{live.url}/health")
            assert r.status_code == 503 and r.json() == {"status": "draining", "reason": "shutting down"}
            r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_draining"
            received += list(lines)
        data = _data(received)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == " a" * 20
        assert drained.result(10) is True


def test_drain_grace_expiry_cancels_stragglers_in_band() -> None:
    config = settings()
    load, _ = slow_loader(null_host(), 0.05)
    with live_server(config, build_engine(null_host(), config, load=load)) as live:
        body = {"prompt": "Hi", "max_tokens": 500, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            received = [next(line for line in lines if line.startswith("data: "))]
            started = time.monotonic()
            assert live.loop is not None
            drained = asyncio.run_coroutine_threadsafe(live.app.state.drain(0.3), live.loop)
            received += list(lines)
            elapsed = time.monotonic() - started
        data = _data(received)
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["code"] == "cancelled" and error["type"] == "service_unavailable"
        assert elapsed < 3.0
        assert drained.result(10) is True


def test_serve_returns_1_on_an_invalid_artifact_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert serve(settings(artifacts=tmp_path, graph="null")) == 1
    assert str(tmp_path) in capsys.readouterr().err



def test_sigterm_drains_in_flight_requests_and_exits_0() -> None:
    proc, url = spawn_serve("--shutdown-grace", "20", "--log-level", "info")
    try:
        # 600 sampled tokens over the whole vocabulary with logprobs: a few seconds of work on any host
        body = {"prompt": "Hi", "max_tokens": 600, "temperature": 1.0, "logprobs": 5, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            received = [next(line for line in lines if line.startswith("data: "))]
            proc.send_signal(signal.SIGTERM)
            # the signal is handled on the server's next loop turn
            health = wait_for_value(lambda: httpx.get(f"{url}/health", timeout=5),
                                    lambda answer: answer.json()["status"] != "ok", "/health to leave ok", 30)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            received += list(lines)
        data = _data(received)
        assert data[-1] == "[DONE]", data[-3:]
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length", chunks[-3:]  # the stream ran to its end
        assert chunks[-1]["usage"]["completion_tokens"] == 600
        assert proc.wait(30) == 0
        log = proc.communicate()[0]
        assert "draining" in log and "completion=600" in log, log
    except AssertionError:
        if proc.poll() is None:
            proc.kill()
        print(proc.communicate()[0])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
