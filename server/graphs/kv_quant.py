"""The recipe's int8 KV quantizer (`--kv-quant int8`), for what outside the graphs measures it.

Only the graphs may import the vendored recipe (pyproject's import contracts), so the bench that proves int8 KV on
real weights (tools/bench/kv_quant.py) reaches the recipe's own function through here rather than a copy of it: what
is measured is what a v3 `--kv-quant int8` build stores.
"""

from __future__ import annotations

import torch

from server.vendor.tp_mb_moe_sqz import quantize_kv


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> what attention reads back from an int8 KV cache: int8 values times one f32 scale per vector."""
    q, scale = quantize_kv(x)
    return (q.to(torch.int8).float() * scale).to(x.dtype)  # through int8 as stored, then the compute dtype


__all__ = ["quantize_kv", "round_trip"]
