"""What every bench prints: one table, then one JSON line; and the small measures they share."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def status_kib(pid: int | str = "self", field: str = "RssAnon") -> int:
    """A memory figure of /proc/PID/status (RssAnon, VmRSS, ...), in KiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/PID/status (Linux only)")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def report(results: dict[str, Any], json_path: Path | None = None) -> None:
    """A table, then the results as one JSON line (also written to `json_path`)."""
    width = max(len(k) for k in results)
    print(f"{'metric':<{width}}  value")
    for key, value in results.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()})
    print(line)
    if json_path is not None:
        json_path.write_text(line + "\n", encoding="utf-8")
