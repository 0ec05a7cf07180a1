"""Host memory while a graph loads: peak anonymous RSS (`RssAnon`) against the server's own baseline.

    python -m server bench load --artifacts DIR [--graph jit] [--json PATH]

Baseline: RssAnon once the host side is up (tokenizer, structure, memory-mapped table), before the graph. Peak:
the highest RssAnon a separate sampler process sees (every 2 ms, from /proc, so a load that holds the GIL cannot
hide from it) while the engine's graph loader runs. The first graph call's peak is reported apart (on CPU its
working memory, e.g. the experts' einsum operands, is the compute's, not the load's).

A v2 graph with `--weights separate` memory-maps its per-rank files: its weights are file-backed pages (RssFile),
which the kernel can drop, not anonymous memory, which on a 16 GB host needs RAM or swap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from server.tools.bench.report import status_kib

SAMPLER = """
import select, sys, time
pid, interval, peak = sys.argv[1], float(sys.argv[2]), 0
print("ready", flush=True)
while True:
    with open(f"/proc/{pid}/status") as f:
        peak = max([peak] + [int(line.split()[1]) for line in f if line.startswith("RssAnon:")])
    if select.select([sys.stdin], [], [], 0)[0]:  # the parent asks: report the peak so far, start a new one
        command = sys.stdin.readline().strip()
        print(peak, flush=True)
        peak = 0
        if command != "next":
            break
    time.sleep(interval)
"""


def measure_load_memory(root: Path, graph: str = "jit") -> dict[str, float]:
    import torch

    from server.app.runtime import graph_loader, load_host

    host = load_host(root, graph)
    weight_bytes = sum((root / f).stat().st_size for f in host.spec.weight_files)
    baseline = status_kib()
    sampler = subprocess.Popen([sys.executable, "-c", SAMPLER, str(os.getpid()), "0.002"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert sampler.stdout is not None and sampler.stdin is not None
    sampler.stdout.readline()  # "ready"
    started = time.monotonic()
    loaded = graph_loader(host)()
    load_s = time.monotonic() - started
    sampler.stdin.write("next\n")
    sampler.stdin.flush()
    load_peak = max(int(sampler.stdout.readline()), status_kib())
    # One decode step: the weights are really read (file pages come in as RssFile, not RssAnon). Its transient
    # working memory is the compute's, not the load's, and reported apart.
    with torch.inference_mode():
        loaded.forward(host.embedding.lookup([2]), torch.tensor([[0]]))
    sampler.stdin.write("stop\n")
    sampler.stdin.close()
    step_peak = int(sampler.stdout.readline())
    sampler.wait()
    after = status_kib()
    return {
        "graph_weight_file_mb": weight_bytes / 1e6,
        "graph_file_mb": (host.artifacts.graph_file.stat().st_size / 1e6) if host.artifacts.graph_file else 0.0,
        "rss_anon_baseline_mb": baseline / 1024,
        "rss_anon_peak_during_load_mb": load_peak / 1024,
        "peak_over_baseline": load_peak / baseline,
        "rss_anon_peak_during_first_step_mb": max(step_peak, after) / 1024,
        "rss_anon_after_first_step_mb": after / 1024,
        "load_s": load_s,
    }
