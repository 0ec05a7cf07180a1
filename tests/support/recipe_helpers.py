"""Helpers for tests/test_recipe.py: a tiny random Gemma-4 MoE checkpoint, contract inputs, greedy drivers, TP sim.

The contract inputs are rebuilt here from the ARCHITECTURE.md text rather than taken from the recipe, so a
misreading of the contract in the recipe cannot hide behind the same misreading in the test.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tests.support.models import TINY_GEMMA4_LAYERS, tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "server" / "vendor" / "tp_mb_moe_sqz.py"


def load_recipe():
    """The recipe as the standalone script it is (no dependency on how `server` is importable in this run)."""
    name = "tp_mb_moe_sqz"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # TorchScript resolves classes (ContractDispatch) through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


# Tiny, but with every feature of the 26B: the tiny Gemma-4's layers (k_eq_v globals, MoE beside the shared MLP, tied
# lm_head, soft-cap; divisible by tp=2), both layer types (sliding window < prompt), proportional partial rope, layer
# scalars != 1; a 256-token vocabulary, so that the recipe's tables stay small.
TINY: dict[str, object] = dict(
    TINY_GEMMA4_LAYERS,
    vocab_size=256,
    num_hidden_layers=4,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LAYER_SCALARS = (0.55, 1.35, 0.8, 1.2)
SOFTCAP = 30.0


def tiny_config(**overrides: object):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**TINY, **overrides})


def make_tiny_hf(seed: int = 0, **overrides: object):
    """A random Gemma4ForCausalLM whose logits are peaked enough for greedy comparisons to be meaningful
    (`overrides`: TINY's fields changed, e.g. fewer layers or more positions)."""
    from transformers import Gemma4ForCausalLM

    cfg = tiny_config(**overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                # Router logits spread wider than the rest so top-k choices are not coin flips.
                std = 0.5 if "router.proj" in name else 0.1
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:  # norms, router scales, per-expert scales: around 1, not exactly 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                if "q_norm" in name or "k_norm" in name:
                    # Softer attention: with unit q/k norms (scaling 1.0) a random model is chaotic, and a 1e-6
                    # difference in summation order would already decide greedy ties.
                    p.mul_(0.3)
        # The table is shipped as bf16 (embed_tokens.pt); keep it bf16-exact so the f32 reference sees the same rows.
        emb = model.model.embed_tokens.weight
        emb.copy_(emb.to(torch.bfloat16).float())
        for layer, value in zip(model.model.layers, LAYER_SCALARS[: len(model.model.layers)], strict=True):
            layer.layer_scalar.fill_(value)
    model.generation_config.eos_token_id = None  # generate a fixed number of tokens
    model.generation_config.pad_token_id = 0
    return model


def int8_grid(weight: torch.Tensor) -> torch.Tensor:
    """Move each row onto an int8 grid with a power-of-two step and one entry at +-127 steps.

    Then per-row symmetric int8 is lossless (scale = the step exactly, q = the integers exactly), and the values
    are exact in bf16 too (<= 8 significant bits).
    """
    w = weight.detach().float()  # [..., out, in]
    step = 2.0 ** torch.round(torch.log2(w.abs().amax(dim=-1, keepdim=True) / 127.0))  # [..., out, 1]
    q = torch.round(w / step).clamp(-127, 127)  # [..., out, in]
    top = q.abs().argmax(dim=-1, keepdim=True)  # [..., out, 1]
    sign = torch.where(torch.gather(q, -1, top) < 0, -1.0, 1.0)
    q.scatter_(-1, top, sign * 127.0)
    return q * step


def snap_quantized_weights(model) -> None:
    """int8_grid every weight the recipe's int8 squeeze quantizes: experts, shared MLP, (tied) lm_head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name or ".mlp." in name or name.endswith("embed_tokens.weight"):
                p.copy_(int8_grid(p))


def save_tiny_checkpoint(directory: Path, model) -> Path:
    model.save_pretrained(directory)
    # Host files the recipe must carry into cfg/ (content irrelevant here).
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (directory / "chat_template.jinja").write_text("{{ messages }}")
    return directory


def export_cpu_artifacts(root: Path, model, max_total: int, bucket: int) -> Path:
    """The recipe's `--target cpu` artifact directory (root/artifacts) for `model`, with the real Gemma tokenizer
    (ids < 256 decode fine), as the server loads it."""
    checkpoint = save_tiny_checkpoint(root / "checkpoint", model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir() / name, checkpoint / name)
    out = root / "artifacts"
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
           "--max-total", str(max_total), "--prefill-bucket", str(bucket), "--quant", "none"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


# --------------------------------------------------------------------------------------------------------------------
# The host side of the contract
# --------------------------------------------------------------------------------------------------------------------


def host_embeds(table: torch.Tensor, ids: Sequence[int], hidden_size: int) -> torch.Tensor:
    """Rows x sqrt(hidden), cast to f32 first, as Gemma4TextScaledWordEmbedding does for an f32 model."""
    rows = table[torch.tensor(list(ids), dtype=torch.long)].to(torch.float32)  # [T, H]
    scale = torch.tensor(hidden_size**0.5, dtype=torch.float32)
    return (rows * scale)[None]  # [1, T, H]


def contract_tensors(positions: Sequence[int], max_total: int, window: int) -> tuple[torch.Tensor, ...]:
    """position_ids [1,T], onehot [1,1,MAX,T], full_mask [1,1,T,MAX], sliding_mask [1,1,T,MAX]."""
    t = len(positions)
    neg = torch.finfo(torch.float32).min
    pos = torch.tensor(list(positions), dtype=torch.int64)[None]
    onehot = torch.zeros(1, 1, max_total, t)
    full = torch.full((1, 1, t, max_total), neg)
    sliding = torch.full((1, 1, t, max_total), neg)
    for j, p in enumerate(positions):
        if p < max_total:
            onehot[0, 0, p, j] = 1.0
        for s in range(max_total):
            if s <= p:
                full[0, 0, j, s] = 0.0
                if s > p - window:
                    sliding[0, 0, j, s] = 0.0
    return pos, onehot, full, sliding


Step = Callable[..., torch.Tensor]  # (embeds, pos, onehot, full, sliding) -> logits [1, T, V]


def greedy(
    step: Step,
    table: torch.Tensor,
    prompt: Sequence[int],
    new_tokens: int,
    *,
    bucket: int,
    max_total: int,
    window: int,
    hidden_size: int,
) -> tuple[list[int], list[torch.Tensor]]:
    """Chunked prefill (last chunk padded; pad positions continue past the prompt), then greedy decode.

    Returns the new tokens and the soft-capped logits row that chose each of them.
    """
    rows: list[torch.Tensor] = []
    last = None
    for start in range(0, len(prompt), bucket):
        chunk = list(prompt[start : start + bucket])
        real = len(chunk)
        chunk += [0] * (bucket - real)  # pad token ids; their KV lands beyond the prompt and is overwritten later
        positions = list(range(start, start + bucket))
        logits = step(host_embeds(table, chunk, hidden_size), *contract_tensors(positions, max_total, window))
        last = logits[0, real - 1]
    tokens: list[int] = []
    pos = len(prompt)
    for _ in range(new_tokens):
        capped = SOFTCAP * torch.tanh(last.float() / SOFTCAP)
        rows.append(capped)
        token = int(torch.argmax(capped))
        tokens.append(token)
        logits = step(host_embeds(table, [token], hidden_size), *contract_tensors([pos], max_total, window))
        last = logits[0, 0]
        pos += 1
    return tokens, rows


def first_output(module) -> Step:
    def step(*inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = module(*inputs)
        return out[0] if isinstance(out, (tuple, list)) else out

    return step


# --------------------------------------------------------------------------------------------------------------------
# Tensor parallelism simulated with threads: one module per rank, real exchanges through a barrier
# --------------------------------------------------------------------------------------------------------------------


class ThreadGroup:
    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)  # a failing rank breaks it instead of hanging CI
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, rank: int, x: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]):
        self.slots[rank] = x
        self.barrier.wait()
        out = combine(list(self.slots))  # same order on every rank -> bit-identical results
        self.barrier.wait()  # nobody refills the slots before everyone has read them
        return out

    def collectives(self, rank: int, recipe):
        return recipe.Collectives(
            all_reduce=lambda x: self._exchange(rank, x, lambda xs: functools.reduce(torch.add, xs)),
            gather_last=lambda x: self._exchange(rank, x, lambda xs: torch.cat(xs, dim=-1)),
        )


def tp_step(ranks: Sequence[torch.nn.Module]) -> Step:
    """Run every rank on the same inputs; write each returned state back to its aliased parameter, like the device."""

    def step(*inputs: torch.Tensor) -> torch.Tensor:
        def run(module):
            with torch.no_grad():
                out = module(*inputs)
                for state, index in module.state_aliases().items():
                    state.copy_(out[index])
            return out[0]

        with ThreadPoolExecutor(len(ranks)) as pool:
            logits = list(pool.map(run, ranks))
        for other in logits[1:]:
            assert torch.equal(other, logits[0]), "ranks disagree after the lm_head gather"
        return logits[0]

    return step
