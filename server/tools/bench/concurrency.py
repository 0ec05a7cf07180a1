"""`python -m server bench --concurrency 1,2,4,8 [--artifacts DIR --graph jit]`: several streams at once through the
engine (no HTTP), per stream count: aggregate tokens/s, per-stream inter-token latency, a late arrival's TTFT, and the
host's time per step per row.

Default: the 26B's shapes (262,144 logits, the real-size bf16 table, the real tokenizer) on the null graph with 8 KV
slots whose step time is the recipe's roofline for the batch size (server.graphs.null.ROOFLINE_STEP_S: a PROJECTION
of the 26B on inf2.xlarge, not a measurement), so the figures are what the host adds to a projected device. With
`--artifacts DIR --graph jit` (a v3 CPU build of the recipe): the real graph, its real CPU step times.

For N streams: N - 1 start together; once each has its first token, the N-th arrives (its TTFT is the late arrival's:
its own prefill beside N - 1 decoding streams). Measured over the window in which all N decode (from the late one's
first token to the first finish): aggregate tokens/s, inter-token gaps of every stream (p50, p99), and the host's
share: the window's wall time minus the time inside graph calls, per step and per row, against the device step.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from server.sampling.params import SamplingParams
from server.tools.bench.report import percentile

if TYPE_CHECKING:
    from server.config import Settings

SAMPLINGS = {"greedy": SamplingParams(temperature=0.0),
             "default": SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=0)}
PROMPT = 32  # tokens per prompt: one chunk


def _engine(host: Any, load: Any, capacity: int) -> Any:
    from server.app.runtime import build_engine
    from server.config import Settings

    engine = build_engine(host, Settings(max_queue=max(16, capacity), max_batch=capacity), load=load)
    engine.start()
    assert engine.wait_ready(600), engine.state_reason
    return engine


def _prompt(seed: int, vocab: int) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (2, *torch.randint(300, min(vocab, 250_000), (PROMPT - 1,), generator=generator).tolist())


async def _streams(engine: Any, streams: int, tokens: int, params: SamplingParams, vocab: int,
                   run: int) -> dict[str, float]:
    """One measurement; `run` makes its prompts its own (no slot holds them yet: every stream prefills)."""
    from dataclasses import replace

    from server.engine.types import Delta, Finish, GenerationRequest

    arrivals: list[list[float]] = [[] for _ in range(streams)]
    finished: list[float] = []

    def request(index: int, count: int) -> GenerationRequest:
        seeded = replace(params, seed=index) if params.seed is not None else params
        return GenerationRequest(prompt_ids=_prompt(1000 * run + index, vocab), max_new_tokens=count, sampling=seeded,
                                 ignore_eos=True)

    async def consume(index: int, handle: Any) -> None:
        async for event in handle.events():
            if isinstance(event, Delta) and event.token_id is not None:
                arrivals[index].append(time.perf_counter())
            elif isinstance(event, Finish):
                finished.append(time.perf_counter())

    early = [engine.submit(request(i, tokens + 16)) for i in range(streams - 1)]  # they outlast the late one's start
    tasks = [asyncio.ensure_future(consume(i, h)) for i, h in enumerate(early)]
    while not all(arrivals[i] for i in range(streams - 1)):
        await asyncio.sleep(0.001)
    calls0, device0 = engine.device_totals()
    submitted = time.perf_counter()
    late = engine.submit(request(streams - 1, tokens))
    tasks.append(asyncio.ensure_future(consume(streams - 1, late)))
    while not arrivals[-1]:
        await asyncio.sleep(0.0005)
    start = arrivals[-1][0]
    calls1, device1 = engine.device_totals()
    while not finished:
        await asyncio.sleep(0.001)
    end = finished[0]
    calls2, device2 = engine.device_totals()
    await asyncio.gather(*tasks)
    in_window = [t for times in arrivals for t in times if start < t <= end]
    gaps = [(b - a) * 1000 for times in arrivals for a, b in zip(times, times[1:], strict=False) if start < a and b <= end]
    steps = max(calls2 - calls1, 1)
    wall_ms = (end - start) * 1000
    device_ms = (device2 - device1) * 1000
    host_per_step = max(wall_ms - device_ms, 0.0) / steps
    return {
        "aggregate_tok_s": len(in_window) / (end - start),
        # none when the late stream ran alone (a KV pool that admits one at a time: --null-kv-blocks)
        "itl_ms_p50": statistics.median(gaps) if gaps else float("nan"),
        "itl_ms_p99": percentile(gaps, 99) if gaps else float("nan"),
        "late_ttft_ms": (arrivals[-1][0] - submitted) * 1000,
        "late_ttft_steps": calls1 - calls0,  # graph calls from its arrival to its first token (its prefill included)
        "device_step_ms": device_ms / steps,
        "host_ms_per_step": host_per_step,
        "host_ms_per_step_per_row": host_per_step / streams,
        "host_share_of_step": host_per_step / max(device_ms / steps, 1e-9),
    }


def measure_concurrency(counts: Sequence[int], *, cache_root: Path, artifacts: Path | None = None, graph: str = "null",
                        tokens: int = 64, settings: Settings | None = None) -> dict[str, Any]:
    """Results keyed by stream count (as strings, for JSON), each with one entry per sampling. `settings`: the null
    graph's KV pool (--null-kv-blocks: admission by free KV at these shapes)."""
    from server.app.runtime import graph_loader, load_host, pool_shape

    if artifacts is None:
        from server.graphs.blocks import KVBlocks
        from server.graphs.null import ROOFLINE_PREFILL_S, ROOFLINE_S_PER_POSITION, ROOFLINE_STEP_S, NullGraph
        from server.tools.bench.host import bench_artifacts

        host = load_host(bench_artifacts(cache_root), "null", cache_dir=cache_root, settings=settings)
        shape = pool_shape("null", host.spec, settings)
        words = list(dict.fromkeys(host.tokenizer.encode(" the of and to in is that for it", add_special_tokens=False)))
        slots = max(max(counts), max(ROOFLINE_STEP_S))

        def load() -> Any:
            return NullGraph(host.structure.vocab_size, max_total=host.spec.max_total, prefill_bucket=host.spec.prefill_bucket,
                             host_softcap=host.structure.final_softcap, favoured_token=words[0], text_tokens=words[1:],
                             step_s=ROOFLINE_PREFILL_S, slots=slots, decode_batches=tuple(ROOFLINE_STEP_S),
                             batch_step_s=ROOFLINE_STEP_S, kv_pool=None if shape is None else KVBlocks(*shape),
                             s_per_position=0.0 if shape is None else ROOFLINE_S_PER_POSITION)

        kind = "null graph, roofline step times (PROJECTION of the 26B on inf2.xlarge)"
        if shape is not None:
            kind += f", a KV pool of {shape[0]} blocks of {shape[1]}"
    else:
        host = load_host(artifacts, graph, cache_dir=cache_root, settings=settings)
        load = graph_loader(host, settings)
        kind = f"{graph} graph from {artifacts} (measured)"
    tokens = min(tokens, host.spec.max_total - PROMPT - 17)
    results: dict[str, Any] = {"graph": kind, "tokens_per_stream": tokens, "prompt_tokens": PROMPT}
    for count in counts:
        engine = _engine(host, load, count)
        try:
            if engine.capacity < count:
                results[str(count)] = {"skipped": f"the graph runs {engine.capacity} at once"}
                continue
            asyncio.run(_streams(engine, 1, 4, SAMPLINGS["greedy"], host.structure.vocab_size, 0))  # warm-up
            results[str(count)] = {name: asyncio.run(_streams(engine, count, tokens, params, host.structure.vocab_size,
                                                              run))
                                   for run, (name, params) in enumerate(SAMPLINGS.items(), 1)}
        finally:
            engine.stop()
    one = results.get("1", {}).get("greedy", {}).get("aggregate_tok_s")
    for count in counts:
        entry = results.get(str(count), {})
        if one and "greedy" in entry:
            entry["greedy"]["aggregate_vs_one_stream"] = entry["greedy"]["aggregate_tok_s"] / one
    return results


def print_concurrency(results: dict[str, Any]) -> None:
    print(f"{results['graph']}; {results['tokens_per_stream']} tokens a stream, {results['prompt_tokens']}-token prompts")
    print(f"{'streams':>7} {'sampling':>8} {'agg tok/s':>10} {'itl p50':>8} {'itl p99':>8} {'late ttft':>10} "
          f"{'(steps)':>7} {'step ms':>8} {'host/step':>9} {'host/row':>8} {'host %':>7}")
    for key, entry in results.items():
        if not key.isdigit():
            continue
        if "skipped" in entry:
            print(f"{key:>7} {entry['skipped']}")
            continue
        for name, row in entry.items():
            print(f"{key:>7} {name:>8} {row['aggregate_tok_s']:10.1f} {row['itl_ms_p50']:8.2f} {row['itl_ms_p99']:8.2f} "
                  f"{row['late_ttft_ms']:10.1f} {row['late_ttft_steps']:7d} {row['device_step_ms']:8.2f} "
                  f"{row['host_ms_per_step']:9.3f} {row['host_ms_per_step_per_row']:8.3f} "
                  f"{100 * row['host_share_of_step']:6.2f}%")
