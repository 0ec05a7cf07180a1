"""Device faults end to end, through HTTP (the engine-level versions are in tests/test_engine_faults.py, the
happy SIGTERM drain in tests/test_api_lifecycle.py):

- the graph raises mid-generation: that request ends with an error (in-band for a stream, a 500 JSON body
  otherwise), the server stays healthy and the very next request succeeds;
- the graph never loads: `/health` says `error` with the reason, every generation route answers 503 at once
  (nothing waits for a device that is not there), the host-side routes keep working;
- a graph call stalls past the step timeout: its request fails within the timeout (not a hung client),
  `/health` says `error` while the call is stuck and new requests get 503, a request already queued is not
  lost (it runs once the device is back), and health recovers when the call returns;
- SIGTERM to a real server whose stream outlasts the grace period: new requests get 503, the stream is
  cancelled in-band when the grace expires, and the process exits 0 right after.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from server.app.runtime import build_engine, graph_loader
from server.graphs.base import Graph
from tests.support.api_fixtures import LiveServer, SlowGraph, live_server, null_host, settings, slow_loader, spawn_serve
from tests.support.wait import wait_for_value, wait_until

HI = [{"role": "user", "content": "Hi"}]
STEP_TIMEOUT_S = 0.8


def data_of(raw: str) -> list[str]:
    return [block.removeprefix("data: ") for block in raw.split("\n\n") if block.startswith("data: ")]


def error_count(live: LiveServer, status: int) -> float:
    for line in httpx.get(f"{live.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'gemma4_errors_total{{status="{status}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ok_stream(live: LiveServer, tokens: int = 4) -> None:
    raw = httpx.post(f"{live.url}/v1/completions", timeout=30,
                     json={"prompt": "Hi", "max_tokens": tokens, "temperature": 0, "stream": True}).text
    data = data_of(raw)
    assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length", raw[-300:]
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == " a" * tokens


def ok_chat(live: LiveServer) -> None:
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "temperature": 0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " a a a", r.text


def wait_idle(live: LiveServer, timeout: float = 5.0) -> None:
    """The engine admits nothing and the app waits for nothing (the worker's books close just after a Finish)."""
    wait_until(lambda: not (live.engine.admitted or live.engine.in_flight()), "the engine and the app to be idle",
               timeout)


# ------------------------------------------------------------------------------------- a fault mid-generation


@pytest.fixture
def faulty() -> Iterator[tuple[LiveServer, SlowGraph]]:
    config = settings()
    load, made = slow_loader(null_host(), 0.002)
    live = LiveServer(config, build_engine(null_host(), config, load=load), null_host()).start()
    try:
        yield live, made[0]
    finally:
        live.stop()


def test_a_fault_mid_generation_fails_that_request_only_and_the_next_one_succeeds(
        faulty: tuple[LiveServer, SlowGraph], caplog: pytest.LogCaptureFixture) -> None:
    live, graph = faulty
    before = error_count(live, 500)

    graph.fail_after = graph.calls + 3  # prefill + 2 decode steps, then the device faults
    raw = httpx.post(f"{live.url}/v1/completions", timeout=30,
                     json={"prompt": "Hi", "max_tokens": 50, "temperature": 0, "stream": True}).text
    data = data_of(raw)
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["code"] == "generation_error" and "simulated device fault" in error["message"]
    assert "Traceback" not in raw
    graph.fail_after = None
    ok_stream(live)  # the very next request, on the same server
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}

    graph.fail_after = graph.calls + 2
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 50}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_error", r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    graph.fail_after = None
    ok_chat(live)
    ok_stream(live)
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    wait_idle(live)
    assert error_count(live, 500) == before + 2  # the in-band one and the 500 body, each counted once
    failed = [r for r in caplog.records if "failed in the graph" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info for r in failed)  # one line (with its traceback) per fault, in the log


# ------------------------------------------------------------------------------------- a graph that never loads


def test_a_graph_that_fails_to_load_answers_503_everywhere_at_once_and_keeps_saying_why() -> None:
    def load() -> Graph:
        raise OSError("NEURON_RT: no NeuronCores available")

    config = settings()
    with live_server(config, build_engine(null_host(), config, load=load), wait_ready=False) as live:
        live.wait_state("error")
        with httpx.Client(base_url=live.url, timeout=5) as client:  # a hang would time out
            requests = [
                ("/v1/chat/completions", {"messages": HI, "stream": True}),
                ("/v1/chat/completions", {"messages": HI}),
                ("/v1/completions", {"prompt": "x", "stream": True}),
                ("/generate", {"prompt": "x"}),
            ]
            for path, body in requests:
                began = time.monotonic()
                r = client.post(path, json=body)
                assert r.status_code == 503 and r.headers["retry-after"], r.text
                assert r.json()["error"]["code"] == "model_error" and "no NeuronCores" in r.json()["error"]["message"]
                assert time.monotonic() - began < 1.0
            for _ in range(3):  # it stays down and says why, every time
                r = client.get("/health")
                assert r.status_code == 503 and r.json()["status"] == "error"
                assert "graph failed to load" in r.json()["reason"] and "NeuronCores" in r.json()["reason"]
            assert client.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
            assert client.get("/v1/models").status_code == 200
        assert error_count(live, 503) >= 4


# ------------------------------------------------------------------------------------- a stalled graph call


class StallingGraph(SlowGraph):
    """Blocks in `forward` while `stall` is set and `stall_on` names this call (one-shot)."""

    def __init__(self, inner: Graph) -> None:
        super().__init__(inner, 0.002)
        self.stall_on: int | None = None
        self.release = threading.Event()
        self.stalled = threading.Event()

    def forward(self, embeds, positions, *, last_only: bool = False, on_submit=None):  # type: ignore[no-untyped-def]
        if self.stall_on is not None and self.calls + 1 == self.stall_on:
            self.stall_on = None
            self.stalled.set()
            self.release.wait(30)
        return super().forward(embeds, positions, last_only=last_only, on_submit=on_submit)


@pytest.fixture
def stalling() -> Iterator[tuple[LiveServer, StallingGraph]]:
    config = settings(step_timeout_s=STEP_TIMEOUT_S)
    made: list[StallingGraph] = []

    def load() -> Graph:
        made.append(StallingGraph(graph_loader(null_host())()))
        return made[0]

    live = LiveServer(config, build_engine(null_host(), config, load=load), null_host()).start()
    try:
        yield live, made[0]
    finally:
        made[0].release.set()
        live.stop()


def _wait_health(live: LiveServer, status: str, timeout: float = 5.0) -> dict[str, str]:
    return wait_for_value(lambda: httpx.get(f"{live.url}/health", timeout=5).json(),
                          lambda body: body["status"] == status, f"/health to say {status!r}", timeout)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_stalled_graph_call_fails_its_request_in_time_and_health_recovers_when_it_returns(
        stalling: tuple[LiveServer, StallingGraph], stream: bool) -> None:
    live, graph = stalling
    graph.release.clear()
    graph.stall_on = graph.calls + 3  # the second decode step hangs
    results: dict[str, httpx.Response] = {}
    finished_at: dict[str, float] = {}

    def post(name: str, path: str, body: dict[str, object]) -> threading.Thread:
        def run() -> None:
            results[name] = httpx.post(f"{live.url}{path}", json=body, timeout=30)
            finished_at[name] = time.monotonic()

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    began = time.monotonic()
    stalled = post("stalled", "/v1/completions", {"prompt": "Hi", "max_tokens": 50, "temperature": 0, "stream": stream})
    assert graph.stalled.wait(10)
    # a request that is already waiting when the device gets stuck
    queued = post("queued", "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "temperature": 0})
    wait_until(lambda: live.engine.queue_depth >= 1, "the request to be queued", 5)
    assert live.engine.state == "ok", "the queued request must be admitted before the watchdog fires"
    stalled.join(10)
    r = results["stalled"]
    if stream:
        assert r.status_code == 200
        data = data_of(r.text)
        assert data[-1] == "[DONE]" and "step timeout" in json.loads(data[-2])["error"]["message"], r.text[-300:]
    else:
        assert r.status_code == 500 and "step timeout" in r.json()["error"]["message"], r.text
    failed_after = finished_at["stalled"] - began
    assert failed_after < STEP_TIMEOUT_S + 1.5, failed_after  # the step timeout plus the watchdog's tick, not a hang

    health = _wait_health(live, "error")
    assert health["status"] == "error" and "step timeout" in health["reason"], health
    refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_error"
    assert "queued" not in results  # still waiting: the device is stuck, and it is not dropped either

    graph.release.set()  # the device comes back
    assert _wait_health(live, "ok") == {"status": "ok"}
    queued.join(10)
    assert results["queued"].status_code == 200, results["queued"].text  # the queued request was not lost
    ok_stream(live)
    ok_chat(live)
    wait_idle(live)


# ------------------------------------------------------------------------------------- SIGTERM past the grace



def test_sigterm_with_a_stream_longer_than_the_grace_cancels_it_in_band_and_exits_0() -> None:
    grace = 1.0
    # 1000 tokens of 10 ms device steps: 10 s, far past the grace by construction (instant null steps with the host's
    # own work alone took under the 1 s grace on a fast machine, and the stream ended before the signal mattered)
    proc, url = spawn_serve("--shutdown-grace", str(grace), "--log-level", "info", "--null-step-ms", "10")
    try:
        body = {"prompt": "Hi", "max_tokens": 1000, "temperature": 1.0, "logprobs": 5, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            received = [next(line for line in lines if line.startswith("data: "))]
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(f"{url}/health", timeout=5).json()["status"] != "ok",
                       "/health to leave ok (the signal is handled on the server's next loop turn)")
            late = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 1}, timeout=5)
            assert late.status_code == 503 and late.json()["error"]["code"] == "model_draining"
            received += list(lines)
            ended = time.monotonic() - signalled
        data = [line.removeprefix("data: ") for line in received if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        error = json.loads(data[-2])["error"]
        assert error["code"] == "cancelled" and error["type"] == "service_unavailable"
        assert grace * 0.8 < ended < grace + 3.0, ended
        assert proc.wait(10) == 0
        exited = time.monotonic() - signalled
        assert exited < grace + 8.0, exited
        log = proc.communicate()[0]
        assert "draining" in log and "cancelling 1 request" in log and "finish=cancelled" in log, log[-2000:]
        assert "Traceback" not in log, log[-3000:]
    except AssertionError:
        if proc.poll() is None:
            proc.kill()
        print(proc.communicate()[0][-5000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bug_is_a_json_500_with_the_request_id(faulty: tuple[LiveServer, SlowGraph],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    live, _ = faulty
    prompts = live.app.state.prompts

    async def broken(ids: object) -> str:
        raise RuntimeError("a bug in the handler")

    monkeypatch.setattr(prompts, "decode", broken)
    r = httpx.post(f"{live.url}/detokenize", json={"tokens": [2, 651]}, headers={"X-Request-Id": "bug-1"}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    assert r.headers.get_list("x-request-id") == ["bug-1"] and "Traceback" not in r.text
    monkeypatch.undo()
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": [2, 651]}, timeout=30).status_code == 200
