"""The reference graph: a `transformers` causal LM behind the same call shape, with a static KV cache.

It honours the artifact's bucket and max total like the device, but never pads: transformers' static
sliding-window cache is a ring buffer of window size, and pad tokens written into it evict real entries
(a 46-token prompt in padded 16-token chunks diverged from `generate()` at the second token).
For the same reason it can rewind its cache only while no sliding layer has wrapped; otherwise it resets.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from server.graphs.base import DTYPES, OneSlot
from server.model.artifacts import GraphSpec


class HFGraph(OneSlot):
    name = "hf"

    def __init__(self, checkpoint: Path | str, spec: GraphSpec, *, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, StaticCache

        self.device = torch.device(device)
        dtype = DTYPES[spec.input_dtype]
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(self.device).eval()
        config = self.model.config.get_text_config()
        self.max_total = spec.max_total
        self.prefill_bucket = spec.prefill_bucket
        self.prefill_buckets = (spec.prefill_bucket,)
        self.input_dtype = dtype
        self.vocab_size = int(config.vocab_size)
        self.host_softcap = None  # transformers applies the final soft-cap itself
        self.cache = StaticCache(config=self.model.config, max_cache_len=spec.max_total)
        self.position = 0  # the next slot the cache writes

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        t = embeds.shape[1]  # embeds [1, T, H], positions [1, T]
        assert 1 <= t <= self.prefill_bucket, f"chunk of {t} tokens, bucket is {self.prefill_bucket}"
        assert int(positions[0, 0]) == self.position, "the static cache writes sequentially: rewind first"
        assert self.position + t <= self.max_total, "beyond max_total"
        embeds, positions = embeds.to(self.device, self.input_dtype), positions.to(self.device)
        if on_submit is not None:
            on_submit()
        out = self.model(inputs_embeds=embeds, position_ids=positions, cache=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        self.position += t
        return out.logits.float().cpu()  # [1, T, V]

    @torch.inference_mode()  # the cache tensors were created under inference mode: only it may update them
    def rewind(self, position: int) -> int:
        if position >= self.position:
            return self.position
        layers = getattr(self.cache, "layers", [])
        wrapped = any(getattr(layer, "is_sliding", False) and layer.get_seq_length() > layer.max_cache_len for layer in layers)
        if wrapped or not layers:
            self.cache.reset()
            self.position = 0
            return 0
        for layer in layers:
            if getattr(layer, "is_initialized", False):
                layer.crop(-(self.position - position))  # negative: drop that many of the newest slots
        self.position = position
        return position
