"""The reference graph: a `transformers` causal LM behind the same call shape, with a static KV cache.

It honours the artifact's bucket and max total like the device, but never pads: transformers' static
sliding-window cache is a ring buffer of window size, and pad tokens written into it evict real entries
(a 46-token prompt in padded 16-token chunks diverged from `generate()` at the second token).
For the same reason it can rewind its cache only while no sliding layer has wrapped; otherwise it resets.

Several users at once (protocol v3, graphs/base.py): `slots` static caches, one per conversation. A decode step of
B rows runs them one after another, each on its own cache at its own position: transformers has no clean batched
step over caches at different positions (a padded batch cache would again feed pads to the sliding ring), so the
demo interleaves users token by token; what it saves is nothing, what it gives is that no user waits for another's
whole answer. With one slot it is the one-slot graph it always was.

Images (issue 27, the image-block contract of server.graphs.base): a prefill with `block_ids` gets the masks
transformers' own Gemma-4 builds for its image blocks (`create_masks_for_vision_model`: causal on full layers; on
sliding layers causal or same-block, within the window), from per-slot group ids over absolute positions: the mask
reads them by position, so a later chunk still sees which earlier positions were which image.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from server.graphs.base import DTYPES, checked_slots
from server.model.artifacts import GraphSpec

DEMO_SLOTS = 4  # what `serve --graph hf` keeps (its --max-batch, if set): a few chat tabs stream together


class HFGraph:
    name = "hf"

    def __init__(self, checkpoint: Path | str, spec: GraphSpec, *, device: str = "cpu", slots: int = 1) -> None:
        from transformers import AutoModelForCausalLM, StaticCache

        self.device = torch.device(device)
        dtype = DTYPES[spec.input_dtype]
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to as a decorator
        config = self.model.config.get_text_config()
        self.max_total = spec.max_total
        self.prefill_bucket = spec.prefill_bucket
        self.prefill_buckets = (spec.prefill_bucket,)
        self.input_dtype = dtype
        self.vocab_size = int(config.vocab_size)
        self.host_softcap = None  # transformers applies the final soft-cap itself
        self.image_blocks = True  # block_ids get transformers' own Gemma-4 masks (the module docs)
        self.copies_slots = True
        self.slots = slots
        self.decode_batches = tuple(range(1, slots + 1))  # any number of rows: they run one after another
        self.caches = [StaticCache(config=self.model.config, max_cache_len=spec.max_total) for _ in range(slots)]
        self.positions = [0] * slots  # per slot: the next position its cache writes
        # per slot, per position: the image block it belongs to (-1: text), as transformers' block_sequence_ids
        self.groups = [torch.full((1, spec.max_total), -1, dtype=torch.int64) for _ in range(slots)]

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.prefill(embeds, positions, 0, last_only=last_only, on_submit=on_submit, block_ids=block_ids)

    def rewind(self, position: int) -> int:
        return self.rewind_slot(0, position)

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        checked_slots([slot], self.slots)
        t = embeds.shape[1]  # embeds [1, T, H], positions [1, T]
        assert 1 <= t <= self.prefill_bucket, f"chunk of {t} tokens, bucket is {self.prefill_bucket}"
        assert int(positions[0, 0]) == self.positions[slot], "the static cache writes sequentially: rewind first"
        assert self.positions[slot] + t <= self.max_total, "beyond max_total"
        embeds, positions = embeds.to(self.device, self.input_dtype), positions.to(self.device)
        masks = None if block_ids is None else self._block_masks(slot, embeds, positions, block_ids)
        if on_submit is not None:
            on_submit()
        out = self.model(inputs_embeds=embeds, position_ids=positions, cache=self.caches[slot], use_cache=True,
                         logits_to_keep=1 if last_only else 0, attention_mask=masks)
        self.positions[slot] += t
        logits: torch.Tensor = out.logits  # [1, T, V]
        return logits.float().cpu()

    def _block_masks(self, slot: int, embeds: torch.Tensor, positions: torch.Tensor,
                     block_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """transformers' Gemma-4 masks for a chunk holding image blocks (block_ids [1, T]: 0 text, i > 0 image i)."""
        from transformers.models.gemma4.modeling_gemma4 import create_masks_for_vision_model

        begin, t = self.positions[slot], embeds.shape[1]
        groups = self.groups[slot]  # [1, MAX]
        ids = block_ids[0].to(torch.int64)  # [T]
        chunk = torch.full((t,), -1, dtype=torch.int64)
        for number in ids.unique().tolist():
            if number > 0:
                where = (ids == number).nonzero().flatten()
                chunk[where] = begin + int(where[0])  # a group id unique in the slot: its first position
        groups[0, begin : begin + t] = chunk
        return create_masks_for_vision_model(config=self.model.config.get_text_config(), inputs_embeds=embeds,
                                             attention_mask=None, cache=self.caches[slot], position_ids=positions,
                                             block_sequence_ids=groups[:, : begin + t])

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        rows = embeds.shape[0]  # embeds [B, 1, H], positions [B, 1]
        assert embeds.shape[1] == 1 and positions.shape == (rows, 1) and len(slots) == rows
        checked_slots(slots, self.slots)
        logits = [self.prefill(embeds[b : b + 1], positions[b : b + 1], slot, last_only=True,
                               on_submit=on_submit if b == 0 else None)[:, 0] for b, slot in enumerate(slots)]  # [1, V]
        return torch.cat(logits)  # [B, V]

    @torch.inference_mode()  # the cache tensors were created under inference mode: only it may update them
    def rewind_slot(self, slot: int, position: int) -> int:
        from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

        checked_slots([slot], self.slots)
        cache, written = self.caches[slot], self.positions[slot]
        if position >= written:
            return written
        self.groups[slot][0, position:] = -1
        layers = cache.layers
        wrapped = any(isinstance(layer, StaticSlidingWindowLayer) and layer.get_seq_length() > layer.max_cache_len
                      for layer in layers)
        if wrapped or not layers:
            cache.reset()
            self.groups[slot].fill_(-1)
            self.positions[slot] = 0
            return 0
        for layer in layers:  # a static cache's layers: StaticLayer, or its sliding-window kind
            if isinstance(layer, StaticLayer) and layer.is_initialized:
                layer.crop(-(written - position))  # negative: drop that many of the newest slots
        self.positions[slot] = position
        return position

    @torch.inference_mode()  # the cache tensors are inference tensors: only inference mode may copy them
    def copy_slot(self, src: int, dst: int) -> None:
        checked_slots([src, dst], self.slots)
        # A whole copy of transformers' cache object: its layers initialise lazily and the sliding kind keeps counters
        # beside the tensors, so copying tensors alone would miss state.
        self.caches[dst] = copy.deepcopy(self.caches[src])
        self.positions[dst] = self.positions[src]
        self.groups[dst].copy_(self.groups[src])
