"""Process-wide start-up policy, in one place: the garbage collector, torch's threads, the C heap.

`serve` applies all of it; the engine builder (runtime.build_engine) applies what the per-token path depends on,
so tests and the bench measure what serving runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Start-up creates millions of objects that live as long as the process (torch's and the web stack's modules,
    the tokenizer): the collector's passes over them find nothing and cost ~0.2 s of a ~3 s start."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def freeze_heap() -> None:
    """Once the graph is loaded: everything built so far lives as long as the process. Freezing it out of the
    collector's generations stops full collections from walking those millions of objects in the middle of a
    stream (they were the p99 of the per-token host overhead)."""
    gc.collect()
    gc.freeze()


def single_threaded_torch(graph_kind: str) -> None:
    """The host's per-token work is small ops over 262k logits; with 2 intra-op threads each one stalls for
    milliseconds whenever the other core is busy (thread-pool hand-off), single-threaded they are steady
    (measured: default sampling 0.13-0.17 ms vs 8 ms median under load). The hf graph keeps torch's threads for
    its own matmuls."""
    if graph_kind in ("jit", "null"):
        import torch

        torch.set_num_threads(1)


def release_freed_memory() -> None:
    """Hand the heap that start-up parsing freed back to the OS (glibc keeps it otherwise).

    Parsing the 33 MB tokenizer.json leaves ~200 MB of freed-but-resident heap; on a 16 GB host that also has to
    stage the graph once, it is worth a call. A no-op where glibc is not the allocator.
    """
    with contextlib.suppress(OSError, AttributeError):  # the process's own symbols: glibc's, when it is the allocator
        ctypes.CDLL(None).malloc_trim(0)
