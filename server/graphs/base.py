"""The one protocol every device-side graph answers, whatever runs it (Neuron, transformers, nothing): `Graph`.

    prefill(embeds [1, T, H], positions [1, T], slot, *, last_only, block_ids) -> logits [1, T, V] ([1, 1, V] last_only)
    decode(embeds [B, 1, H], positions [B, 1], slots [B])                      -> logits [B, V]
    rewind_slot(slot, position) -> int
    copy_slot(src, dst)                                                        # when copies_slots

`slots` independent KV caches; a decode call takes several rows, each in its own slot at its own position, and runs the
smallest compiled batch that holds them. The KV cache lives with the graph; slot = absolute position. The engine says
"positions >= n are stale" with `rewind_slot(slot, n)`; the graph answers from which position that slot can really
continue (a sliding-window ring cannot go back once it has wrapped).

`copy_slot(src, dst)` makes slot dst hold what slot src holds (n > 1: a prompt prefilled once, its choices decoded side
by side). `copies_slots` says whether the graph can: a one-slot graph cannot, nor can a Neuron build without a copy
graph (docs/contract-v3.md); the engine then runs the choices one after another, as before.

A graph of one KV cache (v1, v2, the null graph, a test's stand-in) is the same protocol with one slot: `OneSlotGraph`
supplies the three calls over its own `forward` / `rewind`.

`pool` (optional: a graph without it, or with None, keeps KV per slot and a free slot is enough): KV lent by need,
`KVPool` below (a v4 build's global-layer blocks, graphs/blocks.py `KVBlocks`). The scheduler asks it before it
admits a prompt or runs a step, and evicts an idle slot's KV with `rewind_slot(slot, 0)`, which gives its blocks back.

`on_submit`: a graph calls it once its host-side inputs are built, right before the device work. The engine
publishes the previous tokens there: the event loop's thread then formats and sends those chunks while the device
runs, instead of taking the GIL from the device-owner thread while that thread is still building inputs (every
torch call releases the GIL, and getting it back waited for the whole chunk: ~0.4-0.6 ms in one token of ten).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

# graph.json's `input_dtype` (and `export --dtype`) names -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Graph(Protocol):
    name: str
    max_total: int  # positions per slot: prompt + completion never exceed this
    prefill_buckets: tuple[int, ...]  # the chunk lengths one prefill call takes, ascending (a shorter one is padded)
    input_dtype: torch.dtype  # what `embeds` must be
    vocab_size: int
    # The final logit soft-cap the host must still apply (None when the graph applies it, or the model has none).
    host_softcap: float | None
    slots: int  # independent KV caches
    decode_batches: tuple[int, ...]  # rows one decode call takes, ascending (a call of B rows runs the smallest >= B)
    image_blocks: bool  # prefill takes `block_ids` naming images (VisionEncoder below); else only all-text ids
    copies_slots: bool  # copy_slot works

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [1, T, H], positions [1, T] int64 into `slot` -> logits [1, T, V] f32 ([1, 1, V] with last_only).
        `block_ids` [1, T]: image blocks (VisionEncoder below); None = all text."""
        ...

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        """embeds [B, 1, H], positions [B, 1], B distinct slots -> logits [B, V] f32; row b in slot slots[b]."""
        ...

    def rewind_slot(self, slot: int, position: int) -> int:
        """Forget `slot`'s positions >= position; return where its next call must start (<= position)."""
        ...

    def copy_slot(self, src: int, dst: int) -> None:
        """Slot `dst` holds exactly what slot `src` holds (its own KV forgotten): its next call continues where src's
        would. Only when `copies_slots`."""
        ...


class KVPool(Protocol):
    """KV a graph lends by need (module docs): blocks of `block_size` positions, held per slot."""

    block_size: int

    def blocks_for(self, tokens: int) -> int: ...
    def held(self, row: int) -> int: ...  # blocks slot `row` holds now
    def shortfall(self, needs: Mapping[int, int]) -> int: ...  # blocks missing for slot -> positions it must hold
    @property
    def free_blocks(self) -> int: ...
    @property
    def in_use(self) -> int: ...  # blocks lent
    @property
    def reach(self) -> int: ...  # the most positions one slot can ever hold


def kv_pool(graph: object) -> KVPool | None:
    """The graph's pool of KV lent by need, or None (KV per slot: v1-v3, hf, a null graph without one)."""
    pool: KVPool | None = getattr(graph, "pool", None)
    return pool


class OneSlotGraph:
    """The base of a graph with one KV cache: slot 0, a decode batch of one row. Subclasses supply `forward` (a chunk
    at its positions; its logits) and `rewind` (positions >= n stale; where to continue), which tests call directly."""

    slots = 1
    decode_batches: tuple[int, ...] = (1,)
    image_blocks = False
    copies_slots = False

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [1, T, H], positions [1, T] -> logits [1, T, V] ([1, 1, V] with last_only)."""
        raise NotImplementedError

    def rewind(self, position: int) -> int:
        raise NotImplementedError

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        checked_slots([slot], 1)
        blocks = {} if block_ids is None else {"block_ids": block_ids}  # a text-only forward need not take the keyword
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

    def copy_slot(self, src: int, dst: int) -> None:
        checked_slots([src, dst], 1)  # always refused: one slot has no other to copy into


class VisionEncoder(Protocol):
    """An image's soft tokens (issue 27), whatever runs the tower: a traced device graph (the recipe's `--vision`) or
    torch on the host (`--vision host`). Both answer exactly what transformers' Gemma-4 splices into `inputs_embeds`
    (`get_image_features(...).pooler_output`: the vision tower, then `embed_vision`'s projection into the language
    model's width).

    Image blocks in the language graph (`Graph.image_blocks`): `prefill` takes `block_ids [1, T]` int64 beside the
    positions (None = all text): 0 for a text token; the tokens of one image share one id > 0. On the layers the
    model's config names (sliding layers when `use_bidirectional_attention == "vision"`) such tokens attend to each
    other both ways, within the window; everything else stays causal. An image block is always inside one prefill
    call (the engine plans chunks so); decode steps never hold image tokens."""

    budgets: tuple[int, ...]  # the soft-token budgets (max_soft_tokens: 70, 140, 280, ...) it encodes, ascending
    # True: torch on the host (the engine encodes on a host worker, off the device thread); False: a device graph
    # (encoded on the device thread, right before the image's chunk)
    on_host: bool

    def encode(self, pixel_values: torch.Tensor, position_ids: torch.Tensor, budget: int) -> torch.Tensor:
        """pixel_values [1, P, D] f32 (P = budget * pooling_kernel_size**2 patch rows, padded), position_ids
        [1, P, 2] int64 ((-1, -1) on padding rows), both as the image processor gives them for `budget`
        -> soft tokens [N, H] (N = real patches / pooling_kernel_size**2), in `input_dtype`."""
        ...


def checked_slots(slots: Sequence[int] | torch.Tensor, count: int) -> list[int]:
    """`slots` as ints, refused (ValueError) unless they are distinct slots of a graph with `count` of them: the one
    check every graph makes of the slots it is given."""
    ids = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= s < count for s in ids):
        if count == 1:
            raise ValueError(f"a one-slot graph has slot 0 only, got slots {ids}")
        raise ValueError(f"slots must be distinct, in [0, {count}): got {ids}")
    return ids


def decode_batch_for(decode_batches: Sequence[int]) -> dict[int, int]:
    """Rows -> the compiled decode batch that runs them: the smallest that holds them (absent: too many rows)."""
    return {n: next(b for b in sorted(decode_batches) if b >= n) for n in range(1, max(decode_batches) + 1)}
