"""Model configs the tests hold as facts of their own (never taken from server/, which they check)."""

from __future__ import annotations

from typing import Any

# The Gemma-4 26B-A4B text config of the published build (its config.json's text part); only its shapes matter.
GEMMA4_26B_A4B: dict[str, Any] = {
    "model_type": "gemma4_text",
    "architectures": ["Gemma4ForCausalLM"],
    "_name_or_path": "gemma-4-26B-A4B-it",
    "vocab_size": 262_144,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "attention_k_eq_v": True,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
}
