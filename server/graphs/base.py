"""The one protocol every device-side graph answers, whatever runs it (Neuron, transformers, nothing).

    forward(embeds [1, T, H], positions [1, T]) -> logits [1, T, V]      (T <= prefill_bucket)

A graph compiled for several prefill lengths also exposes `prefill_buckets` (ascending; the largest is
`prefill_bucket`); the engine plans its prefill chunks over them (server/engine/buckets.py).

The KV cache lives with the graph; slot = absolute position. The engine decides what to (re)compute
and calls `rewind(n)` first to say "slots >= n are stale"; the graph answers from which position it can
really continue (a transformers sliding-window ring buffer cannot go back once it has wrapped).

`on_submit`: a graph calls it once its host-side inputs are built, right before the device work. The engine
publishes the previous token there: the event loop's thread then formats and sends that chunk while the device
runs, instead of taking the GIL from the device-owner thread while that thread is still building inputs (every
torch call releases the GIL, and getting it back waited for the whole chunk: ~0.4-0.6 ms in one token of ten).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

# graph.json's `input_dtype` (and `export --dtype`) names -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Graph(Protocol):
    max_total: int  # KV slots: prompt + completion never exceed this
    prefill_bucket: int  # the most tokens one call takes
    input_dtype: torch.dtype  # what `embeds` must be
    vocab_size: int
    # The final logit soft-cap the host must still apply (None when the graph applies it, or the model has none).
    host_softcap: float | None
    name: str

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """embeds [1, T, H], positions [1, T] int64 -> logits [1, T, V] f32 ([1, 1, V] with last_only)."""
        ...

    def rewind(self, position: int) -> int:
        """Forget slots >= position; return the position the next forward must start at (<= position)."""
        ...
