"""`ModelStructure`: what the host needs to know about the model, read from `cfg/` without a single weight.

The model is instantiated on the meta device (`accelerate.init_empty_weights()`, zero bytes of parameters)
so that facts like the embedding scale come from the model's own modules, not from a formula typed by hand:
a hand-typed `sqrt(hidden)` is exactly the kind of thing that silently goes wrong for the next model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelStructure:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    final_softcap: float | None
    embed_scale: float
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    max_position_embeddings: int | None
    # Sampling defaults of generation_config.json (temperature, top_k, top_p, ...), for unset request fields.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, cfg_dir: Path | str) -> ModelStructure:
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg_dir = Path(cfg_dir)
        config = AutoConfig.from_pretrained(cfg_dir)
        text = config.get_text_config()
        if getattr(text, "hidden_size_per_layer_input", 0):
            # Per-layer embeddings (Gemma-4 E2B/E4B) need input ids inside the graph; the contract passes embeddings.
            raise ValueError(
                f"{cfg_dir}/config.json: per-layer input embeddings (hidden_size_per_layer_input="
                f"{text.hidden_size_per_layer_input}) are not supported by the embeddings-in graph contract"
            )
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(text)
        embedding = model.get_input_embeddings()
        scale = getattr(embedding, "scalar_embed_scale", None)
        if scale is None:
            buffer = getattr(embedding, "embed_scale", None)
            scale = float(buffer) if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta" else 1.0
        layer_types = tuple(getattr(text, "layer_types", None) or ("full_attention",) * text.num_hidden_layers)

        generation = _read_json(cfg_dir / "generation_config.json")
        eos = generation.get("eos_token_id", getattr(text, "eos_token_id", None))
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
        defaults = {k: generation[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                    if generation.get(k) is not None}
        if generation.get("do_sample") is False:
            defaults["temperature"] = 0.0  # the model's authors ask for greedy decoding

        return cls(
            model_type=text.model_type,
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            num_layers=int(text.num_hidden_layers),
            layer_types=layer_types,
            sliding_window=getattr(text, "sliding_window", None),
            final_softcap=getattr(text, "final_logit_softcapping", None),
            embed_scale=float(scale),
            eos_token_ids=eos_ids,
            bos_token_id=generation.get("bos_token_id", getattr(text, "bos_token_id", None)),
            pad_token_id=generation.get("pad_token_id", getattr(text, "pad_token_id", None)),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            generation_defaults=defaults,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
