"""The one protocol every device-side graph answers, whatever runs it (Neuron, transformers, nothing).

    forward(embeds [1, T, H], positions [1, T][, block_ids [1, T]]) -> logits [1, T, V]      (T <= prefill_bucket)

A graph compiled for several prefill lengths also exposes `prefill_buckets` (ascending; the largest is
`prefill_bucket`); the engine plans its prefill chunks over them (server/engine/buckets.py).

The KV cache lives with the graph; slot = absolute position. The engine decides what to (re)compute
and calls `rewind(n)` first to say "slots >= n are stale"; the graph answers from which position it can
really continue (a transformers sliding-window ring buffer cannot go back once it has wrapped).

Protocol v3 (`SlotGraph`, the interface a batching scheduler drives): `slots` independent KV caches, decode over
several rows at once, each row in its own slot at its own position:

    prefill(embeds [1, T, H], positions [1, T], slot, *, last_only, block_ids) -> logits [1, T, V] ([1, 1, V] w/ last_only)
    decode(embeds [B, 1, H], positions [B, 1], slots [B])           -> logits [B, V]
    rewind_slot(slot, position) -> int                                (rewind, per slot)

The compiled v3 graph (graphs/jit.py) answers it natively; every one-slot graph answers it through `OneSlot`, thin
adapters over the `forward` / `rewind` the engine calls today (which stay as they are), so one scheduler can drive
every graph. The per-slot rewind has a name of its own: `rewind(position)` is what the engine calls on every graph.

`on_submit`: a graph calls it once its host-side inputs are built, right before the device work. The engine
publishes the previous token there: the event loop's thread then formats and sends that chunk while the device
runs, instead of taking the GIL from the device-owner thread while that thread is still building inputs (every
torch call releases the GIL, and getting it back waited for the whole chunk: ~0.4-0.6 ms in one token of ten).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [1, T, H], positions [1, T] int64 -> logits [1, T, V] f32 ([1, 1, V] with last_only).
        `block_ids` [1, T]: image blocks (VisionEncoder below); passed only when the prompt has images, so a text-only
        graph need not take the keyword."""
        ...

    def rewind(self, position: int) -> int:
        """Forget slots >= position; return the position the next forward must start at (<= position)."""
        ...


class SlotGraph(Protocol):
    """Protocol v3 (the module docs): what a scheduler of several conversations calls."""

    slots: int  # independent KV caches (1 for v1, v2, hf, null)
    decode_batches: tuple[int, ...]  # rows one decode call takes, ascending (a call of B rows runs the smallest >= B)
    prefill_buckets: tuple[int, ...]

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [1, T, H], positions [1, T] into `slot` -> logits [1, T, V] f32 ([1, 1, V] with last_only);
        `block_ids` [1, T] as `Graph.forward`'s."""
        ...

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """embeds [B, 1, H], positions [B, 1], B distinct slots -> logits [B, V] f32; row b in slot slots[b]."""
        ...

    def rewind_slot(self, slot: int, position: int) -> int:
        """`rewind` for one slot: forget its positions >= position; return where its next call must start."""
        ...


class OneSlot:
    """Protocol v3 for a one-slot graph: slot 0 is its one KV cache, a decode batch is one row. Adapters over the
    graph's own `forward` and `rewind`, which they call unchanged."""

    slots = 1
    decode_batches: tuple[int, ...] = (1,)
    # The graph class this is mixed into supplies `forward` and `rewind` (Graph): nothing here overrides them.
    forward: Callable[..., torch.Tensor]
    rewind: Callable[[int], int]

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        checked_slots([slot], 1)
        # block_ids only when there are images: a text-only graph's forward need not know the keyword
        blocks = {} if block_ids is None else {"block_ids": block_ids}
        return self.forward(embeds, positions, last_only=last_only, on_submit=on_submit, **blocks)  # [1, T, V]

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        if embeds.shape[0] != 1 or positions.shape != (1, 1):
            raise ValueError(f"a one-slot graph decodes one row: embeds {tuple(embeds.shape)}, positions "
                             f"{tuple(positions.shape)}")
        checked_slots(slots, 1)
        return self.forward(embeds, positions, last_only=True, on_submit=on_submit)[:, 0]  # [1, V]

    def rewind_slot(self, slot: int, position: int) -> int:
        checked_slots([slot], 1)
        return self.rewind(position)


class VisionEncoder(Protocol):
    """An image's soft tokens (issue 27), whatever runs the tower: a traced device graph (the recipe's `--vision`) or
    torch on the host (`--vision host`). Both answer exactly what transformers' Gemma-4 splices into `inputs_embeds`
    (`get_image_features(...).pooler_output`: the vision tower, then `embed_vision`'s projection into the language
    model's width).

    Image blocks in the language graph: `prefill` / `forward` take `block_ids [1, T]` int64 beside the positions
    (None = all text): 0 for a text token; the tokens of one image share one id > 0. On the layers the model's config
    names (sliding layers when `use_bidirectional_attention == "vision"`) such tokens attend to each other both ways,
    within the window; everything else stays causal. An image block is always inside one prefill call (the engine
    plans chunks so); decode steps never hold image tokens."""

    budgets: tuple[int, ...]  # the soft-token budgets (max_soft_tokens: 70, 140, 280, ...) it encodes, ascending

    def encode(self, pixel_values: torch.Tensor, position_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """pixel_values [1, P, D] f32 (P = budget * pooling_kernel_size**2 patch rows, padded), position_ids
        [1, P, 2] int64 ((-1, -1) on padding rows), both as the image processor gives them for `budget`
        -> soft tokens [N, H] (N = real patches / pooling_kernel_size**2), in `input_dtype`."""
        ...


def checked_slots(slots: Sequence[int] | torch.Tensor, count: int) -> list[int]:
    """`slots` as ints, refused (ValueError) unless they are distinct slots of a graph with `count` of them: the one
    check every protocol v3 graph makes of the slots it is given."""
    ids = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= s < count for s in ids):
        if count == 1:
            raise ValueError(f"a one-slot graph has slot 0 only, got slots {ids}")
        raise ValueError(f"slots must be distinct, in [0, {count}): got {ids}")
    return ids


def decode_batch_for(decode_batches: Sequence[int]) -> dict[int, int]:
    """Rows -> the compiled decode batch that runs them: the smallest that holds them (absent: too many rows)."""
    return {n: next(b for b in sorted(decode_batches) if b >= n) for n in range(1, max(decode_batches) + 1)}
