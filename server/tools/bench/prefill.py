"""The time to prefill one long prompt through an export's graph: what an agent's first request waits for.

    python -m server bench prefill --artifacts DIR [--graph hf] [--tokens N] [--repeat K] [--json PATH]

The prompt is N token ids drawn from the export's vocabulary (no special ids, fixed seed), with prefix reuse off so
every run prefills all of it; one token is generated (max_tokens 1), so the time is the prompt's chunks and the one
step that samples from the last. Each of K runs is timed from submission to the finish; the report gives each run,
the chunk count (N over the graph's largest prefill bucket) and the median seconds per chunk. A chunk that is not the
prompt's last needs only its KV written: the engine asks the graph for the last position's logits alone
(`last_only`), so an [bucket, V] projection is paid once per prompt, not once per chunk.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path
from typing import Any


def measure(artifacts: Path, graph: str = "hf", tokens: int = 18_900, repeat: int = 3) -> dict[str, Any]:
    from server.model.artifacts import ArtifactDir

    # Refused before anything heavy loads: room for the one generated token.
    limit = ArtifactDir(artifacts).graph_spec().max_total - 1
    if tokens > limit:
        raise SystemExit(f"--tokens {tokens}: the export holds at most {limit} prompt tokens")
    import numpy as np

    from server.app.runtime import build_engine, load_host
    from server.engine.types import GenerationRequest, SamplingParams

    host = load_host(artifacts, graph)
    engine = build_engine(host, prefix_reuse=False)
    engine.start()
    try:
        engine.wait_ready()
        assert engine.graph is not None, "the engine failed to load its graph"
        bucket = max(engine.graph.prefill_buckets)
        # Plain-text ids: a SentencePiece vocabulary keeps its specials and control tokens below 1000 and at its top.
        high = min(host.structure.vocab_size, 200_000)
        ids = [int(t) for t in np.random.default_rng(0).integers(min(1000, high - 1), high, tokens)]

        async def run() -> float:
            start = time.perf_counter()
            handle = engine.submit(GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=1,
                                                     sampling=SamplingParams(temperature=0.0)))
            await handle.result()
            return time.perf_counter() - start

        seconds = [asyncio.run(run()) for _ in range(repeat)]
    finally:
        engine.stop()
    chunks = math.ceil(tokens / bucket)
    median = statistics.median(seconds)
    return {"artifacts": str(artifacts), "graph": graph, "prompt_tokens": tokens, "prefill_bucket": bucket,
            "chunks": chunks, "seconds": [round(s, 3) for s in seconds], "median_s": round(median, 3),
            "s_per_chunk": round(median / chunks, 4), "prompt_tok_per_s": round(tokens / median, 1)}
