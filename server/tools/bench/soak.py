"""`python -m server bench soak --minutes N`: a bounded mixed load over HTTP against the null graph with the 26B's
roofline step times (server.graphs.null: a PROJECTION of the device, so what is measured is the host), in process.

`clients` loops, each sending one request at a time, drawn in turn from a fixed mix: streamed chat, a tool-call chat,
a JSON-schema chat, a streamed Responses call, a streamed Messages call, a streamed chat with an image (a fresh
random picture each time, at `detail: low`), a chat stream the client walks away from after a few chunks (a
cancellation), a one-token probe and the health, model and metrics routes. Printed: the process's RSS over time
(VmRSS, and its two parts: RssAnon, the heap, where a leak shows, and RssFile, the mapped files, the embedding
table's pages among them, which grow as prompts touch new rows and are bounded by the table's size), each one's
slope over the last two thirds of the run (MB/min, a least-squares line), p50/p99 of the inter-token gap and of
TTFT over the streamed requests, the responses by status, and the KV slot gauges once the load has stopped: every
request's slot (the cancelled ones' too) must be free again. The clients run in a child process, so the RSS
sampled is the server's alone (the clients' tallies grow with every token they time, and in one process that
growth reads as a server leak). A kind the artifacts cannot serve is left out (and named in `soak_left_out`):
images without a vision tower in the export (the bench's default 26B shapes are text-only; an `export --vision host`
of a Gemma-4 checkpoint has one, and the null graph takes its image blocks while the tower runs for real), tools
on a model with no native tool-call format (the bench's default Gemma-3 tokenizer and template refuse them by
design).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from server.tools.bench.report import percentile, status_kib

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"],
          "additionalProperties": False}
CHAT = "/v1/chat/completions"
RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile")  # /proc/self/status: the whole, the heap, the mapped files


class Tally:
    """What the clients saw: statuses, TTFTs and inter-token gaps (ms), cancellations."""

    def __init__(self) -> None:
        self.statuses: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()  # "kind status" of every non-200 answer
        self.first_refusal: dict[str, str] = {}  # per kind: the first non-200 answer's body, for the log
        self.ttft_ms: list[float] = []
        self.gaps_ms: list[float] = []
        self.cancelled = 0
        self.by_kind: collections.Counter[str] = collections.Counter()


async def _stream(client: httpx.AsyncClient, tally: Tally, path: str, body: dict[str, Any], *,
                  leave_after: int | None = None) -> tuple[int, str]:
    """One streamed request: its first event's time from the send (TTFT) and the gaps between its data events."""
    sent = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return response.status_code, (await response.aread()).decode(errors="replace")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if leave_after is not None and len(times) >= leave_after:
                    tally.cancelled += 1
                    break  # leaving the block closes the connection: the server cancels the request
    if times:
        tally.ttft_ms.append((times[0] - sent) * 1000)
        tally.gaps_ms.extend((b - a) * 1000 for a, b in itertools.pairwise(times))
    return 200, ""


async def _post(client: httpx.AsyncClient, tally: Tally, path: str, body: dict[str, Any]) -> tuple[int, str]:
    response = await client.post(path, json=body)
    return response.status_code, response.text


async def _image_chat(client: httpx.AsyncClient, tally: Tally, model: str, n: int) -> tuple[int, str]:
    """A streamed chat about a 64 x 64 picture of random pixels seeded by `n` (a new image each time: no encode is
    reused), sent as a data URL at `detail: low` (70 soft tokens at most)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(n).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]
    return await _stream(client, tally, CHAT, {"model": model, "messages": [{"role": "user", "content": content}],
                                                "max_tokens": 24, "stream": True})


async def _get(client: httpx.AsyncClient, tally: Tally, path: str) -> tuple[int, str]:
    response = await client.get(path)
    return response.status_code, response.text


def _mix(model: str, n: int) -> list[tuple[str, Callable[[httpx.AsyncClient, Tally], Any]]]:
    """The request kinds, each a coroutine factory; `n` varies the prompts so prefix reuse does not do all the work."""
    user = [{"role": "user", "content": f"Tell me about the number {n}, in a few words."}]
    return [
        ("chat", lambda c, t: _stream(c, t, CHAT, {"model": model, "messages": user, "max_tokens": 48, "stream": True})),
        ("tools", lambda c, t: _post(c, t, CHAT, {"model": model, "max_tokens": 40, "tools": [WEATHER],
                                                  "messages": [{"role": "user", "content": f"Weather in city {n}?"}]})),
        ("json", lambda c, t: _post(c, t, CHAT, {"model": model, "messages": user, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})),
        ("responses", lambda c, t: _stream(c, t, "/v1/responses", {"model": model, "input": user[0]["content"],
                                                                   "max_output_tokens": 40, "stream": True})),
        ("messages", lambda c, t: _stream(c, t, "/v1/messages", {"model": model, "messages": user, "max_tokens": 40,
                                                                 "stream": True})),
        ("image", lambda c, t: _image_chat(c, t, model, n)),
        ("cancel", lambda c, t: _stream(c, t, CHAT, {"model": model, "messages": user, "max_tokens": 200,
                                                     "stream": True}, leave_after=4)),
        ("probe", lambda c, t: _post(c, t, CHAT, {"model": model, "messages": user, "max_tokens": 1})),
        ("routes", lambda c, t: _get(c, t, ("/health", "/v1/models", "/metrics")[n % 3])),
    ]


async def _load(url: str, model: str, seconds: float, clients: int, tally: Tally, skip: frozenset[str]) -> None:
    deadline = time.monotonic() + seconds
    counter = itertools.count()

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                n = next(counter)
                mix = [(kind, make) for kind, make in _mix(model, n) if kind not in skip]
                kind, make = mix[n % len(mix)]
                tally.by_kind[kind] += 1
                try:
                    status, text = await make(client, tally)
                except httpx.HTTPError as exc:  # a transport failure is an error too: counted, the loop goes on
                    status, text = type(exc).__name__, str(exc)
                tally.statuses[str(status)] += 1
                if status != 200:
                    tally.refused[f"{kind} {status}"] += 1
                    tally.first_refusal.setdefault(kind, text[:300])

    await asyncio.gather(*(client_loop() for _ in range(clients)))


def _client_process(url: str, model: str, seconds: float, clients: int, skip: frozenset[str], out: Any) -> None:
    """The child process's body: the load, then its tally sent back whole through the pipe `out`."""
    tally = Tally()
    try:
        asyncio.run(_load(url, model, seconds, clients, tally, skip))
    finally:
        out.send(tally)
        out.close()


def _load_elsewhere(url: str, model: str, seconds: float, clients: int, skip: frozenset[str]) -> Tally:
    """The load in a spawned child (no copy of the server's threads or memory): the tally it saw."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_client_process, args=(url, model, seconds, clients, skip, send),
                            name="soak-clients", daemon=True)
    child.start()
    send.close()  # the child holds the sending end: a child that dies leaves recv an EOFError, not a hang
    try:
        tally: Tally = receive.recv()
    except EOFError:
        raise RuntimeError(f"the soak's client process died (exit code {child.exitcode})") from None
    finally:
        child.join(60)
    return tally


def _slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute (0 with fewer than two)."""
    if len(samples) < 2:
        return 0.0
    ts, ms = [t for t, _ in samples], [m for _, m in samples]
    mean_t, mean_m = statistics.fmean(ts), statistics.fmean(ms)
    var = sum((t - mean_t) ** 2 for t in ts)
    return 60 * sum((t - mean_t) * (m - mean_m) for t, m in samples) / var if var else 0.0


def _gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise RuntimeError(f"no {name} in /metrics")


def run_soak(artifacts: Path, *, seconds: float, clients: int = 6, sample_s: float = 10.0,
             cache_root: Path | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The soak (module docs) for `seconds`; returns the figures (RSS samples printed as they are taken)."""
    import uvicorn

    from server.api.app import create_app
    from server.app.runtime import build_engine, load_host
    from server.config import Settings
    from server.graphs.null import NULL_SLOTS, ROOFLINE_PREFILL_S, ROOFLINE_STEP_S, NullGraph

    # --vision auto: the export's tower on the host when it kept one (images in the mix), else images off.
    settings = Settings(artifacts=artifacts, graph="null", host="127.0.0.1", port=0, max_queue=64)
    host = load_host(artifacts, "null", cache_dir=cache_root, settings=settings)
    words = list(dict.fromkeys(host.tokenizer.encode(" the of and to in is that for it", add_special_tokens=False)))

    def load() -> NullGraph:
        return NullGraph(host.structure.vocab_size, max_total=host.spec.max_total,
                         prefill_bucket=host.spec.prefill_bucket, host_softcap=host.structure.final_softcap,
                         favoured_token=words[0], text_tokens=words[1:], step_s=ROOFLINE_PREFILL_S, slots=NULL_SLOTS,
                         decode_batches=tuple(ROOFLINE_STEP_S), batch_step_s=ROOFLINE_STEP_S)

    engine = build_engine(host, settings, load=load)
    app = create_app(settings, engine, host.info)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="soak-server", daemon=True)
    thread.start()
    started = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - started > 120:
            raise RuntimeError("the soak's server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    try:
        if not engine.wait_ready(600):
            raise RuntimeError(f"the engine did not load: {engine.state_reason}")
        app.state.grammar.wait(600)  # the grammar vocabulary's one-off build is start-up, not load
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        rss: dict[str, list[tuple[float, float]]] = {field: [] for field in RSS_FIELDS}
        done = threading.Event()
        begin = time.monotonic()

        def take() -> None:
            at = time.monotonic() - begin
            for field in RSS_FIELDS:
                rss[field].append((at, status_kib(field=field) / 1024))

        def sample() -> None:
            while True:
                take()
                log(f"soak rss_mb t={rss['VmRSS'][-1][0]:.0f}s {rss['VmRSS'][-1][1]:.1f} "
                    f"(anon {rss['RssAnon'][-1][1]:.1f}, file {rss['RssFile'][-1][1]:.1f})")
                if done.wait(sample_s):
                    return

        sampler = threading.Thread(target=sample, name="soak-rss", daemon=True)
        sampler.start()
        # A model without a native tool-call format refuses tools (a 400 by design), one without a vision encoder
        # images: those kinds are left out then.
        skip = frozenset(kind for kind, served in (("tools", host.info.protocol.calls is not None),
                                                   ("image", host.images is not None)) if not served)
        try:
            tally = _load_elsewhere(url, model, seconds, clients, skip)
        finally:
            done.set()
        sampler.join(30)
        take()
        for _ in range(600):  # the last requests' Finish can trail their responses by a step
            if engine.running == 0:
                break
            time.sleep(0.05)
        end = rss["VmRSS"][-1][0]
        tails = {field: [s for s in samples if s[0] >= end / 3] for field, samples in rss.items()}
        return {
            "soak_seconds": seconds,
            "soak_clients": clients,
            "soak_requests": sum(tally.by_kind.values()),
            "soak_left_out": ",".join(sorted(skip)) or "none",
            "soak_requests_by_kind": json.dumps(dict(sorted(tally.by_kind.items()))),
            "soak_responses_by_status": json.dumps(dict(sorted(tally.statuses.items()))),
            "soak_refused_by_kind": json.dumps(dict(sorted(tally.refused.items()))),
            "soak_first_refusals": json.dumps(tally.first_refusal),
            "soak_5xx": sum(n for status, n in tally.statuses.items() if status.startswith("5")),
            "soak_cancelled": tally.cancelled,
            "soak_ttft_ms_p50": statistics.median(tally.ttft_ms) if tally.ttft_ms else 0.0,
            "soak_ttft_ms_p99": percentile(tally.ttft_ms, 99) if tally.ttft_ms else 0.0,
            "soak_itl_ms_p50": statistics.median(tally.gaps_ms) if tally.gaps_ms else 0.0,
            "soak_itl_ms_p99": percentile(tally.gaps_ms, 99) if tally.gaps_ms else 0.0,
            "soak_rss_mb_first": rss["VmRSS"][0][1],
            "soak_rss_mb_last": rss["VmRSS"][-1][1],
            "soak_rss_slope_mb_per_min_last_two_thirds": _slope_mb_per_min(tails["VmRSS"]),
            "soak_rss_anon_mb_first": rss["RssAnon"][0][1],
            "soak_rss_anon_mb_last": rss["RssAnon"][-1][1],
            "soak_rss_anon_slope_mb_per_min_last_two_thirds": _slope_mb_per_min(tails["RssAnon"]),
            "soak_rss_file_mb_first": rss["RssFile"][0][1],
            "soak_rss_file_mb_last": rss["RssFile"][-1][1],
            "soak_rss_file_slope_mb_per_min_last_two_thirds": _slope_mb_per_min(tails["RssFile"]),
            "soak_requests_running_after": engine.running,
            "soak_kv_slots_in_use_after": _gauge(url, "gemma4_kv_slots_in_use"),
        }
    finally:
        server.should_exit = True
        thread.join(30)
