"""`python -m server bench fairness`: does any request stall the others? Four running streams, and beside them, one
scenario at a time (issue 35's Done-when):

- `baseline`: nothing else (the streams' own inter-token gap);
- `image`: one request with an image encoded on the host (`--vision host`: a random tower of the 26B-A4B's vision
  shape, server.tools.bench.vision), at `--image-budget` soft tokens;
- `plain`: a `--scored`-token prompt prefilled (no scoring: what a long prompt alone costs the streams);
- `scored`: the same prompt scored (`echo` + `logprobs`: prompt_logprobs 1);
- `newcomers`: three prompts arriving together (`--newcomers`, default 8192,512,16 tokens): each one's time to first
  token, in ms and against its bound (its own prefill plus two decode steps).

Each scenario reports the running streams' inter-token gaps (p50, p99, max) over the gaps that end while it runs
(from its submission to its last request's first token, or its Finish). The graph is the null graph with the 26B's
roofline step times on inf2.xlarge (server.graphs.null: a PROJECTION, so the figures are what the host and the
scheduler add to a projected device), 8 KV slots, decode batches 1, 2, 4, 8, the 26B's shapes (262,144 logits, the
real-size table, the real tokenizer), torch single-threaded as `serve` sets it for these graphs.

`--compare` (default on) runs every scenario twice: as built (the token-budget policy, host work on host workers) and
as before (`Alternate`: prompts first come, first served; image encodes and scoring on the device thread).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from server.tools.bench.report import percentile

SCENARIOS = ("baseline", "image", "plain", "scored", "newcomers")
STREAMS = 4
STREAM_PROMPT = 32
MAX_TOTAL = 16384  # room for the 8k newcomer beside everything else
BASELINE_S = 3.0  # how long the baseline scenario watches the streams


def _engine(host: Any, words: list[int], *, before: bool, vision: Any) -> Any:
    from server.app.process import single_threaded_torch
    from server.constraints.factory import ConstraintFactory
    from server.engine.engine import Engine
    from server.engine.scheduler import Alternate
    from server.graphs.null import ROOFLINE_PREFILL_S, ROOFLINE_STEP_S, NullGraph

    single_threaded_torch("null")

    def load() -> Any:
        return NullGraph(host.structure.vocab_size, max_total=MAX_TOTAL, prefill_bucket=host.spec.prefill_bucket,
                         host_softcap=host.structure.final_softcap, favoured_token=words[0], text_tokens=words[1:],
                         step_s=ROOFLINE_PREFILL_S, slots=8, decode_batches=tuple(ROOFLINE_STEP_S),
                         batch_step_s=ROOFLINE_STEP_S)

    engine = Engine(host.embedding, host.tokenizer, host.stop_token_ids, load, max_queue=32,
                    constraints=ConstraintFactory(host.structure.vocab_size), load_vision=lambda: vision,
                    policy=Alternate() if before else None, host_workers=not before)
    engine.start()
    assert engine.wait_ready(600), engine.state_reason
    return engine


def _image(budget: int) -> Any:
    import hashlib

    import numpy as np
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from server.engine.types import ImageInput

    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (896, 896, 3), dtype=np.uint8))
    features = Gemma4ImageProcessorPil(max_soft_tokens=budget)(picture, return_tensors="np")
    pixels, positions = features["pixel_values"][0], features["image_position_ids"][0]
    return ImageInput(digest=hashlib.sha256(pixels.tobytes()).digest(), budget=budget,
                      soft_tokens=int(features["num_soft_tokens_per_image"][0]), pixel_values=pixels,
                      position_ids=positions)


class _Run:
    """One scenario: the four streams, the scenario's requests, every token's arrival."""

    def __init__(self, engine: Any, vocab: int, seed: int) -> None:
        self.engine, self.vocab, self.seed = engine, vocab, seed
        self.arrivals: dict[int, list[float]] = {}
        self.first_logprobs: dict[int, float] = {}
        self.finished: dict[int, float] = {}
        self.handles: list[Any] = []
        self.tasks: list[asyncio.Future[None]] = []

    def prompt(self, length: int, index: int) -> tuple[int, ...]:
        generator = torch.Generator().manual_seed(self.seed * 100 + index)
        return (2, *torch.randint(300, min(self.vocab, 250_000), (length - 1,), generator=generator).tolist())

    def submit(self, index: int, request: Any) -> None:
        from server.engine.types import Delta, Finish, PromptLogprobs

        handle = self.engine.submit(request)
        self.handles.append(handle)
        self.arrivals[index] = []

        async def consume() -> None:
            async for event in handle.events():
                if isinstance(event, Delta) and event.token_id is not None:
                    self.arrivals[index].append(time.perf_counter())
                elif isinstance(event, PromptLogprobs):
                    self.first_logprobs[index] = time.perf_counter()
                    assert not self.arrivals[index], "prompt logprobs after a generated token"
                elif isinstance(event, Finish):
                    self.finished[index] = time.perf_counter()

        self.tasks.append(asyncio.ensure_future(consume()))

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await asyncio.sleep(0.002)

    def gaps_ms(self, start: float, end: float) -> list[float]:
        return [(b - a) * 1000 for i in range(STREAMS) for a, b in zip(self.arrivals[i], self.arrivals[i][1:],
                                                                        strict=False) if start < b <= end]

    async def close(self) -> None:
        for handle in self.handles:
            handle.cancel()
        await asyncio.gather(*self.tasks)


async def _scenario(engine: Any, name: str, vocab: int, seed: int, *, image_budget: int, scored: int,
                    newcomers: Sequence[int]) -> dict[str, Any]:
    from server.engine.types import GenerationRequest
    from server.sampling.params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    run = _Run(engine, vocab, seed)
    for i in range(STREAMS):
        run.submit(i, GenerationRequest(prompt_ids=run.prompt(STREAM_PROMPT, i), max_new_tokens=MAX_TOTAL // 2,
                                        sampling=greedy, ignore_eos=True))
    await run.until(lambda: all(len(run.arrivals[i]) >= 3 for i in range(STREAMS)))  # all four decode together
    start = time.perf_counter()
    result: dict[str, Any] = {}
    extra = list(range(STREAMS, STREAMS + (len(newcomers) if name == "newcomers" else 1)))
    if name == "baseline":
        await asyncio.sleep(BASELINE_S)
    elif name == "image":
        image = _image(image_budget)
        ids = (*run.prompt(16, 90), *[5] * image.soft_tokens, *run.prompt(8, 91)[1:])
        run.submit(extra[0], GenerationRequest(prompt_ids=ids, max_new_tokens=1, sampling=greedy, ignore_eos=True,
                                               images=(replace(image, offset=16),)))
        await run.until(lambda: extra[0] in run.finished)
        result["soft_tokens"] = image.soft_tokens
    elif name in ("plain", "scored"):
        run.submit(extra[0], GenerationRequest(prompt_ids=run.prompt(scored, 92), max_new_tokens=1, sampling=greedy,
                                               ignore_eos=True, prompt_logprobs=1 if name == "scored" else None))
        await run.until(lambda: extra[0] in run.finished)
        result["prompt_tokens"] = scored
    else:  # newcomers, arriving together
        for index, length in zip(extra, newcomers, strict=True):
            run.submit(index, GenerationRequest(prompt_ids=run.prompt(length, index), max_new_tokens=4,
                                                sampling=greedy, ignore_eos=True))
        await run.until(lambda: all(run.arrivals[i] for i in extra))
        from server.graphs.null import ROOFLINE_PREFILL_S, ROOFLINE_STEP_S

        step_ms = 1000 * ROOFLINE_STEP_S[8]  # the largest step that can run beside them (4 + 3 rows: a batch of 8)
        bucket = engine.graph.prefill_buckets[-1]
        for index, length in zip(extra, newcomers, strict=True):
            ttft = (run.arrivals[index][0] - start) * 1000
            result[f"ttft_ms_{length}"] = round(ttft, 1)
            # its own prefill (its chunks at the roofline's chunk time) plus two decode steps
            result[f"ttft_bound_ms_{length}"] = round(-(-length // bucket) * 1000 * ROOFLINE_PREFILL_S + 2 * step_ms, 1)
        result["order"] = [length for _, length in sorted((run.arrivals[i][0], n) for i, n in zip(extra, newcomers,
                                                                                                   strict=True))]
    end = time.perf_counter()
    gaps = run.gaps_ms(start, end)
    await run.close()
    result.update({"seconds": round(end - start, 2), "gaps": len(gaps), "gap_ms_p50": round(statistics.median(gaps), 1),
                   "gap_ms_p99": round(percentile(gaps, 99), 1), "gap_ms_max": round(max(gaps), 1)})
    return result


def measure(cache_root: Path, *, scenarios: Sequence[str] = SCENARIOS, image_budget: int = 70, scored: int = 4096,
            newcomers: Sequence[int] = (8192, 512, 16), compare: bool = True) -> dict[str, Any]:
    from server.app.runtime import load_host
    from server.graphs.null import ROOFLINE_PREFILL_S, ROOFLINE_STEP_S
    from server.tools.bench.host import bench_artifacts

    host = load_host(bench_artifacts(cache_root), "null", cache_dir=cache_root)
    words = list(dict.fromkeys(host.tokenizer.encode(" the of and to in is that for it", add_special_tokens=False)))
    vision = None
    if "image" in scenarios:
        from server.tools.bench.vision import _encoder

        vision, _ = _encoder(None, (image_budget,))
    results: dict[str, Any] = {
        "graph": "null graph, roofline step times (PROJECTION of the 26B on inf2.xlarge)",
        "prefill_chunk_ms": round(1000 * ROOFLINE_PREFILL_S, 1),
        "decode_step_ms": {str(b): round(1000 * s, 1) for b, s in ROOFLINE_STEP_S.items()},
        "streams": STREAMS}
    for mode in ("now", "before") if compare else ("now",):
        engine = _engine(host, words, before=mode == "before", vision=vision)
        try:
            results[mode] = {name: asyncio.run(_scenario(engine, name, host.structure.vocab_size, seed,
                                                         image_budget=image_budget, scored=scored, newcomers=newcomers))
                             for seed, name in enumerate(scenarios, 1)}
        finally:
            engine.stop()
    return results


def print_fairness(results: dict[str, Any]) -> None:
    print(f"{results['graph']}; {results['streams']} running streams; a prefill chunk {results['prefill_chunk_ms']} ms, "
          f"decode steps {results['decode_step_ms']} ms by batch")
    print(f"{'mode':>6} {'scenario':>9} {'seconds':>8} {'gaps':>5} {'gap p50':>8} {'gap p99':>8} {'gap max':>8}  notes")
    for mode in ("now", "before"):
        for name, row in results.get(mode, {}).items():
            notes = ", ".join(f"{k} {v}" for k, v in row.items()
                              if k not in ("seconds", "gaps", "gap_ms_p50", "gap_ms_p99", "gap_ms_max"))
            print(f"{mode:>6} {name:>9} {row['seconds']:8.2f} {row['gaps']:5d} {row['gap_ms_p50']:8.1f} "
                  f"{row['gap_ms_p99']:8.1f} {row['gap_ms_max']:8.1f}  {notes}")
