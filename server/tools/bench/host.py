"""`python -m server bench`: what the host costs per token, at the real 26B shapes, with the device taken away.

The `null` graph answers instantly, so everything measured here is pure host overhead: embedding lookup,
contract tensors, soft-cap, sampling over 262,144 logits, detokenizing, stop matching, SSE framing, HTTP.
A real-size (1.48 GB, bf16) embedding table is created once and memory-mapped; the tokenizer is the real
262k Gemma tokenizer from the demo package. Prints a table and one JSON object (also written with --json).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from server.model.artifacts import GraphSpec
from server.sampling.params import SamplingParams
from server.tools.bench.report import percentile, report, status_kib

if TYPE_CHECKING:
    from server.app.runtime import Host
    from server.engine.engine import Engine
    from server.model.tokenizer import HostTokenizer

VOCAB, HIDDEN, MAX_TOTAL, BUCKET = 262_144, 2816, 512, 128
DEFAULT_SAMPLING = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
SAMPLINGS = (("", DEFAULT_SAMPLING), ("_greedy", {"temperature": 0.0}))

# The Gemma-4 26B-A4B text config (facts of the published build); only its shapes matter here.
CONFIG_26B: dict[str, Any] = {
    "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "_name_or_path": "gemma-4-26B-A4B-it-bench",
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2112, "num_hidden_layers": 30,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
    "num_global_key_value_heads": 2, "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "attention_k_eq_v": True, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
}


def bench_artifacts(cache_root: Path) -> Path:
    """cfg/ (26B config + the real tokenizer), a real-size random bf16 table, graph.json. Built once."""
    from server.tools.demo import GEMMA3, demo_artifacts

    root = cache_root / "bench-26b-shapes"
    if (root / "graph.json").is_file():
        return root
    # The Gemma-family demo, whatever `demo` serves by default: the bench measures the 26B's 262k-vocabulary sampler,
    # detokenizer and grammar, which SmolLM2's 49k vocabulary would understate.
    tokenizer_cfg = demo_artifacts(cache_root, model=GEMMA3) / "cfg"
    staging = root.with_name(root.name + ".partial")
    (staging / "cfg").mkdir(parents=True, exist_ok=True)
    for item in tokenizer_cfg.iterdir():
        if item.name.startswith("tokenizer") or item.name == "chat_template.jinja":
            (staging / "cfg" / item.name).write_bytes(item.read_bytes())
    (staging / "cfg" / "config.json").write_text(json.dumps(CONFIG_26B, indent=2))
    (staging / "cfg" / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "do_sample": True, **DEFAULT_SAMPLING}))
    generator = torch.Generator().manual_seed(0)
    table = torch.empty(VOCAB, HIDDEN, dtype=torch.bfloat16)  # [V, H] 1.48 GB, filled in slices to bound RAM
    for start in range(0, VOCAB, 16_384):
        table[start : start + 16_384] = torch.randn(16_384, HIDDEN, generator=generator).mul_(0.02).to(torch.bfloat16)
    torch.save(table, staging / "embed_tokens.pt")
    del table
    (staging / "graph.json").write_text(json.dumps(GraphSpec(max_total=MAX_TOTAL, prefill_bucket=BUCKET).to_json()))
    staging.rename(root)
    return root


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def full_sort_top_p(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                    softcap: float | None = 30.0) -> int:
    """One token the naive way (bias, soft-cap and sort the whole vocabulary, mask, multinomial): the baseline."""
    x = logits.clone()  # (V,)
    for token, bias in params.logit_bias:
        x[token] += bias
    if params.greedy:
        return int(x.argmax())
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)  # (V,)
    values, order = torch.sort(x / params.temperature, descending=True)  # (V,), (V,)
    if 0 < params.top_k < x.numel():
        values[params.top_k :] = -math.inf
    probs = torch.softmax(values, 0)  # (V,) best first
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs[0]] = 0.0
    if params.top_p < 1.0:
        probs[probs.cumsum(0) - probs >= params.top_p * probs.sum()] = 0.0
    return int(order[torch.multinomial(probs, 1, generator=generator)])


def measure_sampling(repeats: int = 200) -> dict[str, float]:
    from server.sampling.sampler import Sampler

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator) * 3.0  # [V]
    results: dict[str, float] = {}
    cases = {
        "sampling_ms_greedy": SamplingParams(temperature=0.0),
        "sampling_ms_default": SamplingParams(**DEFAULT_SAMPLING, seed=0),
        "sampling_ms_default_logprobs": SamplingParams(**DEFAULT_SAMPLING, seed=0, logprobs=True, top_logprobs=5),
    }
    for name, params in cases.items():
        sampler = Sampler(params, VOCAB, [2, 3, 4], 30.0)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sampler.sample(logits)
            times.append((time.perf_counter() - start) * 1000)
        results[name] = statistics.median(times)
    params = SamplingParams(**DEFAULT_SAMPLING)
    rng = torch.Generator().manual_seed(0)
    times = []
    for _ in range(max(10, repeats // 10)):
        start = time.perf_counter()
        full_sort_top_p(logits, params, rng)
        times.append((time.perf_counter() - start) * 1000)
    results["sampling_ms_full_sort_top_p"] = statistics.median(times)
    results["sampling_speedup_vs_full_sort"] = results["sampling_ms_full_sort_top_p"] / results["sampling_ms_default"]
    results.update(measure_sampling_rows(repeats))
    return results


def peaked_rows(rows: int, generator: torch.Generator) -> torch.Tensor:
    """[R, V] logits shaped like a language model's: a Gaussian bulk and a few dozen tokens well above it, so a
    top-p of 0.95 keeps tens of tokens (a Gaussian row's nucleus spans thousands: the sort fallback, not the norm)."""
    x = torch.randn(rows, VOCAB, generator=generator) * 2.0  # [R, V]
    top = torch.randint(0, VOCAB, (rows, 32), generator=generator)  # [R, 32]
    return x.scatter_add_(1, top, torch.rand(rows, 32, generator=generator) * 6.0 + 14.0)  # [R, V]


def measure_sampling_rows(repeats: int = 200, rows: int = 4) -> dict[str, float]:
    """One decode step's sampling for `rows` sampled rows: `sample_rows` (rows taken together where it can) against
    `Sampler.sample` row by row, interleaved in one run, median of each. Default Gemma-4 sampling (top-k 64, top-p
    0.95) and top-p alone (top-k off: one first probe for the rows together, each row's total pass its own)."""
    from server.sampling.sampler import Sampler, sample_rows

    generator = torch.Generator().manual_seed(1)
    cases = {"": (SamplingParams(**DEFAULT_SAMPLING), torch.randn(rows, VOCAB, generator=generator) * 3.0),
             "_top_p": (SamplingParams(temperature=1.0, top_p=0.95), peaked_rows(rows, generator))}
    results: dict[str, float] = {}
    for label, (params, logits) in cases.items():
        together = [Sampler(replace(params, seed=b), VOCAB, [2, 3, 4], 30.0) for b in range(rows)]
        alone = [Sampler(replace(params, seed=b), VOCAB, [2, 3, 4], 30.0) for b in range(rows)]
        batched, by_row = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            sample_rows(together, logits)
            batched.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            for b, sampler in enumerate(alone):
                sampler.sample(logits[b])
            by_row.append((time.perf_counter() - start) * 1000)
        results[f"sampling_ms_{rows}_rows{label}_batched"] = statistics.median(batched)
        results[f"sampling_ms_{rows}_rows{label}_by_row"] = statistics.median(by_row)
    return results


def measure_idle_floor(idle_s: float = 0.03, repeats: int = 100) -> dict[str, float]:
    """What any host pays per token before doing anything useful: one trivial torch call and one pass over the
    logits (every sampler reads them all), hot and right after sitting out a device step of `idle_s`."""
    logits = torch.randn(VOCAB)  # [V]
    tiny = torch.ones(4)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the served path runs
    results: dict[str, float] = {}
    try:
        for label, idle in (("hot", 0.0), ("after_idle", idle_s)):
            times = []
            for _ in range(repeats):
                if idle:
                    time.sleep(idle)
                start = time.perf_counter()
                tiny.add(1)
                logits.max()
                times.append((time.perf_counter() - start) * 1000)
            results[f"floor_ms_call_and_logits_pass_{label}"] = statistics.median(times)
    finally:
        torch.set_num_threads(torch_threads)
    return results


def _running_engine(host: Host, *, prefix_reuse: bool = True) -> Engine:
    """An engine on the host's null graph (as `serve --graph null` builds it), loaded and ready."""
    from server.app.runtime import build_engine

    engine = build_engine(host, prefix_reuse=prefix_reuse)
    engine.start()
    assert engine.wait_ready(60), engine.state_reason
    return engine


def measure_engine(host: Host, tokens: int) -> dict[str, float]:
    """The engine alone (no HTTP): per-token gap between events, instant null graph, in this process."""
    from server.engine.types import Delta, GenerationRequest

    engine = _running_engine(host)
    results: dict[str, float] = {}
    try:
        async def go(params: SamplingParams) -> list[float]:
            handle = engine.submit(GenerationRequest(prompt_ids=(2, 651, 1000), max_new_tokens=tokens, sampling=params))
            arrivals = [time.perf_counter() async for event in handle.events()
                        if isinstance(event, Delta) and event.token_id is not None]
            return [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:], strict=False)]

        for label, sampling in SAMPLINGS:
            params = SamplingParams(**sampling)
            gaps = asyncio.run(go(params)) + asyncio.run(go(params))
            results[f"engine_ms_per_token_p50{label}"] = statistics.median(gaps)
            results[f"engine_ms_per_token_p99{label}"] = percentile(gaps, 99)
    finally:
        engine.stop()
    return results


def measure_prefix_reuse(host: Host) -> dict[str, float]:
    """A 3-turn chat re-sending the whole conversation each turn: prefill calls of turn 3, with and without reuse."""
    from server.engine.types import Completion, GenerationRequest

    results: dict[str, float] = {}
    for reuse in (True, False):
        engine = _running_engine(host, prefix_reuse=reuse)
        messages: list[dict[str, str]] = []
        questions = ["Tell me about the Inferentia2 chip in a few sentences, please. " * 4,
                     "And how does its memory compare with a GPU of the same price class?",
                     "Summarise both answers in one line."]
        for turn, question in enumerate(questions, 1):
            messages.append({"role": "user", "content": question})
            text = host.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompt = host.tokenizer.encode(text, add_special_tokens=False)  # the template has the BOS

            async def go(ids: list[int] = prompt, engine: Engine = engine) -> Completion:
                request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=40, sampling=SamplingParams(temperature=0.0))
                return await engine.submit(request).result()

            completion = asyncio.run(go())
            text, finish = completion.text, completion.finish
            messages.append({"role": "assistant", "content": text})
            if turn == 3:
                key = "prefill_calls_turn3" if reuse else "prefill_calls_turn3_no_reuse"
                results[key] = finish.prefill_calls
                if reuse:
                    results["turn3_prompt_tokens"] = finish.prompt_tokens
                    results["turn3_reused_tokens"] = finish.reused_tokens
                    results["turn3_expected_calls"] = math.ceil((finish.prompt_tokens - finish.reused_tokens) / BUCKET)
        engine.stop()
    return results


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime of all threads


class _Server:
    """`python -m server serve --graph null` as users start it, on a free loopback port: the grammar vocabulary builds
    in the background from start-up on, so what it costs the start shows in the ready time and RSS."""

    def __init__(self, root: Path, cache_dir: Path, step_ms: float = 0.0) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--artifacts", str(root), "--graph", "null", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", "--null-step-ms", str(step_ms),
             "--cache-dir", str(cache_dir)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        import httpx

        self.client = httpx.Client(timeout=120)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:] if self.proc.stderr else ''}")
            try:
                if self.client.get(f"{self.base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        self.ready_s = time.monotonic() - started

    def stream(self, sampling: dict[str, float], content: str, max_tokens: int) -> tuple[float, list[float], int]:
        """(ms from request to first content chunk, ms gaps between content chunks, tokens)."""
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, **sampling}
        sent = time.perf_counter()
        arrivals: list[float] = []
        tokens = 0
        with self.client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    arrivals.append(time.perf_counter())
                elif line.startswith("data: {") and '"usage":{' in line and '"choices":[]' in line:
                    tokens = int(json.loads(line[6:])["usage"]["completion_tokens"])
        gaps = [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:], strict=False)]
        return ((arrivals[0] - sent) * 1000 if arrivals else float("nan")), gaps, tokens

    def constrained(self) -> float:
        """ms for a short json_object answer: the first one after ready waits for the grammar vocabulary's build."""
        body = {"messages": [{"role": "user", "content": "JSON, please."}], "max_tokens": 4,
                "response_format": {"type": "json_object"}}
        sent = time.perf_counter()
        self.client.post(f"{self.base}/v1/chat/completions", json=body).raise_for_status()
        return (time.perf_counter() - sent) * 1000

    def device_counters(self) -> tuple[float, float]:
        """(graph calls, seconds inside them) so far, from the server's own /metrics."""
        values = dict.fromkeys(("gemma4_graph_calls_total", "gemma4_device_seconds_total"), 0.0)
        for line in self.client.get(f"{self.base}/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name in values:
                values[name] = float(value)
        return values["gemma4_graph_calls_total"], values["gemma4_device_seconds_total"]

    def close(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure_server(root: Path, cache_dir: Path, tokenizer: HostTokenizer, tokens: int, step_ms: float = 30.0) -> dict[str, float]:
    """Ready time, RSS, TTFT and host CPU per token with an instant graph; then per-token overhead on top of a
    simulated `step_ms` device step (inter-token gap at the client minus the device step the server measured)."""
    import tempfile

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cold-cache-") as cold:
        server = _Server(root, Path(cold))  # the first start on a machine: it derives and caches what it can
        results["ready_s_without_graph_first_start"] = server.ready_s
        server.close()
    server = _Server(root, cache_dir)
    try:
        results["ready_s_without_graph"] = server.ready_s
        results["rss_mb_ready"] = status_kib(server.proc.pid, "VmRSS") / 1024
        # The grammar vocabulary (cached table) is built by then or soon: the first constrained answer waits for it,
        # and the figures below are taken with it built, as on a server that has been up for a while.
        results["first_constrained_ms_after_ready"] = server.constrained()
        results["constrained_ms_built"] = server.constrained()
        results["rss_mb_grammar_built"] = status_kib(server.proc.pid, "VmRSS") / 1024
        ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 20, add_special_tokens=False)
        chat_prompt = tokenizer.decode(ids[:110])  # + the template's turn markers: a ~120-token chat prompt
        server.stream(DEFAULT_SAMPLING, "warm up", 16)
        for label, sampling in SAMPLINGS:
            cpu, generated, gaps = _cpu_seconds(server.proc.pid), 0, []
            for _ in range(3):
                _, more, n = server.stream(sampling, "Write a long story.", tokens)
                gaps += more
                generated += n
            results[f"host_cpu_ms_per_token{label}"] = (_cpu_seconds(server.proc.pid) - cpu) * 1000 / max(generated, 1)
            results[f"saturated_gap_ms_p50{label}"] = statistics.median(gaps)
        ttfts = [server.stream(DEFAULT_SAMPLING, chat_prompt, 1)[0] for _ in range(20)]
        results["ttft_host_overhead_ms_p50"] = statistics.median(ttfts)
        templated = tokenizer.apply_chat_template([{"role": "user", "content": chat_prompt}], add_generation_prompt=True)
        results["ttft_prompt_tokens"] = len(tokenizer.encode(templated, add_special_tokens=False))
        results["rss_mb_after_streams"] = status_kib(server.proc.pid, "VmRSS") / 1024
    finally:
        server.close()

    server = _Server(root, cache_dir, step_ms)
    try:
        server.constrained()  # the grammar vocabulary built before the per-token figures, not during them
        results["device_step_ms_simulated"] = step_ms
        for label, sampling in SAMPLINGS:
            gaps = []
            calls, device_s = server.device_counters()
            for _ in range(2):
                gaps += server.stream(sampling, "Write a long story.", min(tokens, 150))[1]
            more_calls, more_device_s = server.device_counters()
            # What a graph call really took (a sleep overshoots by ~0.15-0.3 ms here): the device's time, not ours.
            step = (more_device_s - device_s) * 1000 / max(more_calls - calls, 1)
            results[f"device_step_ms_measured{label}"] = step
            overhead = [gap - step for gap in gaps]
            results[f"host_overhead_ms_per_token_p50{label}"] = statistics.median(overhead)
            results[f"host_overhead_ms_per_token_p99{label}"] = percentile(overhead, 99)
    finally:
        server.close()
    return results


def run_bench(cache_root: Path, *, json_path: Path | None = None, tokens: int = 200) -> int:
    root = bench_artifacts(cache_root)
    results: dict[str, float] = {"vocab": VOCAB, "hidden": HIDDEN, "max_total": MAX_TOTAL, "bucket": BUCKET,
                                 "threads": torch.get_num_threads()}
    from server.app.runtime import load_host

    host = load_host(root, "null", cache_dir=cache_root)  # once, for the in-process parts (each server loads its own)
    # As the served host path runs (server.app.process.single_threaded_torch): with torch's 2 intra-op threads, each
    # small op over the logits stalls for milliseconds whenever the other core is busy (a sampler median of 8-12 ms
    # measured here under load, against 0.05 ms), which is the neighbours' load, not this code's cost.
    torch.set_num_threads(1)
    results.update(measure_sampling())
    from server.tools.bench.constraints import measure_constraints

    # Constrained decoding (response_format, forced tool calls): the mask's cost per token at V=262,144.
    results.update(measure_constraints(host.tokenizer, vocab_size=VOCAB, stop_ids=host.stop_token_ids, repeats=2,
                                       source=root / "cfg" / "tokenizer.json"))
    results.update(measure_idle_floor())
    results.update(measure_engine(host, tokens))
    results.update(measure_prefix_reuse(host))
    results.update(measure_server(root, cache_root, host.tokenizer, tokens))
    report(results, json_path)
    return 0
