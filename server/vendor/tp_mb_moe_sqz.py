#!/usr/bin/env python
"""Compile recipe for Gemma-4 26B-A4B on Inferentia2: NxD ModelBuilder, TP=2, the all-int8 squeeze.

One standalone script (it imports nothing from ``server/``). It turns a transformers checkpoint into the
artifact directory the server drives:

    OUT/sqz_neff.pt        --target neuron: torch.jit.save of the ModelBuilder trace (weights inside)
    OUT/model.pt           --target cpu:    the same contract traced with torch.jit (KV in module buffers)
    OUT/embed_tokens.pt    bf16 [vocab, hidden]; the host looks rows up and multiplies by sqrt(hidden)
    OUT/cfg/               config.json, generation_config.json, tokenizer files, chat_template.jinja,
                           preprocessor_config.json (a model that reads images)
    OUT/graph.json         the contract record below

The graph contract ("gemma4-optb/v1"), positional tensors only:

    model(inputs_embeds f32 [1,T,H],      # embed_tokens rows x embed scale (the host does this)
          position_ids  int64 [1,T],
          onehot        f32 [1,1,MAX,T],  # 1 where s == position_ids[t]: the KV write slots
          full_mask     f32 [1,1,T,MAX],  # 0 where s <= position_ids[t], else finfo(f32).min
          sliding_mask  f32 [1,1,T,MAX])  # 0 where position_ids[t]-window < s <= position_ids[t], else min
      -> (logits f32 [1,T,V], *kv)        # no final soft-cap: the host applies cap*tanh(x/cap)

T is the prefill bucket or 1 (decode); anything else is refused.

Contract v2 ("gemma4-optb/v2", ``--contract v2``), the long-context graph:

    model(inputs_embeds f32 [1,T,H], position_ids int64 [1,T]) -> (logits f32 [1,T,V], *kv)

T is one of ``--prefill-buckets`` or 1. The graph builds its masks and KV write slots from the positions. Each layer
keeps a ring (slot = position mod R): R = window + largest bucket for sliding layers, MAX + largest bucket for
global ones (``Plan.ring_slots`` says why that is enough), and writes K/V with ``index_copy`` at the slots: O(T)
per call. ``--weights separate`` traces the graph without weights and writes each rank's shard to
``weights/tp{rank}_sharded_checkpoint.safetensors`` (NxD's own names; the server memory-maps them). graph.json
records every shape the host needs (buckets, kv_slots, sliding_window, inputs/outputs, weights).

Contract v3 ("gemma4-optb/v3", ``--contract v3 --kv-slots S --decode-batches 1,2,4``), several conversations:

    model(inputs_embeds f32 [B,T,H], position_ids int64 [B,T], slot_ids int64 [B]) -> (logits f32 [B,T,V], *kv)

The graph keeps S independent KV caches (per layer [S, kv_heads, R, D], each slot one v2 ring). B == 1 and T a
prefill bucket: a prefill into slot ``slot_ids[0]``; T == 1 and B one of ``--decode-batches``: a decode step, row b
reading and writing only slot ``slot_ids[b]`` at its own position, with its own ring mask (``SlotRingCache``,
``ring_mask``). Decode graphs gather the routed experts while B tokens read less than all of them
(``decode_experts``), dense above. graph.json adds ``kv_slots`` (S), ``decode_batches``, ``ring_slots`` (v2's
``kv_slots`` map, renamed: ``kv_slots`` is S here) and every cache shape. A batch the host rounds up to a compiled
size fills its spare rows without touching another slot (graphs/jit.py ``JitGraphV3``).

Contract v4 ("gemma4-optb/v4", ``--contract v4 --kv-blocks NB --block-size BS --context-buckets 4096,...``), KV
paid by need (issue 34; docs/contract-v4.md):

    model(inputs_embeds, position_ids, slot_ids int64 [B], block_table int32 [B,NBc]) -> (logits f32 [B,T,V], *kv)

Sliding layers keep v3's per-row rings (``slot_ids``); global layers keep one pool [NB, kv_heads, BS, D] per layer,
row b's position p in block ``block_table[b, p // BS]`` (``BlockCache``, ``table_mask``; block 0 is the null block
pads write into). One graph per (bucket or decode batch) x context bucket (NBc = context / BS). Prefill scratch is
bounded as v3's by default: prefill graphs take ``last_index`` after the table, one score graph at the smallest bucket
and the largest context (``Plan.score_context``) returns every row, and global layers attend in query tiles over the
gathered blocks (``DEFAULT_QUERY_TILE_V4``), and the prefill's dense experts run a group a pass
(``DEFAULT_EXPERT_GROUP_V4``); ``--prefill-logits all --query-tile 0 --expert-group 0`` builds them unbounded.
``--slot-table`` and ``--roofline`` with ``--contract v4`` project the issue's conversation mixes and the decode cost by context.
Reports without ``--config`` use the 26B-A4B's own text config (``CONFIG_26B``).

Images (``--vision``, v2/v3; issue 27). Two additions:

    prefill: model(inputs_embeds, position_ids[, slot_ids], block_ids int64 [1,T]) -> as above   (decode unchanged)
    tower:   vision(pixel_values f32 [1,P,3*patch**2], position_ids int64 [1,P,2]) -> soft tokens f32 [1,P/k**2,H]

``block_ids``: 0 = text, the tokens of one image share one id > 0 (ids are per call: an image block is always
inside one prefill call). On the layers the config names (sliding layers when ``use_bidirectional_attention`` is
"vision") a token also sees its own block's tokens, ahead of it too, within the window: transformers'
``create_masks_for_vision_model``, AND(window, OR(causal, same block)), built from inputs (``block_visible``); global
layers stay causal. The tower (``VisionTower``: transformers' vision encoder + ``embed_vision``) is its own graph,
one per ``--vision-budgets`` size (P = budget * k**2 patch rows, k = pooling_kernel_size, padded at (-1, -1)), TP-
sharded when that frees enough bytes per rank (``vision_sharded``), weights always in per-rank files
(``weights/vision/``). graph.json records ``block_ids`` and ``vision``; ``--residency``/``--slot-table --vision``
count the tower; ``--check-lowering --vision`` lowers the block-aware prefill and each budget's tower.

Design: the decoder layers are transformers' own ``Gemma4TextDecoderLayer`` (attention, router, norms, rotary,
layer scalars). Only what does not trace or shard is swapped:
  * the sparse experts loop -> ``DenseExperts``: every local expert runs on every token and is weighted by the
    router's top-k weights (0 for the others). Same numbers as HF's sparse loop, static shapes.
  * the KV cache -> one [1, kv_heads, MAX, head_dim] tensor per layer and K/V, written through the one-hot slot
    matrix (``SlotCache``); on the device these are aliased states, on CPU buffers updated in place.
  * nn.Linear -> ``ShardLinear``: a rank's slice of a column/row-parallel linear, optionally int8 per output
    channel. Sliding-window attention is sharded (8 kv heads), global attention replicated (2 kv heads), the
    shared MLP and the tied lm_head are column/row sharded, experts split by rank (rank r owns [E/tp*r, E/tp*(r+1))).

Everything above is plain PyTorch and runs (and is tested) on CPU. The Neuron part is ``build_neuron`` alone: it
imports torch_neuronx / neuronx_distributed inside the function, plugs NxD's collectives into the same modules and
hands them to ModelBuilder.

Usage:
    python tp_mb_moe_sqz.py --checkpoint HF_DIR --out DIR --target neuron|cpu [--tp 2] [--max-total 512]
                            [--prefill-bucket 128] [--quant int8|none]
                            [--contract v1|v2] [--prefill-buckets 128,512] [--weights inside|separate]
    python tp_mb_moe_sqz.py --residency --config CONFIG_JSON [--tp 2] [--quant int8|none] [--contract ...] [--json]
    python tp_mb_moe_sqz.py --check-lowering --config CONFIG_JSON [same build flags] [--json]
        (torch-xla on CPU; lowering is necessary for neuronx-cc, not sufficient)
    python tp_mb_moe_sqz.py --roofline --config CONFIG_JSON [--tp 2] [--attn-quant int8|none] [--json]  # a projection
    python tp_mb_moe_sqz.py --bench-experts [--quant int8|none] [--steps 16] [--threads 1] [--json]  # measured, CPU
    python tp_mb_moe_sqz.py --bench-batched [--quant int8|none] [--steps 16] [--threads 1] [--json]  # measured, CPU
    python tp_mb_moe_sqz.py --slot-table --contract v3 --config CONFIG_JSON [--max-total ...] [--json]  # projection
    v3 flags: --contract v3 --kv-slots S --decode-batches 1,2,4 (reports take them too)
    images:   --vision [--vision-budgets 70,280] (v2/v3; builds and reports take it)
    Build flags: --experts dense|selective (``SelectiveExperts``: decode reads only the routed experts),
                 --attn-quant none|int8 (attention projections per-channel int8 as well).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONTRACT = "gemma4-optb/v1"
CONTRACT_V2 = "gemma4-optb/v2"
CONTRACT_V3 = "gemma4-optb/v3"
CONTRACT_V4 = "gemma4-optb/v4"
# Per-rank weight files of a --weights separate build: NxD's own names (ModelBuilder.shard_checkpoint writes them).
RANK_WEIGHTS = "weights/tp{rank}_sharded_checkpoint.safetensors"
# Host-side files the server needs next to the graph; copied when the checkpoint has them.
CFG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    # The image processor's settings: a --vision build's server reads images with them (the host's processor).
    "preprocessor_config.json",
)
# The Gemma-4 26B-A4B text config (the published build's shapes; server/tools/bench/host.py keeps the same, a test
# holds them equal): the reports' config when none is given.
CONFIG_26B: dict = {
    "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
    "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "global_head_dim": 512, "num_global_key_value_heads": 2, "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
    "attention_k_eq_v": True, "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
}
COMPONENTS = ("experts", "attention", "shared_mlp", "lm_head", "other", "kv_cache")
QUANT_MODES = ("int8", "none")
EXPERT_MODES = ("dense", "selective")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PREFILL_LOGITS = ("last", "all")
# v2/v3 builds' default query tile for global layers (issue 34): 64 rows keep the 26B's live scores at 32k to
# 16 heads x 64 x 33,280 x 4 B = 0.136 GB per rank; fewer rows only add ops (512 / 64 = 8 tiles per global layer)
DEFAULT_QUERY_TILE = 64
# v4's: its prefill also holds one global layer's K and V gathered from the pool (0.13 GB per rank at 32k), and its
# score graph (every row's f32 logits, [128, V] = 0.13 GB) is compiled at the largest context, so its tile is a quarter
# of v3's: the 26B's 32k score graph holds 0.32 GB (0.36 with 32-row tiles, above issue 34's 0.35). The folded matmul
# still has 8 query heads x 16 = 128 rows per KV head, one full pass of the 128-row TensorEngine
DEFAULT_QUERY_TILE_V4 = 16


def default_query_tile(contract: str) -> int:
    """The query tile a build of `contract` gets unless --query-tile says otherwise (v1: none, untiled)."""
    return {"v2": DEFAULT_QUERY_TILE, "v3": DEFAULT_QUERY_TILE, "v4": DEFAULT_QUERY_TILE_V4}.get(contract, 0)


# v4 builds' prefill experts run 16 of their local experts a pass (issue 34): a prefill's widest live tensor was the
# dense path's gate+up of every local expert on every token, [T, E_l, 2I_l] (the 26B selective layout: 512 x 128 x
# 704 x 4 B = 0.18 GB per rank), more than the attention's scores; 16 a pass hold 0.023 GB, and the same weights are
# read once either way. v1-v3 keep one pass (0): their graphs trace exactly as before.
DEFAULT_EXPERT_GROUP_V4 = 16


def default_expert_group(contract: str) -> int:
    """The experts per pass of a build of `contract`'s dense experts path unless --expert-group says otherwise."""
    return {"v4": DEFAULT_EXPERT_GROUP_V4}.get(contract, 0)
# The name the tiled attention is registered under in transformers' AttentionInterface
TILED_ATTENTION = "gemma4_optb_query_tiles"


# --------------------------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------------------------


def text_config_from_dict(raw: Mapping) -> object:
    """A ``Gemma4TextConfig`` from a config dict (``gemma4_text``, or ``gemma4`` with a ``text_config``)."""
    from transformers import Gemma4TextConfig

    data = dict(raw)
    if "text_config" in data and data["text_config"] is not None:
        data = dict(data["text_config"])
    data.pop("model_type", None)
    data.pop("architectures", None)
    return Gemma4TextConfig(**data)


def load_text_config(checkpoint: Path) -> object:
    return text_config_from_dict(json.loads((checkpoint / "config.json").read_text()))


def check_supported(cfg, tp: int) -> None:
    """Fail early, with the reason, on configs this recipe does not build (rather than a shape error mid-trace)."""
    problems = []
    if cfg.hidden_size_per_layer_input:
        problems.append("per-layer inputs (hidden_size_per_layer_input != 0) are not part of the contract")
    if cfg.num_kv_shared_layers:
        problems.append("KV-shared layers (num_kv_shared_layers != 0) are not supported")
    if cfg.attention_bias:
        problems.append("attention_bias=True is not supported")
    # "vision" (bidirectional among image tokens only) leaves text causal; "all" would break the causal contract.
    if cfg.use_bidirectional_attention == "all":
        problems.append("use_bidirectional_attention='all' is not supported (the contract is causal)")
    if not cfg.enable_moe_block:
        problems.append("this is the MoE recipe: enable_moe_block must be True")
    if tp < 1:
        problems.append(f"tp must be >= 1, got {tp}")
    elif tp > 1:
        # Only sliding layers shard attention heads; kv heads are a per-layer attribute in transformers' config.
        sliding = [i for i, lt in enumerate(cfg.layer_types) if lt == "sliding_attention"]
        kvh = cfg.per_layer_config[sliding[0]].num_key_value_heads if sliding else tp
        for name, value in (
            ("num_attention_heads", cfg.num_attention_heads),
            ("sliding num_key_value_heads", kvh),
            ("num_experts", cfg.num_experts or 0),
            ("intermediate_size", cfg.intermediate_size),
            ("vocab_size", cfg.vocab_size),
        ):
            if value % tp:
                problems.append(f"{name}={value} is not divisible by tp={tp}")
    if problems:
        raise ValueError("unsupported Gemma-4 config: " + "; ".join(problems))


def check_slots(plan: Plan) -> None:
    """v3's KV slots and decode batches, checked before anything is built.

    A decode batch holds distinct slots, so no batch exceeds S. A batch rounded up to a compiled size fills its
    spare rows by shadowing real rows one position ahead in their own slot (graphs/jit.py): a row and its shadows
    write at most max(decode_batches) consecutive positions of one slot in a call, which the ring holds safely only
    up to the largest prefill bucket (Plan.ring_slots), so no decode batch may exceed that bucket either.
    """
    batches = tuple(plan.decode_batches)
    if plan.contract not in ("v3", "v4"):
        if plan.kv_slots != 1 or batches != (1,):
            raise ValueError("--kv-slots and --decode-batches need --contract v3 or v4")
        if plan.kv_int8:
            raise ValueError("--kv-quant int8 needs --contract v3 or v4")
        if plan.kv_blocks or plan.context_buckets:
            raise ValueError("--kv-blocks and --context-buckets need --contract v4")
        return
    problems = []
    if plan.contract == "v4":
        problems += check_blocks(plan)
    if plan.kv_slots < 1:
        problems.append(f"kv_slots must be >= 1, got {plan.kv_slots}")
    if not batches or list(batches) != sorted(set(batches)) or batches[0] < 1:
        problems.append(f"decode batches must be distinct positive sizes in ascending order, got {batches}")
    elif batches[-1] > plan.kv_slots:
        problems.append(f"decode batch {batches[-1]} exceeds the {plan.kv_slots} KV slots (one slot per row)")
    elif batches[-1] > max(plan.buckets):
        problems.append(f"decode batch {batches[-1]} exceeds the largest prefill bucket {max(plan.buckets)} "
                        "(padded rows write ahead of a real row; the ring holds that many positions)")
    if problems:
        raise ValueError(f"unsupported {plan.contract} plan: " + "; ".join(problems))


def check_blocks(plan: Plan) -> list[str]:
    """v4's block pool: what is wrong with it (nothing: []). Block 0 is the null block (pads and spare rows write
    there past a row's own blocks; no row owns it), so a pool needs one block more than it lends."""
    problems = []
    contexts = tuple(plan.context_buckets)
    if plan.block_size < 1:
        problems.append(f"block_size must be >= 1, got {plan.block_size}")
    elif not contexts or list(contexts) != sorted(set(contexts)):
        problems.append(f"context buckets must be distinct sizes in ascending order, got {contexts}")
    elif any(c % plan.block_size for c in contexts):
        problems.append(f"every context bucket must be a multiple of the block size {plan.block_size}, got {contexts}")
    elif contexts[-1] != plan.max_total:
        problems.append(f"the largest context bucket {contexts[-1]} must be max_total {plan.max_total}")
    if plan.kv_blocks < 2:
        problems.append(f"kv_blocks must be >= 2 (block 0 is the null block), got {plan.kv_blocks}")
    if plan.block_ids:
        problems.append("image-block ids (--vision) are not built for --contract v4 yet")
    return problems


# --------------------------------------------------------------------------------------------------------------------
# int8 per-output-channel symmetric quantization
# --------------------------------------------------------------------------------------------------------------------


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (one scale per row, over the last = input dim).

    scale = max|row| / 127, q = round(w / scale) in [-127, 127]. Since |w / scale| <= 127 nothing is clipped, so
    |w - q * scale| <= scale / 2 (up to f32 rounding). Works for [out, in] and for stacked experts [E, out, in].
    """
    w = weight.detach().float()  # [..., out, in]
    amax = w.abs().amax(dim=-1)  # [..., out]
    # An all-zero row would give scale 0 and 0/0; any scale reproduces it exactly, so use 1.
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [..., out]
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # [..., out, in]
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(-1)  # [..., out, in]


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """--kv-quant int8: symmetric int8 per K or V vector, one f32 scale per (slot, head, position).

    x [..., D] -> (q [..., D] f32 holding integers in [-127, 127], written into the int8 cache exactly; scale
    [..., 1] f32). The scale is max|x| / 127 over the vector, so nothing is clipped and |x - q * scale| <=
    scale / 2. Read back as ``q.float() * scale`` (SlotRingCache.update); tools/bench/kv_quant.py measures it on
    real weights through this same function.
    """
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [..., 1]: an all-zero vector stays 0
    return torch.round(x.float() / scale).clamp(-127, 127), scale  # [..., D], [..., 1]


# --------------------------------------------------------------------------------------------------------------------
# Tensor parallel plumbing (plain torch; NxD supplies the real collectives in build_neuron)
# --------------------------------------------------------------------------------------------------------------------


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Collectives:
    """The two collectives the modules need; identity on one rank, NxD's mappings on Neuron."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor] = _identity  # sum of partial results over ranks
    gather_last: Callable[[torch.Tensor], torch.Tensor] = _identity  # concat of rank slices along the last dim


LOCAL = Collectives()


def mark_parallel(param: nn.Parameter, dim: int, tp: int, stride: int = 1) -> None:
    """Tag a parameter the way NxD's checkpoint sharder reads it: split evenly along ``dim`` into ``tp`` chunks.

    With ``stride`` s the dim is cut into tp*s equal pieces and rank r takes pieces r, r+tp, ... (NxD's
    create_local_weight): stride 2 on a fused [gate; up] dim gives each rank its slice of gate and of up.
    """
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride
    param.num_partitions = tp


def is_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_state_dict(model: nn.Module, full: Mapping[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """One rank's view of a full (unsharded) checkpoint; the CPU twin of NxD's get_sharded_checkpoint."""
    local: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name not in full:
            continue
        tensor = full[name]
        if is_parallel(param):
            dim = param.partition_dim
            if tensor.shape[dim] % (tp * param.partition_stride):
                raise ValueError(f"{name}: dim {dim} of {tuple(tensor.shape)} does not split into {tp}")
            pieces = torch.chunk(tensor, tp * param.partition_stride, dim=dim)
            tensor = torch.cat(pieces[rank::tp], dim=dim).contiguous()
        local[name] = tensor
    return local


# --------------------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------------------


class ShardLinear(nn.Module):
    """y = x @ W^T for one rank's slice of W [out, in], float or int8 with a per-output-channel scale.

    mode "replicated": the whole W on every rank; "col": output features split (the output stays split unless
    gather_output); "row": input features split, partial sums all-reduced. Scales are per output channel, so a
    row-parallel int8 weight keeps all of them on every rank.
    """

    keep_f32 = ("scale",)  # scales stay f32 whatever the compute dtype: they carry the int8 weights' precision

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mode: str,
        tp: int,
        quant: bool,
        dtype: torch.dtype,
        coll: Collectives,
        gather_output: bool = False,
        weight_left: bool = False,
    ) -> None:
        super().__init__()
        # weight_left: compute y^T = W @ x^T (the lm_head). For a few rows against a vocabulary-sized W, MKL runs that
        # form 2-3x faster than F.linear's x @ W^T on CPU (26 vs 32 ms for 1 row, 16 vs 42 ms for 4, at 262144 x
        # 256 f32); the same products and sums. The output is then transposed, which only the logits can afford.
        self.weight_left = weight_left
        if mode not in ("replicated", "col", "row"):
            raise ValueError(f"unknown mode {mode!r}")
        split_dim = {"col": 0, "row": 1}.get(mode)
        local = [out_features, in_features]  # [out, in] on this rank
        if split_dim is not None:
            if local[split_dim] % tp:
                raise ValueError(f"[{out_features}, {in_features}] does not split {mode}-wise over tp={tp}")
            local[split_dim] //= tp
        out_local, in_local = local
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.quant, self.gather_output, self.coll = mode, quant, gather_output, coll
        if quant:
            self.qweight = nn.Parameter(torch.empty(out_local, in_local, dtype=torch.int8), requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_local, dtype=torch.float32), requires_grad=False)
            if split_dim is not None:
                mark_parallel(self.qweight, split_dim, tp)
            if mode == "col":
                mark_parallel(self.scale, 0, tp)
        else:
            self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
            if split_dim is not None:
                mark_parallel(self.weight, split_dim, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_local] -> [..., out_local] (or [..., out])
        weight = self.qweight.to(x.dtype) if self.quant else self.weight  # [out_local, in_local]
        y = torch.matmul(weight, x.mT).mT if self.weight_left else F.linear(x, weight)  # [..., out_local]
        if self.quant:
            # Per-output-channel scale commutes with the matmul: scale the [.., out] result, not the weight.
            y = (y.float() * self.scale).to(x.dtype)
        if self.mode == "row":
            y = self.coll.all_reduce(y)
        elif self.mode == "col" and self.gather_output:
            y = self.coll.gather_last(y)  # [..., out]
        return y

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, mode={self.mode}, int8={self.quant}"


class DenseExperts(nn.Module):
    """Drop-in for Gemma4TextExperts: all local experts on all tokens, weighted by the top-k router weights.

    HF loops over the experts that were hit (data-dependent shapes, does not trace). Here every local expert runs
    and a token's output is sum_e w[t, e] * expert_e(x_t) with w = the router's top-k weight for e, 0 otherwise:
    the same sum as HF's sparse loop, with static shapes. Rank r of tp holds experts [E_l*r, E_l*(r+1)); ``rank``
    is a runtime tensor ([r], sharded from arange(tp) like NxD's SPMDRank) so one traced graph serves every rank.

    ``group`` (``Plan.expert_group``; 0 = all at once): the local experts run ``group`` at a time and their [N, H]
    outputs are summed, so the live gate+up is [N, group, 2I], not [N, E_l, 2I] (prefill scratch). Same sum, same
    weights read; one pass when group is 0 or covers the local experts, exactly the ungrouped graph.
    """

    keep_f32 = ("gate_up_scale", "down_scale")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        tp: int,
        quant: bool,
        dtype: torch.dtype,
        coll: Collectives,
        group: int = 0,
    ) -> None:
        super().__init__()
        if num_experts % tp:
            raise ValueError(f"{num_experts} experts do not split over tp={tp}")
        self.num_experts, self.num_local = num_experts, num_experts // tp
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.act_fn, self.quant, self.coll, self.group = act_fn, quant, coll, group
        e, h, i = self.num_local, hidden_size, intermediate_size

        def param(*shape: int, dt: torch.dtype) -> nn.Parameter:
            p = nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)
            mark_parallel(p, 0, tp)
            return p

        self.rank = param(1, dt=torch.int32)
        if quant:
            self.gate_up_qweight = param(e, 2 * i, h, dt=torch.int8)
            self.gate_up_scale = param(e, 2 * i, dt=torch.float32)
            self.down_qweight = param(e, h, i, dt=torch.int8)
            self.down_scale = param(e, h, dt=torch.float32)
        else:
            self.gate_up_proj = param(e, 2 * i, h, dt=dtype)  # same layout as HF: [E, 2I, H]
            self.down_proj = param(e, h, i, dt=dtype)  # [E, H, I]

    def local_routing_weights(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[N, K] global expert ids + weights -> [N, E_l] dense weights of this rank's experts (0 if not chosen)."""
        local_ids = top_k_index - self.rank.to(top_k_index.dtype) * self.num_local  # [N, K]; off-rank ids fall outside
        slots = torch.arange(self.num_local, device=top_k_index.device, dtype=top_k_index.dtype)  # [E_l]
        hit = (local_ids.unsqueeze(-1) == slots).to(top_k_weights.dtype)  # [N, K, E_l]
        return (hit * top_k_weights.unsqueeze(-1)).sum(dim=1)  # [N, E_l]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:  # [N, H], [N, K], [N, K] -> [N, H]
        dtype = hidden_states.dtype
        weights = self.local_routing_weights(top_k_index, top_k_weights).to(dtype)  # [N, E_l]
        group = self.group if 0 < self.group < self.num_local else 0
        if not group:
            out = self.expert_sum(hidden_states, weights, None)  # [N, H]
        else:
            # A static loop: ceil(E_l / group) passes, each of experts [lo, lo + group) (the last may be shorter)
            out = functools.reduce(torch.add, [
                self.expert_sum(hidden_states, weights[:, lo : lo + group], slice(lo, lo + group))
                for lo in range(0, self.num_local, group)])  # [N, H]
        if self.quant:
            out = out.to(dtype)  # the int8 path's partials were summed in f32
        return self.coll.all_reduce(out)  # every rank adds its experts' share

    def expert_sum(self, hidden_states: torch.Tensor, weights: torch.Tensor, experts: slice | None) -> torch.Tensor:
        """sum_e w[:, e] * expert_e(x) over the local experts `experts` (None: all, the weights as they are, no slice
        in the graph): [N, H], [N, G] -> [N, H], f32 for an int8 build (its scaled partials are summed in f32)."""
        dtype = hidden_states.dtype

        def part(t: torch.Tensor) -> torch.Tensor:  # [E_l, ...] -> [G, ...]
            return t if experts is None else t[experts]

        if self.quant:
            gate_up = torch.einsum("nh,eoh->neo", hidden_states, part(self.gate_up_qweight).to(dtype))  # [N, G, 2I]
            gate_up = (gate_up.float() * part(self.gate_up_scale)).to(dtype)
        else:
            gate_up = torch.einsum("nh,eoh->neo", hidden_states, part(self.gate_up_proj))  # [N, G, 2I]
        gate, up = gate_up.chunk(2, dim=-1)  # [N, G, I] each
        # Weighting before the (linear) down projection lets the expert sum fold into the contraction.
        inner = self.act_fn(gate) * up * weights.unsqueeze(-1)  # [N, G, I]
        if self.quant:
            per_expert = torch.einsum("nei,ehi->neh", inner, part(self.down_qweight).to(dtype))  # [N, G, H]
            return (per_expert.float() * part(self.down_scale)).sum(dim=1)  # [N, H] f32
        return torch.einsum("nei,ehi->nh", inner, part(self.down_proj))  # [N, H]

    def extra_repr(self) -> str:
        return f"experts={self.num_local}/{self.num_experts}, int8={self.quant}"


class SelectiveExperts(DenseExperts):
    """The same experts, split by intermediate dim over ranks; at decode only the routed experts are read.

    Dense weighting reads all 128 experts per token to use 8 of them. Here, when a graph's token count N is at
    most ``selective_tokens`` (fixed per graph at trace time: decode is N=1; the limit comes from the roofline,
    ``selective_token_limit``), the graph gathers the N*K routed experts' int8 rows and per-channel scales
    (``weight[top_k_index]``, static shape [N, K, ...]) and runs only those; above it (prefill buckets) the
    inherited dense path runs on the same weights.

    TP split: every rank holds every expert's slice of the intermediate dim I (gate and up rows [I/tp*r, ...)
    of the fused [gate; up] dim via partition stride 2, down columns likewise), so each rank gathers its half
    of all K experts: K*3*H*I/tp bytes per token on every rank, whatever the routing. Splitting by expert
    instead would need a static K-slot gather on each rank (all K experts may sit on one rank): K*3*H*I per
    rank, twice as much (``--roofline`` prints both). Down-projection scales are per output channel (H), so
    every rank keeps them whole and scales its partial sum before the all-reduce, as row-parallel int8 does.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        top_k: int,
        selective_tokens: int,
        tp: int,
        quant: bool,
        dtype: torch.dtype,
        coll: Collectives,
        group: int = 0,
    ) -> None:
        nn.Module.__init__(self)  # DenseExperts' by-expert parameters are not built: this layout differs
        if intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size {intermediate_size} does not split over tp={tp}")
        self.num_experts = self.num_local = num_experts  # every rank holds every expert (its slice of I)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.top_k, self.selective_tokens = top_k, selective_tokens
        # the dense path above selective_tokens groups its (all E, a slice of I each) experts as DenseExperts does
        self.act_fn, self.quant, self.coll, self.group = act_fn, quant, coll, group
        e, h, i = num_experts, hidden_size, intermediate_size // tp

        def param(*shape: int, dt: torch.dtype, dim: int | None = None, stride: int = 1) -> nn.Parameter:
            p = nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)
            if dim is not None:
                mark_parallel(p, dim, tp, stride)
            return p

        if quant:
            self.gate_up_qweight = param(e, 2 * i, h, dt=torch.int8, dim=1, stride=2)  # [E, 2I/tp, H]: gate_r; up_r
            self.gate_up_scale = param(e, 2 * i, dt=torch.float32, dim=1, stride=2)  # [E, 2I/tp]
            self.down_qweight = param(e, h, i, dt=torch.int8, dim=2)  # [E, H, I/tp]
            self.down_scale = param(e, h, dt=torch.float32)  # [E, H], whole on every rank
        else:
            self.gate_up_proj = param(e, 2 * i, h, dt=dtype, dim=1, stride=2)  # [E, 2I/tp, H]
            self.down_proj = param(e, h, i, dt=dtype, dim=2)  # [E, H, I/tp]

    def local_routing_weights(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """[N, K] expert ids + weights -> [N, E] dense weights (0 if not chosen); every expert is local here."""
        slots = torch.arange(self.num_experts, device=top_k_index.device, dtype=top_k_index.dtype)  # [E]
        hit = (top_k_index.unsqueeze(-1) == slots).to(top_k_weights.dtype)  # [N, K, E]
        return (hit * top_k_weights.unsqueeze(-1)).sum(dim=1)  # [N, E]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:  # [N, H], [N, K], [N, K] -> [N, H]
        with warnings.catch_warnings():
            # N is static in a traced graph, so each graph holds exactly one of the two paths: that torch.jit.trace
            # freezes this comparison into a constant is the point, not a hazard.
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            tokens = int(hidden_states.shape[0])
        if tokens > self.selective_tokens:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        # One routed expert slot at a time (K is fixed, so one trace serves every N): slot k's gather of N experts
        # ([N, 2I_l, H], 4 MB f32 at N = 4 on the bench config) stays in the CPU's cache between its widening to f32
        # and the matmul that reads it; all N * K at once (32 MB) do not, and a 4-row decode step then cost 16x a
        # one-row step in the experts, not 4x. The same rows and bytes are read: K gathers of N instead of one of N*K.
        partial = [self.routed(hidden_states, top_k_index[:, k : k + 1], top_k_weights[:, k : k + 1])
                   for k in range(self.top_k)]  # K x [N, H]
        return self.coll.all_reduce(functools.reduce(torch.add, partial))  # [N, H]

    def routed(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:  # [N, H], [N, K], [N, K] -> this rank's partial [N, H]
        """Gather the routed experts' weights (this rank's slice of I) and run only those."""
        dtype = hidden_states.dtype
        weights = top_k_weights.to(dtype)  # [N, K]
        flat = top_k_index.reshape(-1)  # [N * K]

        def pick(table: torch.Tensor) -> torch.Tensor:  # [E, ...] -> [N, K, ...]: the only expert rows read
            # index_select, not table[top_k_index]: the same gather in the HLO, but on CPU a copy of whole rows
            # instead of advanced indexing's element loop (20-40x faster for int8 rows).
            return table.index_select(0, flat).reshape(*top_k_index.shape, *table.shape[1:])

        if self.quant:
            gate_up_w = pick(self.gate_up_qweight).to(dtype)  # [N, K, 2I_l, H]
            gate_up = torch.einsum("nh,nkoh->nko", hidden_states, gate_up_w)  # [N, K, 2I_l]
            gate_up = (gate_up.float() * pick(self.gate_up_scale)).to(dtype)
        else:
            gate_up = torch.einsum("nh,nkoh->nko", hidden_states, pick(self.gate_up_proj))  # [N, K, 2I_l]
        gate, up = gate_up.chunk(2, dim=-1)  # [N, K, I_l] each
        inner = self.act_fn(gate) * up * weights.unsqueeze(-1)  # [N, K, I_l]
        if self.quant:
            down_w = pick(self.down_qweight).to(dtype)  # [N, K, H, I_l]
            per_expert = torch.einsum("nki,nkhi->nkh", inner, down_w)  # [N, K, H]
            return (per_expert.float() * pick(self.down_scale)).sum(dim=1).to(dtype)  # [N, H]
        return torch.einsum("nki,nkhi->nh", inner, pick(self.down_proj))  # [N, H]

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, selective up to {self.selective_tokens} tokens, "
            f"int8={self.quant}"
        )


def expert_module(cfg, plan: Plan, act_fn: Callable[[torch.Tensor], torch.Tensor], coll: Collectives) -> DenseExperts:
    """The MoE experts block the plan asks for: dense for every graph, or selective where the roofline says so."""
    shape = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, act_fn)
    common = dict(tp=plan.tp, quant=plan.int8, dtype=plan.dtype, coll=coll, group=plan.expert_group)
    if plan.experts == "dense":
        return DenseExperts(*shape, **common)
    if plan.experts == "selective":
        limit = selective_token_limit(cfg, plan.tp, plan.quant)
        return SelectiveExperts(*shape, top_k=cfg.top_k_experts, selective_tokens=limit, **common)
    raise ValueError(f"experts must be one of {EXPERT_MODES}, got {plan.experts!r}")


class SlotCache:
    """The ``cache`` object HF's attention calls: writes this step's K/V into the slot tensors via the one-hot.

    new = old * (1 - written) + onehot @ kv: exact (each slot gets at most one 1.0 term), static shapes, no
    scatter. The attention then reads the whole [MAX] slot range; the masks decide what is visible.
    """

    def __init__(self, model: RecipeModel, onehot: torch.Tensor) -> None:
        self.model = model
        self.onehot = onehot  # [1, 1, MAX, T]
        self.keep: dict[torch.dtype, torch.Tensor] = {}
        self.new_states: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_: object):
        # key/value_states [1, kvh_local, T, D] -> the full slot tensors [1, kvh_local, MAX, D]
        attn = self.model.layers[layer_idx].self_attn
        onehot = self.onehot.to(key_states.dtype)  # [1, 1, MAX, T]
        if key_states.dtype not in self.keep:
            self.keep[key_states.dtype] = 1.0 - onehot.sum(dim=-1, keepdim=True)  # [1, 1, MAX, 1]
        keep = self.keep[key_states.dtype]
        out = []
        for name, new in (("k_cache", key_states), ("v_cache", value_states)):
            state = getattr(attn, name)  # [1, kvh_local, MAX, D]
            updated = state * keep + torch.matmul(onehot, new)  # [1, kvh_local, MAX, D]
            if self.model.plan.inplace_kv:
                state.copy_(updated)  # CPU: the buffer is the cache; on Neuron the alias does this
            self.new_states[f"layers.{layer_idx}.self_attn.{name}"] = updated
            out.append(updated)
        return out[0], out[1]


class RingCache:
    """v2's ``cache`` object: K/V written at slot = position mod ring size, an indexed O(T) write (not a blend).

    CPU updates the buffers in place (``index_copy_``); on the device the functional ``index_copy`` result is
    returned and aliased back to the state, which XLA turns into an in-place scatter / dynamic-update-slice.
    """

    def __init__(self, model: RecipeModel, position_ids: torch.Tensor) -> None:
        self.model = model
        pos = position_ids[0]  # [T] int64
        self.slots = {r: torch.remainder(pos, r) for r in sorted(set(model.ring_sizes))}  # ring size -> [T]
        self.new_states: dict[str, torch.Tensor] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_: object):
        # key/value_states [1, kvh_local, T, D] -> the layer's ring [1, kvh_local, R, D]
        attn = self.model.layers[layer_idx].self_attn
        index = self.slots[self.model.ring_sizes[layer_idx]]  # [T]
        out = []
        for name, new in (("k_cache", key_states), ("v_cache", value_states)):
            state = getattr(attn, name)  # [1, kvh_local, R, D]
            new = new.to(state.dtype)
            write = state.index_copy_ if self.model.plan.inplace_kv else state.index_copy
            updated = write(2, index, new)  # [1, kvh_local, R, D]
            self.new_states[f"layers.{layer_idx}.self_attn.{name}"] = updated
            out.append(updated)
        return out[0], out[1]


class SlotRingCache:
    """v3's ``cache`` object: S independent KV caches per layer ([S, kvh_l, R, D], each slot one v2 ring).

    Row b of a call writes its T tokens into slot ``slot_ids[b]`` at ring index position mod R, and attends over
    that slot alone: the update is one indexed write into the flattened [S * kvh_l * R, D] view (O(B * T) rows,
    never a blend of the whole cache) and the read is ``index_select`` of the B slots. A slot never sees another
    slot's KV because no row ever reads a slot id other than its own.
    """

    def __init__(self, model: RecipeModel, position_ids: torch.Tensor, slot_ids: torch.Tensor) -> None:
        self.model = model
        self.slot_ids = slot_ids  # [B] int64
        self.rows: dict[tuple[int, int], torch.Tensor] = {}  # (ring, kv heads) -> flat write rows [B * kvh * T]
        self.position_ids = position_ids  # [B, T]
        self.new_states: dict[str, torch.Tensor] = {}

    def _rows(self, ring: int, heads: int) -> torch.Tensor:
        if (ring, heads) not in self.rows:
            index = torch.remainder(self.position_ids, ring)  # [B, T] ring index of each token
            head = torch.arange(heads, device=index.device, dtype=index.dtype)  # [kvh]
            base = (self.slot_ids[:, None] * heads + head) * ring  # [B, kvh] first row of (slot, head)
            self.rows[(ring, heads)] = (base[:, :, None] + index[:, None, :]).reshape(-1)  # [B * kvh * T]
        return self.rows[(ring, heads)]

    def _write(self, layer_idx: int, name: str, new: torch.Tensor) -> torch.Tensor:
        """Write [B * kvh * T, width] rows (in (b, h, t) order) into state `name`; return the rows' slots of it."""
        state = getattr(self.model.layers[layer_idx].self_attn, name)  # [S, kvh_local, R, width]
        slots, heads, ring, width = state.shape
        rows = self._rows(ring, heads)  # [B * kvh * T]
        new = new.to(state.dtype)
        if self.model.plan.inplace_kv:
            state.view(-1, width).index_copy_(0, rows, new)  # CPU: the buffer is the cache
            updated = state
        else:
            updated = state.reshape(-1, width).index_copy(0, rows, new).view(slots, heads, ring, width)
        self.new_states[f"layers.{layer_idx}.self_attn.{name}"] = updated
        return updated.index_select(0, self.slot_ids)  # [B, kvh_local, R, width]: only the rows' slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, **_: object):
        # key/value_states [B, kvh_local, T, D] -> each row's own slot [B, kvh_local, R, D]
        out = []
        for kind, new in (("k", key_states), ("v", value_states)):
            flat = new.reshape(-1, new.shape[-1])  # [B * kvh * T, D]
            if not self.model.plan.kv_int8:
                out.append(self._write(layer_idx, f"{kind}_cache", flat).to(new.dtype))  # a no-op unless stored narrower
                continue
            q, scale = quantize_kv(flat)  # [B * kvh * T, D] int8 values, [B * kvh * T, 1] f32
            stored_q = self._write(layer_idx, f"{kind}_cache", q)  # [B, kvh, R, D] int8
            stored_s = self._write(layer_idx, f"{kind}_scale", scale)  # [B, kvh, R, 1] f32
            out.append((stored_q.float() * stored_s).to(new.dtype))  # [B, kvh, R, D] in the compute dtype
        return out[0], out[1]


class BlockCache(SlotRingCache):
    """v4's ``cache`` object: sliding layers as v3 (row b's ring in slot ``slot_ids[b]``), global layers in one pool.

    A global layer's K and V are [NB, kvh_l, BS, D]: NB blocks of BS positions, lent to rows by the host. Row b's
    position p lives in block ``block_table[b, p // BS]`` at offset p mod BS. A call writes its B * T tokens with one
    indexed copy into the flattened [NB * kvh_l * BS, D] view and reads, per row, the NBc blocks its table names
    (``index_select``), in table order: the gathered key j is position j, so the mask is plain causal
    (``table_mask``). The table's width NBc is the graph's context bucket: a row reads NBc * BS positions of its own
    blocks, never another row's (the host never lends a block twice; entries past a row's length name block 0).

    Block 0 is the null block: a position past the table's reach (a chunk's pads beyond the context bucket) or one
    whose entry is 0 (past the row's own blocks) is written there, where no row's visible position lives. It is
    read only as a table's padding, under the causal mask (a position past the query).
    """

    def __init__(self, model: RecipeModel, position_ids: torch.Tensor, slot_ids: torch.Tensor,
                 block_table: torch.Tensor) -> None:
        super().__init__(model, position_ids, slot_ids)
        self.block_table = block_table.to(torch.int64)  # [B, NBc]
        self.block_rows: dict[int, torch.Tensor] = {}  # kv heads -> flat write rows [B * kvh * T]

    def _pool_rows(self, heads: int) -> torch.Tensor:
        if heads not in self.block_rows:
            size = self.model.plan.block_size
            pos = self.position_ids  # [B, T]
            index = torch.div(pos, size, rounding_mode="floor")  # [B, T] the table entry of each token
            # The entry by comparison, not gather: an index past the table's width matches no column and gives 0,
            # the null block; and every size comes from the inputs, so one trace serves every context bucket.
            columns = torch.arange(self.block_table.shape[1], device=pos.device, dtype=pos.dtype)  # [NBc]
            hit = (index[:, :, None] == columns[None, None, :]).to(pos.dtype)  # [B, T, NBc]
            block = (hit * self.block_table[:, None, :]).sum(dim=-1)  # [B, T]
            head = torch.arange(heads, device=pos.device, dtype=pos.dtype)  # [kvh]
            rows = (block[:, None, :] * heads + head[None, :, None]) * size + torch.remainder(pos, size)[:, None, :]
            self.block_rows[heads] = rows.reshape(-1)  # [B * kvh * T] in (b, h, t) order
        return self.block_rows[heads]

    def _write(self, layer_idx: int, name: str, new: torch.Tensor) -> torch.Tensor:
        if self.model.layer_types[layer_idx] != "full_attention":
            return super()._write(layer_idx, name, new)
        state = getattr(self.model.layers[layer_idx].self_attn, name)  # [NB, kvh_local, BS, width]
        blocks, heads, size, width = state.shape
        rows = self._pool_rows(heads)
        new = new.to(state.dtype)
        if self.model.plan.inplace_kv:
            state.view(-1, width).index_copy_(0, rows, new)
            updated = state
        else:
            updated = state.reshape(-1, width).index_copy(0, rows, new).view(blocks, heads, size, width)
        self.new_states[f"layers.{layer_idx}.self_attn.{name}"] = updated
        b, nbc = self.block_table.shape
        gathered = updated.index_select(0, self.block_table.reshape(-1))  # [B * NBc, kvh, BS, width]
        return gathered.view(b, nbc, heads, size, width).transpose(1, 2).reshape(b, heads, -1, width)


def table_mask(position_ids: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """v4 global layers: [B, T] positions, [B, NBc] tables -> f32 [B, 1, T, NBc * BS], 0 where gathered key j
    (= position j) <= the query's position, else finfo.min."""
    pos = position_ids
    columns = torch.arange(block_table.shape[1], device=pos.device, dtype=pos.dtype)  # [NBc]
    offsets = torch.arange(block_size, device=pos.device, dtype=pos.dtype)  # [BS]
    return key_mask(pos, (columns[:, None] * block_size + offsets[None, :]).reshape(-1))  # keys [NBc * BS]


def key_mask(position_ids: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[B, T] positions, [keys] each key's position -> f32 [B, 1, T, keys]: 0 where the key's position <= the
    query's, else finfo.min (v4's gathered blocks: key j is position j)."""
    visible = key_positions[None, None, :] <= position_ids[:, :, None]  # [B, T, keys]
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min).to(torch.float32)[:, None]


def ring_mask(position_ids: torch.Tensor, ring: int, window: int | None,
              block_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] positions -> f32 [B, 1, T, R]: 0 where slot j holds a position the query may see, else finfo.min.

    Slot j holds, for query q, position q - age with age = (q - j) mod R (the latest position <= q that maps to j;
    Plan.ring_slots guarantees nothing later overwrote it). Visible iff that position exists (age <= q) and is
    inside the window (age < window; global layers: no window). Each row (v3: each KV slot) has its own positions,
    so its own ring and mask.

    With `block_ids` [B, T] (a block-aware prefill, layers that attend bidirectionally within an image): a query
    also sees every token of its own image block, ahead of it too, within the window (``block_visible``).
    """
    pos = position_ids  # [B, T]
    slots = torch.arange(ring, device=pos.device, dtype=pos.dtype)  # [R]
    age = torch.remainder(pos[:, :, None] - slots, ring)  # [B, T, R]
    visible = age <= pos[:, :, None]
    if window is not None:
        visible = visible & (age < window)
    if block_ids is not None:
        visible = visible | block_visible(pos, block_ids, ring, window)
    neg = torch.finfo(torch.float32).min
    return torch.where(visible, 0.0, neg).to(torch.float32)[:, None]  # [B, 1, T, R]


def block_visible(position_ids: torch.Tensor, block_ids: torch.Tensor, ring: int, window: int | None) -> torch.Tensor:
    """[B, T] positions and image-block ids (0 = text) -> bool [B, T, R]: slot j holds a token of the query's own
    image block, inside its window.

    transformers' Gemma-4 (``create_masks_for_vision_model``): sliding layers see AND(window, OR(causal, same
    block)), where the window is one-sided (key > query - window), so a block's later tokens are always inside it.
    An image block lies inside one prefill call, so its tokens are exactly the slots this call writes: each slot's
    block id and position are scattered from the call's own tokens (a slot this call does not write keeps block 0
    and is never a block key, whatever an earlier call left there: ids are per call). No data-dependent control
    flow: two scatters and elementwise compares, static shapes, as XLA wants.
    """
    pos, blocks = position_ids, block_ids.to(position_ids.dtype)  # [B, T] each
    index = torch.remainder(pos, ring)  # [B, T] the slot each token of the call writes (distinct: T <= R)
    key_block = torch.zeros(pos.shape[0], ring, dtype=pos.dtype, device=pos.device).scatter(1, index, blocks)  # [B, R]
    key_pos = torch.zeros(pos.shape[0], ring, dtype=pos.dtype, device=pos.device).scatter(1, index, pos)  # [B, R]
    same = (key_block[:, None, :] == blocks[:, :, None]) & (blocks[:, :, None] > 0)  # [B, T, R]
    if window is not None:
        same = same & (pos[:, :, None] - key_pos[:, None, :] < window)
    return same


def query_tiled_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          softcap: float | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' eager attention, a tile of queries at a time on the layers the recipe marks (``query_tile``).

    Registered in transformers' AttentionInterface (``TILED_ATTENTION``), so HF's own Gemma-4 attention calls it.
    Unmarked layers and one-row calls (decode) run HF's ``eager_attention_forward`` as they always did. A marked
    layer of a prefill (query [B, heads, T, D] over its ring [B, kvh, R, D]) gets no mask from the model: each tile
    builds its own ``ring_mask`` [B, 1, tile, R] (v4: ``key_mask`` over the gathered blocks) from the positions, so
    neither the scores nor the mask of all T
    rows is ever live: [B, heads, tile, R] f32 at a time. The math is eager's, row for row (softmax is per row):
    scores in the compute dtype x scaling, plus the f32 mask, an f32 softmax cast back, times V. The query heads
    that share a KV head are folded into the rows of one matmul ([B, kvh, g * tile, D] @ [B, kvh, D, R]) instead of
    repeat_kv's copy of K and V per query head ([heads, R, D] each: 0.55 GB per global layer of the 26B at 32k).
    """
    from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

    tile = int(getattr(module, "query_tile", 0))
    rows = query.shape[2]
    if not tile or rows == 1:
        return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                       softcap=softcap, **kwargs)
    if attention_mask is not None:
        raise ValueError("a query-tiled layer builds its masks from the positions; it takes no attention_mask")
    position_ids = kwargs["position_ids"]  # [B, T]
    assert isinstance(position_ids, torch.Tensor)
    batch, heads, _, dim = query.shape
    kv_heads, ring = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query heads per KV head (repeat_kv's n_rep): head h reads KV head h // group
    scale = dim**-0.5 if scaling is None else scaling
    window = getattr(module, "ring_window", None)
    # v4: the keys are a row's gathered blocks in table order, key j at position j (sized from the input: one trace
    # serves every context bucket)
    keys = None
    if getattr(module, "block_keys", False):
        keys = torch.arange(ring, device=key.device, dtype=position_ids.dtype)  # [NBc * BS]
    # A graph has one T and loops over its tiles. The CPU trace (torch.jit.trace) is one trace for every bucket, and
    # a Python loop is frozen at the traced length: it loops over the largest bucket's tiles, and a shorter call's
    # tiles past its T are empty slices (size-0 matmuls, no rows), so the same trace serves every bucket.
    span = int(getattr(module, "query_rows", rows)) if torch.jit.is_tracing() else rows
    outs = []
    for start in range(0, max(span, rows), tile):
        q = query[:, :, start : start + tile]  # [B, heads, t, D]
        t = q.shape[2]
        q = q.reshape(batch, kv_heads, group * t, dim)  # [B, kvh, g * t, D]
        scores = torch.matmul(q, key.transpose(2, 3)) * scale  # [B, kvh, g * t, R]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        tile_pos = position_ids[:, start : start + t]  # [B, t]
        mask = key_mask(tile_pos, keys) if keys is not None else ring_mask(tile_pos, ring, window)  # [B, 1, t, R]
        scores = scores.view(batch, kv_heads, group, t, ring) + mask[:, :, None]  # [B, kvh, g, t, R] f32
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs.view(batch, kv_heads, group * t, ring), value)  # [B, kvh, g * t, D]
        outs.append(out.view(batch, heads, t, dim).transpose(1, 2))  # [B, t, heads, D]
    return torch.cat(outs, dim=1).contiguous(), None  # [B, T, heads, D], as eager returns it


def register_tiled_attention() -> str:
    """``query_tiled_attention`` under ``TILED_ATTENTION`` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TILED_ATTENTION, query_tiled_attention)
    return TILED_ATTENTION


@dataclass(frozen=True)
class Plan:
    """How to build the module: parallel degree, squeeze, compute dtype, KV capacity and state handling."""

    tp: int = 1
    quant: str = "none"  # "int8": experts, shared MLP and lm_head per-channel int8
    dtype: torch.dtype = torch.float32
    max_total: int = 512
    kv_as_params: bool = False  # NxD aliases parameters (device states); CPU keeps plain buffers
    inplace_kv: bool = True  # CPU: update the buffers in the graph; Neuron: return them, the alias writes back
    experts: str = "dense"  # "selective": decode reads only the routed experts (SelectiveExperts)
    attn_quant: str = "none"  # "int8": attention projections per-channel int8 too
    contract: str = "v1"  # "v1": the host ships one-hot + masks; "v2": embeds + positions, rings, indexed writes
    buckets: tuple[int, ...] = (128,)  # prefill chunk lengths (v2 sizes its rings by the largest)
    kv_slots: int = 1  # v3: independent KV caches (conversations), each one v2 ring per layer
    decode_batches: tuple[int, ...] = (1,)  # v3: compiled decode batch sizes (rows per step)
    kv_quant: str = "none"  # v3 "int8": K and V int8 per (slot, head, position) with an f32 scale, opt-in
    block_ids: bool = False  # v2/v3 (--vision): prefill takes image-block ids [1, T] after its other inputs
    # v4: the global layers' KV in one pool of kv_blocks blocks of block_size positions ([NB, kvh, BS, D] per layer),
    # read through a block table per row; a graph per context bucket (tokens each row's table covers).
    kv_blocks: int = 0
    block_size: int = 128
    context_buckets: tuple[int, ...] = ()
    vision_tp: str = "auto"  # --vision's tower: "auto" (sharded iff it frees enough bytes), "sharded", "replicated"
    # v2/v3 (issue 34): "last": prefill graphs take last_index [1] and return that row's logits [1, 1, V]; a scored
    # prompt runs the score graph (all rows' logits) at the smallest bucket. "all": every row, as before.
    prefill_logits: str = "all"
    # v2/v3: global layers attend a prefill's queries this many at a time (0: all at once), so one layer's live f32
    # scores are [heads, tile, ring], not [heads, T, ring] (``query_tiled_attention``)
    query_tile: int = 0
    # v2+ (issue 34; v4's default 16): the dense experts path (prefill) runs this many local experts a pass and sums,
    # so its live gate+up is [T, group, 2I], not [T, E_l, 2I] (0: all in one pass)
    expert_group: int = 0

    @property
    def kv_int8(self) -> bool:
        if self.kv_quant not in QUANT_MODES:
            raise ValueError(f"kv_quant must be one of {QUANT_MODES}, got {self.kv_quant!r}")
        return self.kv_quant == "int8"

    @property
    def ringed(self) -> bool:
        """v2, v3 and v4 keep rings (v4: on sliding layers) and build their masks in the graph."""
        return self.contract in ("v2", "v3", "v4")

    @property
    def slotted(self) -> bool:
        """v3 and v4 keep S per-row sliding caches (slot_ids) and decode several rows per call."""
        return self.contract in ("v3", "v4")

    @property
    def pooled(self) -> bool:
        """v4: global layers' KV in a block pool (BlockCache), a block table per row."""
        return self.contract == "v4"

    def ring_slots(self, window: int | None) -> int:
        """v2 KV slots of a layer: a ring of window + largest bucket (sliding), MAX + largest bucket (global).

        A call writes T <= B consecutive positions (the pads continue past the last real one) before its queries
        read. Slot = position mod R, and a query q reads positions (q - window, q]. The call's writes reach back to
        position (q + B - 1) - R, which stays <= q - window exactly when R >= window + B - 1: a write never lands
        on a slot a real query of the same or a later call can see. Global layers are the same ring with
        window = MAX: real positions never wrap, and the pads of a chunk near the end (positions up to
        MAX + B - 2) land in the B extra slots instead of on position 0.
        """
        largest = max(self.buckets)
        full = self.max_total + largest
        return full if window is None else min(window + largest, full)

    @property
    def last_logits(self) -> bool:
        """Prefill graphs return the last real row's logits only (and a score graph serves scored prompts)."""
        if self.prefill_logits not in PREFILL_LOGITS:
            raise ValueError(f"prefill_logits must be one of {PREFILL_LOGITS}, got {self.prefill_logits!r}")
        return self.prefill_logits == "last"

    @property
    def score_buckets(self) -> tuple[int, ...]:
        """The score graphs' chunk lengths: the smallest bucket (a scored prompt is rare, its [T, V] logits are not
        small), none when every prefill graph returns all rows."""
        return (min(self.buckets),) if self.last_logits else ()

    @property
    def score_context(self) -> int:
        """v4: the one context bucket the score graph is compiled at, the largest (MAX). A scored prompt is rare
        (echo + logprobs), and each graph is one more Neuron compile: one score graph whose table reaches every
        position serves a scored chunk anywhere, at the cost of reading the whole table's width per call (at 64k
        1.34 GB of global KV per rank beside the 12.8 GB of weights every call reads)."""
        return max(self.context_buckets) if self.pooled else self.max_total

    @property
    def int8(self) -> bool:
        if self.quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES}, got {self.quant!r}")
        return self.quant == "int8"

    @property
    def attn_int8(self) -> bool:
        if self.attn_quant not in QUANT_MODES:
            raise ValueError(f"attn_quant must be one of {QUANT_MODES}, got {self.attn_quant!r}")
        return self.attn_quant == "int8"


class RecipeModel(nn.Module):
    """Gemma-4 text model on the graph contract, built from transformers' own decoder layers."""

    def __init__(self, text_config, plan: Plan, coll: Collectives = LOCAL) -> None:
        super().__init__()
        from transformers.activations import ACT2FN
        from transformers.models.gemma4.modeling_gemma4 import (
            Gemma4RMSNorm,
            Gemma4TextDecoderLayer,
            Gemma4TextRotaryEmbedding,
        )

        check_supported(text_config, plan.tp)
        cfg = copy.deepcopy(text_config)
        # The masks come in as tensors: eager attention adds them as they are (sdpa/flash would re-derive them).
        cfg._attn_implementation = "eager"
        if plan.query_tile:
            if not plan.ringed:
                raise ValueError("query tiles (--query-tile) need --contract v2, v3 or v4 (masks from positions)")
            # eager's math on every layer; the marked (global) layers run it a tile of queries at a time
            cfg._attn_implementation = register_tiled_attention()
        if plan.last_logits and not plan.ringed:
            raise ValueError("--prefill-logits last needs --contract v2, v3 or v4 (v1's prefill returns every row)")
        # Not `self.config`: NxD's sharder casts every checkpoint tensor (int8 included) to `model.config.torch_dtype`.
        self.text_config = cfg
        self.plan = plan
        self.coll = coll
        self.layer_types = list(cfg.layer_types)
        self.state_names: list[str] = []
        self.ring_sizes: list[int] = []  # KV slots per layer
        if plan.contract not in ("v1", "v2", "v3", "v4"):
            raise ValueError(f"unknown contract {plan.contract!r}")
        check_slots(plan)
        if plan.block_ids and not plan.ringed:
            raise ValueError("image-block ids (--vision) need --contract v2 or v3")
        # The layers where one image's tokens attend to each other both ways (transformers: sliding layers when
        # use_bidirectional_attention == "vision"; full-attention layers stay causal). None: block ids change nothing.
        self.bidirectional = {"sliding_attention"} if cfg.use_bidirectional_attention == "vision" else set()
        tp, int8, dtype = plan.tp, plan.int8, plan.dtype

        def linear(lin: nn.Linear, mode: str, quant: bool, gather_output: bool = False) -> ShardLinear:
            if lin.bias is not None:
                raise ValueError("biased linears are not supported")
            return ShardLinear(
                lin.in_features,
                lin.out_features,
                mode=mode if tp > 1 else "replicated",
                tp=tp,
                quant=quant,
                dtype=dtype,
                coll=coll,
                gather_output=gather_output,
            )

        self.layers = nn.ModuleList()
        for idx in range(cfg.num_hidden_layers):
            layer = Gemma4TextDecoderLayer(cfg, idx)
            attn = layer.self_attn
            # Sliding layers (8 kv heads) split heads over ranks; global ones (2 kv heads) stay whole on every rank.
            sharded = attn.is_sliding and tp > 1
            kv_heads = attn.k_proj.out_features // attn.head_dim
            attn.q_proj = linear(attn.q_proj, "col" if sharded else "replicated", quant=plan.attn_int8)
            attn.k_proj = linear(attn.k_proj, "col" if sharded else "replicated", quant=plan.attn_int8)
            if attn.v_proj is not None:  # attention_k_eq_v global layers reuse the k projection for v
                attn.v_proj = linear(attn.v_proj, "col" if sharded else "replicated", quant=plan.attn_int8)
            attn.o_proj = linear(attn.o_proj, "row" if sharded else "replicated", quant=plan.attn_int8)
            local_kv = kv_heads // tp if sharded else kv_heads
            # v1: slot = absolute position (MAX slots); v2: a ring per layer (Plan.ring_slots); v3: S such rings
            n_slots = plan.ring_slots(self.window_of(idx)) if plan.ringed else plan.max_total
            caches = plan.kv_slots if plan.slotted else 1
            if plan.pooled and not attn.is_sliding:
                # v4 global layers: [NB, kvh, BS, D], the pool's blocks lent to rows by their block tables
                caches, n_slots = plan.kv_blocks, plan.block_size
            self.ring_sizes.append(n_slots)
            if plan.query_tile and not attn.is_sliding:
                # Global layers: their ring is the whole context (sliding ones are bounded by window + bucket).
                attn.query_tile = plan.query_tile
                attn.query_rows = max(plan.buckets)  # the most rows a prefill call has (the CPU trace's loop)
                attn.ring_window = self.window_of(idx)
                # v4: the keys are the row's gathered blocks in table order (key j is position j): a causal mask
                attn.block_keys = plan.pooled
            # --kv-quant int8 (v3): K and V as int8 with one f32 scale per (slot, head, ring position)
            states = [(name, attn.head_dim, torch.int8 if plan.kv_int8 else dtype) for name in ("k_cache", "v_cache")]
            if plan.kv_int8:
                states += [("k_scale", 1, torch.float32), ("v_scale", 1, torch.float32)]
            for name, width, state_dtype in states:
                slots = torch.zeros(caches, local_kv, n_slots, width, dtype=state_dtype)  # [S, kvh_l, slots, D or 1]
                if plan.kv_as_params:
                    setattr(attn, name, nn.Parameter(slots, requires_grad=False))
                else:
                    attn.register_buffer(name, slots)
                self.state_names.append(f"layers.{idx}.self_attn.{name}")

            mlp = layer.mlp
            mlp.gate_proj = linear(mlp.gate_proj, "col", quant=int8)
            mlp.up_proj = linear(mlp.up_proj, "col", quant=int8)
            mlp.down_proj = linear(mlp.down_proj, "row", quant=int8)
            layer.experts = expert_module(cfg, plan, ACT2FN[cfg.hidden_activation], coll)
            # layer_scalar is a buffer in HF, and to NxD a buffer is not a checkpoint weight: it is traced with the
            # value the module was built with (1.0 -> noise out, as the 26B build found). As a parameter it is
            # loaded from the checkpoint like every other weight.
            scalar = layer.layer_scalar.detach().clone()
            del layer.layer_scalar
            layer.layer_scalar = nn.Parameter(scalar, requires_grad=False)
            self.layers.append(layer)

        self.norm = Gemma4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Gemma4TextRotaryEmbedding(cfg)
        # Tied lm_head [V, H], split by vocabulary rows over ranks and gathered: 1/tp of it per rank.
        self.lm_head = ShardLinear(
            cfg.hidden_size,
            cfg.vocab_size,
            mode="col" if tp > 1 else "replicated",
            tp=tp,
            quant=int8,
            dtype=dtype,
            coll=coll,
            gather_output=True,
            weight_left=True,
        )
        self._cast_floats(dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def _cast_floats(self, dtype: torch.dtype) -> None:
        """HF submodules are created in f32; move their weights to the compute dtype (not our f32 scales)."""
        states = set(self.state_names)  # KV states are made in their own dtype (int8 KV's scales stay f32)
        for prefix, module in self.named_modules():
            keep = getattr(module, "keep_f32", ())
            for name, p in module._parameters.items():
                if f"{prefix}.{name}" in states:
                    continue
                if p is not None and p.is_floating_point() and name not in keep and p.dtype != dtype:
                    p.data = p.data.to(dtype)  # keeps the Parameter object and its TP attributes

    def window_of(self, idx: int) -> int | None:
        """The sliding window of layer idx (None: a global layer)."""
        return int(self.text_config.sliding_window) if self.layer_types[idx] == "sliding_attention" else None

    # -- states ------------------------------------------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """KV slot tensors in output order (output i+1 is state i)."""
        return [self.get_parameter(n) if self.plan.kv_as_params else self.get_buffer(n) for n in self.state_names]

    def state_aliases(self) -> dict[torch.Tensor, int]:
        """{state tensor: output index} for ModelBuilder's input_output_aliases (output 0 is the logits)."""
        return {t: i + 1 for i, t in enumerate(self.state_tensors())}

    @torch.no_grad()
    def reset_states(self) -> None:
        for t in self.state_tensors():
            t.zero_()

    # -- the contract ------------------------------------------------------------------------------------------------

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # f32 [B, T, H], already x embed scale (B = 1 but for v3 decode)
        position_ids: torch.Tensor,  # int64 [B, T]
        *contract_inputs: torch.Tensor,  # v1: onehot [1,1,MAX,T], full_mask, sliding_mask [1,1,T,MAX]; v3: slot_ids [B]
        # then, for a block-aware prefill (Plan.block_ids): block_ids int64 [1, T] (0 = text, one id > 0 per image);
        # then, for a last-row prefill (Plan.last_logits): last_index int64 [1], the chunk's last real row
    ) -> tuple[torch.Tensor, ...]:
        hidden = inputs_embeds.to(self.plan.dtype)  # [B, T, H]
        rope = {lt: self.rotary_emb(hidden, position_ids, lt) for lt in sorted(set(self.layer_types))}
        last_index = None
        # Masks stay f32: a bf16 score plus an f32 mask is computed in f32 (finfo(f32).min would be -inf in bf16).
        if self.plan.ringed:
            block_ids = None
            extra = list(contract_inputs)
            if self.plan.pooled:
                slot_ids, block_table = extra.pop(0), extra.pop(0)  # [B] int64 (sliding rings), [B, NBc] int32
                cache: SlotCache | RingCache | SlotRingCache = BlockCache(self, position_ids, slot_ids, block_table)
            elif self.plan.contract == "v3":
                slot_ids = extra.pop(0)  # [B] int64
                cache = SlotRingCache(self, position_ids, slot_ids)
            else:
                cache = RingCache(self, position_ids)
            if self.plan.block_ids and inputs_embeds.shape[1] > 1 and extra:
                block_ids = extra.pop(0)  # a block-aware prefill (or score) call: [1, T]
            if extra:  # a prefill graph's last_index [1]; the score graph (and decode) has none
                (last_index,) = extra
            masks: dict[str, torch.Tensor | None] = {}
            for idx, layer_type in enumerate(self.layer_types):
                if layer_type not in masks:  # every layer of a type has the same ring and window
                    if getattr(self.layers[idx].self_attn, "query_tile", 0) and inputs_embeds.shape[1] > 1:
                        assert layer_type not in self.bidirectional, "a tiled layer is causal (global layers are)"
                        masks[layer_type] = None  # query_tiled_attention builds one tile's mask at a time
                        continue
                    if self.plan.pooled and layer_type == "full_attention":
                        masks[layer_type] = table_mask(position_ids, block_table, self.plan.block_size)
                        continue
                    blocked = block_ids if layer_type in self.bidirectional else None
                    masks[layer_type] = ring_mask(position_ids, self.ring_sizes[idx], self.window_of(idx),
                                                  blocked)  # [B, 1, T, R]
        else:
            onehot, full_mask, sliding_mask = contract_inputs
            cache = SlotCache(self, onehot)
            masks = {"full_attention": full_mask, "sliding_attention": sliding_mask}
        shared_kv: dict = {}  # HF's last layer of each type stores its K/V here; unused without KV sharing
        for idx, layer in enumerate(self.layers):
            layer_type = self.layer_types[idx]
            hidden = layer(
                hidden,
                None,
                shared_kv_states=shared_kv,
                position_embeddings=rope[layer_type],
                attention_mask=masks[layer_type],
                position_ids=position_ids,
                cache=cache,
            )  # [B, T, H]
        if last_index is not None:
            # Only the row the host samples from: norm and lm_head over [B, 1, H], never [B, T, V] f32 logits.
            hidden = hidden.index_select(1, last_index)  # [B, 1, H]
        hidden = self.norm(hidden)
        logits = self.lm_head(hidden).float()  # [B, T, V] ([B, 1, V] with last_index); no soft-cap, the host's
        return (logits, *[cache.new_states[n] for n in self.state_names])

    # trace_module needs one method per graph; all are the same forward at different shapes. v3 traces
    # `decode_dense` too: decode batches past the selective limit freeze the other experts path (SelectiveExperts).
    # A last-row build's `prefill` takes last_index after its other inputs; its `score` does not (every row).
    def prefill(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(*inputs)

    def score(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(*inputs)

    def decode(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(*inputs)

    def decode_dense(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(*inputs)


def build_model(text_config, plan: Plan, coll: Collectives = LOCAL, device: str | torch.device = "cpu") -> RecipeModel:
    """Build the module; on "meta" nothing is allocated (residency, NxD sharding templates)."""
    with torch.device(device):
        model = RecipeModel(text_config, plan, coll)
    return model.eval()


def build_device_module(text_config, plan: Plan, coll: Collectives = LOCAL) -> RecipeModel:
    """What each ModelBuilder rank traces: built on meta (no 26B random init), then given uninitialised storage.

    Weight values do not matter to the trace (they are graph inputs loaded from the checkpoint). What does matter
    is rebuilt for real: the rotary inv_freq buffers (baked as constants) and zeroed KV states.
    """
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    model = build_model(text_config, plan, coll, device="meta")
    # meta -> cpu swaps in new Parameter objects, dropping the TP tags NxD's sharder reads: put them back.
    tags = {n: (p.partition_dim, p.num_partitions, p.partition_stride) for n, p in model.named_parameters() if is_parallel(p)}
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        if name in tags and not is_parallel(p):
            mark_parallel(p, *tags[name])
    model.rotary_emb = Gemma4TextRotaryEmbedding(model.text_config)
    model.reset_states()
    return model.eval()


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint -> the module's full (unsharded) state dict
# --------------------------------------------------------------------------------------------------------------------


class CheckpointReader:
    """Lazy tensor access to a safetensors checkpoint (one file or several shards), memory-mapped."""

    # Where the text decoder lives: Gemma4ForCausalLM, Gemma4ForConditionalGeneration, bare text model.
    PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.directory}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, object] = {}
        for handle in self._handles:
            for key in handle.keys():  # noqa: SIM118  (a safetensors handle is not iterable)
                self._where[key] = handle
        probe = "layers.0.input_layernorm.weight"
        self.prefix = next((p for p in self.PREFIXES if p + probe in self._where), None)
        if self.prefix is None:
            raise KeyError(f"no Gemma-4 text decoder weights ({probe}) in {self.directory}")

    def get(self, name: str) -> torch.Tensor:
        """A text-model tensor by its name relative to the decoder (e.g. ``layers.0.mlp.up_proj.weight``)."""
        key = self.prefix + name
        if key not in self._where:
            raise KeyError(f"{key} missing from the checkpoint in {self.directory}")
        return self._where[key].get_tensor(key)

    def lm_head(self, tied: bool) -> torch.Tensor:
        if not tied and "lm_head.weight" in self._where:
            return self._where["lm_head.weight"].get_tensor("lm_head.weight")
        return self.get("embed_tokens.weight")  # tied: the lm_head is the embedding table


# Our parameter name suffix -> (checkpoint suffix, what to take from the per-channel quantization)
_QUANT_SOURCES = {
    ".qweight": (".weight", 0),
    ".scale": (".weight", 1),
    ".gate_up_qweight": (".gate_up_proj", 0),
    ".gate_up_scale": (".gate_up_proj", 1),
    ".down_qweight": (".down_proj", 0),
    ".down_scale": (".down_proj", 1),
}


def convert_checkpoint(reader: CheckpointReader, model: RecipeModel) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` (states excluded) as a full-size tensor: renamed, cast, int8-quantized.

    Driven by the module's own parameter names, so a checkpoint/module mismatch is a clear error here, not a
    silent zero on the device. Shapes are checked against the module's (rank-local x tp) shapes.
    """
    tp = model.plan.tp
    tied = bool(getattr(model.text_config, "tie_word_embeddings", True))
    states = set(model.state_names)
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name in states:
            continue
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(owner, DenseExperts) and name.endswith(".rank"):
            tensor = torch.arange(tp, dtype=torch.int32)  # sharded along dim 0: rank r reads [r]
        else:
            suffix = next((s for s in _QUANT_SOURCES if name.endswith(s)), None)
            quant_owner = isinstance(owner, (ShardLinear, DenseExperts)) and owner.quant
            if suffix is not None and quant_owner:
                src_suffix, part = _QUANT_SOURCES[suffix]
                src = name[: -len(suffix)] + src_suffix
                if src not in quantized:  # q and scale come from one pass; both are kept as outputs anyway
                    quantized[src] = quantize_per_channel(_read(reader, src, tied))
                tensor = quantized[src][part]
            else:
                tensor = _read(reader, name, tied)
            if param.is_floating_point() and tensor.dtype != param.dtype:
                tensor = tensor.to(param.dtype)
        expected = list(param.shape)
        if is_parallel(param):
            expected[param.partition_dim] *= tp
        if list(tensor.shape) != expected:
            raise ValueError(f"{name}: checkpoint gives {list(tensor.shape)}, the module expects {expected}")
        full[name] = tensor.contiguous()
    return full


def _read(reader: CheckpointReader, name: str, tied: bool) -> torch.Tensor:
    if name.startswith("lm_head."):
        return reader.lm_head(tied)
    return reader.get(name)


def load_rank(model: RecipeModel, full: Mapping[str, torch.Tensor], rank: int = 0) -> RecipeModel:
    """Load one rank's shard of a full converted state dict into a materialised module (CPU paths)."""
    local = shard_state_dict(model, full, rank, model.plan.tp)
    missing, unexpected = model.load_state_dict(local, strict=False)
    # rotary inv_freq buffers are non-persistent; only the KV states may be absent from a checkpoint.
    missing = [m for m in missing if m not in set(model.state_names)]
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.reset_states()
    return model


def model_from_checkpoint(checkpoint: Path, plan: Plan, rank: int = 0, coll: Collectives = LOCAL) -> RecipeModel:
    cfg = load_text_config(Path(checkpoint))
    reader = CheckpointReader(Path(checkpoint))
    model = build_model(cfg, plan, coll)
    return load_rank(model, convert_checkpoint(reader, model), rank)


# --------------------------------------------------------------------------------------------------------------------
# Contract inputs (what graphs/jit.py builds from positions; used here for examples and the CPU smoke run)
# --------------------------------------------------------------------------------------------------------------------


def contract_inputs(
    inputs_embeds: torch.Tensor, position_ids: torch.Tensor, max_total: int, window: int
) -> tuple[torch.Tensor, ...]:
    """(embeds [1,T,H], positions [1,T]) -> the five contract tensors."""
    slots = torch.arange(max_total)  # [MAX]
    pos = position_ids[0].to(torch.int64)  # [T]
    onehot = (slots[:, None] == pos[None, :]).float()[None, None]  # [1, 1, MAX, T]
    seen = slots[None, :] <= pos[:, None]  # [T, MAX]
    in_window = seen & (slots[None, :] > pos[:, None] - window)  # [T, MAX]
    neg = torch.finfo(torch.float32).min
    full = torch.where(seen, 0.0, neg)[None, None].float()  # [1, 1, T, MAX]
    sliding = torch.where(in_window, 0.0, neg)[None, None].float()  # [1, 1, T, MAX]
    return inputs_embeds.float(), position_ids.to(torch.int64), onehot, full, sliding


def example_inputs(cfg, t: int, start: int, max_total: int, contract: str = "v1", batch: int = 1,
                   slot_ids: list[int] | None = None, blocks: bool = False,
                   blocks_of: tuple[int, int] | None = None, last: bool = False) -> tuple[torch.Tensor, ...]:
    """One graph's inputs: T tokens from `start` (v3: B rows, row r at start - 3r, in slot_ids or 0..B-1).

    `blocks` (a block-aware prefill, T > 1): block_ids [1, T] after the rest, an image block of T // 2 tokens in the
    middle. `last` (a last-row prefill): last_index [1] at the very end, a row that moves with `start` (a chunk's
    last real row is anywhere in the bucket). v4: `max_total` is the graph's context bucket and `blocks_of` (pool
    blocks, block size) sizes the block table."""
    embeds = torch.randn(batch, t, cfg.hidden_size) * 0.02 * cfg.hidden_size**0.5  # [B, T, H]
    offsets = torch.clamp(start - 3 * torch.arange(batch), min=0)  # [B] distinct rows sit at distinct positions
    positions = offsets[:, None] + torch.arange(t, dtype=torch.int64)  # [B, T]
    extra: tuple[torch.Tensor, ...] = ()
    if blocks and t > 1:
        block_ids = torch.zeros(batch, t, dtype=torch.int64)  # [1, T]
        block_ids[:, t // 4 : t // 4 + max(t // 2, 1)] = 1 + start % 3  # ids are per call: any id > 0 will do
        extra = (block_ids,)
    if last and t > 1:
        extra = (*extra, torch.tensor([t - 1 if start == 0 else t // 2], dtype=torch.int64))  # [1]
    if contract in ("v3", "v4"):
        slots = torch.tensor(slot_ids if slot_ids is not None else list(range(batch)), dtype=torch.int64)  # [B]
        if contract == "v4":  # the block table after slot_ids, then a last-row prefill's last_index
            return embeds.float(), positions, slots, example_table(slots, max_total, blocks_of or (2, 1)), *extra
        return embeds.float(), positions, slots, *extra
    if contract == "v2":
        return embeds.float(), positions, *extra  # v2 builds masks and write slots inside the graph
    return contract_inputs(embeds, positions, max_total, cfg.sliding_window)


def example_table(slots: torch.Tensor, context: int, blocks_of: tuple[int, int]) -> torch.Tensor:
    """v4: int32 [B, context / BS] block tables for rows in `slots`: row b's blocks are distinct from every other
    row's (taken in turn from 1.., wrapping round the pool's NB - 1 lendable blocks) and start at an offset set by its
    slot, so calls with other slots read other blocks in another order."""
    pool, size = blocks_of
    width = max(context // size, 1)
    lendable = max(pool - 1, 1)
    first = slots.to(torch.int64)[:, None] * width + torch.arange(width)[None, :]  # [B, NBc]
    return (1 + torch.remainder(first, lendable)).to(torch.int32)


def v4_graphs(plan: Plan) -> list[tuple[str, int, int, int, int]]:
    """v4: (key, T, start, B, context) per graph: each prefill bucket and each decode batch at each context bucket
    ("prefill_512_c8192", "decode_4_c65536"), and a last-row build's score graph at the largest context only
    (``Plan.score_context``: "score_128_c65536"). The example starts inside its context bucket."""
    graphs = []
    for context in plan.context_buckets:
        for b in plan.buckets:
            graphs.append((f"prefill_{b}_c{context}", b, 0, 1, context))
        if context == plan.score_context:
            graphs += [(f"score_{b}_c{context}", b, 0, 1, context) for b in plan.score_buckets]
        start = min(max(plan.buckets), context - 1)
        graphs += [(f"decode_{b}_c{context}", 1, start, b, context) for b in plan.decode_batches]
    return graphs


def graph_example(cfg, plan: Plan, graph: tuple[str, int, int, int, int], start: int | None = None,
                  slot_ids: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """The example inputs of one of `plan`'s graphs (graph_keys / v4_graphs entries)."""
    key, t, default_start, batch, context = graph
    first = default_start if start is None else start
    if plan.pooled:
        return example_inputs(cfg, t, first, context, plan.contract, batch, slot_ids,
                              blocks_of=(plan.kv_blocks, plan.block_size), last=takes_last_index(plan, key))
    return example_inputs(cfg, t, first, plan.max_total, plan.contract, batch, slot_ids, plan.block_ids,
                          last=takes_last_index(plan, key))


def all_graphs(plan: Plan) -> list[tuple[str, int, int, int, int]]:
    """(key, T, start, B, context) of every graph of `plan`: graph_keys with the context (MAX but for v4)."""
    if plan.pooled:
        return v4_graphs(plan)
    return [(key, t, start, b, plan.max_total) for key, t, start, b in graph_keys(plan)]


def graph_keys(plan: Plan) -> list[tuple[str, int, int, int]]:
    """(key, T, start position of the example, B) per graph: each prefill bucket, then decode.

    v1 keeps its two keys ("prefill", "decode"); v2 names a prefill graph per bucket ("prefill_512"); v3 also a
    decode graph per batch size ("decode_4": [4, 1, H] over 4 slots). A last-row build (Plan.last_logits) adds
    its score graphs ("score_128": every row's logits, at the smallest bucket) after the prefill ones.
    """
    if plan.contract == "v1":
        (bucket,) = plan.buckets
        return [("prefill", bucket, 0, 1), ("decode", 1, bucket, 1)]
    if plan.pooled:
        return [(key, t, start, b) for key, t, start, b, _ in v4_graphs(plan)]
    prefill = [(f"prefill_{b}", b, 0, 1) for b in plan.buckets]
    prefill += [(f"score_{b}", b, 0, 1) for b in plan.score_buckets]  # a last-row build's scored prompts
    if plan.contract == "v3":
        return [*prefill, *((f"decode_{b}", 1, max(plan.buckets), b) for b in plan.decode_batches)]
    return [*prefill, ("decode", 1, max(plan.buckets), 1)]


def takes_last_index(plan: Plan, key: str) -> bool:
    """Whether graph `key` takes last_index: the prefill graphs of a last-row build (not its score graphs)."""
    return plan.last_logits and key.startswith("prefill")


def decode_experts(plan: Plan, cfg) -> dict[int, str]:
    """Which experts path each decode batch's graph holds: selective while B tokens gather fewer expert slices
    than dense reads (``selective_token_limit``: B * top_k < num_experts for the 26B), dense above."""
    limit = selective_token_limit(cfg, plan.tp, plan.quant) if plan.experts == "selective" else 0
    return {b: "selective" if b <= limit else "dense" for b in plan.decode_batches}


# --------------------------------------------------------------------------------------------------------------------
# Residency: bytes per rank by component, from the config alone
# --------------------------------------------------------------------------------------------------------------------


def component_of(name: str, states: Iterable[str]) -> str:
    if name in states:
        return "kv_cache"
    if ".experts." in name:
        return "experts"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "shared_mlp"
    if name.startswith("lm_head."):
        return "lm_head"
    return "other"  # norms, router, layer scalars, rotary tables, expert rank


def residency(
    text_config,
    tp: int,
    quant: str,
    max_total: int,
    dtype: torch.dtype = torch.bfloat16,
    contract: str = "v1",
    buckets: tuple[int, ...] = (128,),
    attn_quant: str = "none",
    kv_slots: int = 1,
    decode_batches: tuple[int, ...] = (1,),
    kv_quant: str = "none",
    kv_blocks: int = 0,
    block_size: int = 128,
    context_buckets: tuple[int, ...] = (),
    prefill_logits: str | None = None,
    query_tile: int | None = None,
    expert_group: int | None = None,
) -> dict[str, int]:
    """Device bytes held by one rank, per component (every rank holds the same amount). v4: `kv_blocks` blocks of
    `block_size` positions in the global layers' pool and `kv_slots` sliding rings (one per running row).

    `prefill_logits` / `query_tile` / `expert_group` default to what a build of `contract` gets (v1: "all" rows,
    untiled; v2/v3/v4: "last" and ``default_query_tile``; v4: ``default_expert_group``), so the scratch counted is the
    scratch the build's graphs hold. The experts are counted in the dense layout (E/tp experts of [2I, H] a rank):
    the same resident bytes as the selective one, and its one-pass gate+up is as wide."""
    from accelerate import init_empty_weights

    ringed = contract in ("v2", "v3", "v4")
    plan = Plan(tp=tp, quant=quant, dtype=dtype, max_total=max_total, kv_as_params=True, inplace_kv=False,
                contract=contract, buckets=tuple(buckets), attn_quant=attn_quant, kv_slots=kv_slots,
                decode_batches=tuple(decode_batches), kv_quant=kv_quant, kv_blocks=kv_blocks, block_size=block_size,
                context_buckets=tuple(context_buckets or ((max_total,) if contract == "v4" else ())),
                prefill_logits=prefill_logits or ("last" if ringed else "all"),
                query_tile=default_query_tile(contract) if query_tile is None else query_tile,
                expert_group=default_expert_group(contract) if expert_group is None else expert_group)
    with init_empty_weights(include_buffers=True):
        model = RecipeModel(text_config, plan)
    states = set(model.state_names)
    sizes = dict.fromkeys(COMPONENTS, 0)
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        sizes[component_of(name, states)] += t.numel() * t.element_size()
    sizes["total"] = sum(sizes[c] for c in COMPONENTS)
    sizes.update(prefill_scratch(text_config, plan, model))
    if plan.slotted:
        # A decode step of the largest batch gathers its rows' slots of one layer at a time ([B, kvh, R, D], K and
        # V; the compiler may stream it instead) and returns f32 logits [B, V].
        rows = max(plan.decode_batches)
        widen = torch.finfo(dtype).bits // 8 if plan.kv_int8 else 1  # int8 KV is read back widened
        if plan.pooled:
            # v4: one global layer's gathered blocks (K and V) for the call's rows, at most the lent blocks (the host
            # groups rows by context bucket: a call's rows read their own bucket's blocks), or the rows' sliding rings.
            per_row = kv_bytes_per_row(model)
            keys = min(rows * max_total, (plan.kv_blocks - 1) * plan.block_size)
            gathered = max(rows * per_row["sliding_layer"], keys * per_row["global_per_token_layer"])
            sizes["decode_scratch_estimate"] = gathered * widen + rows * 4 * text_config.vocab_size
            return sizes
        per_slot_layer = max(t.numel() * t.element_size() for t in model.state_tensors()) // plan.kv_slots
        per_slot_layer = per_slot_layer * widen
        sizes["decode_scratch_estimate"] = rows * (2 * per_slot_layer + 4 * text_config.vocab_size)
    return sizes


def kv_bytes_per_row(model: RecipeModel) -> dict[str, int]:
    """Per rank, from the model's KV states: one row's sliding rings (all sliding layers, and the largest one layer
    holds), and a global position's K/V (all global layers, and one layer's). v4 pays the first per running row and
    the second per position a row holds; v3 pays both for MAX positions per slot."""
    out = {"sliding": 0, "sliding_layer": 0, "global_per_token": 0, "global_per_token_layer": 0}
    per_layer: dict[int, list[int]] = {}
    for name, t in zip(model.state_names, model.state_tensors(), strict=True):
        idx = int(name.split(".")[1])
        nbytes = t.numel() * t.element_size()
        if model.layer_types[idx] == "full_attention":
            # v4: [NB, kvh, BS, D], NB * BS positions; v1-v3: [S, kvh, R, D], R positions per slot
            positions = t.shape[0] * t.shape[2] if model.plan.pooled else t.shape[2]
            nbytes = nbytes if model.plan.pooled else nbytes // t.shape[0]
            per_layer.setdefault(idx, [0, 0])[1] += nbytes // positions
        else:
            per_layer.setdefault(idx, [0, 0])[0] += nbytes // t.shape[0]
    for sliding, per_token in per_layer.values():
        out["sliding"] += sliding
        out["sliding_layer"] = max(out["sliding_layer"], sliding)
        out["global_per_token"] += per_token
        out["global_per_token_layer"] = max(out["global_per_token_layer"], per_token)
    return out


def prefill_scratch(text_config, plan: Plan, model: RecipeModel) -> dict[str, int]:
    """Per-rank bytes a prefill call needs on top of what is resident (an estimate: the compiler may tile further),
    the largest over the build's prefill graphs (each bucket's, and a last-row build's score graph) of:

      logits       f32 [rows, V] gathered: rows = 1 for a last-row prefill graph, T for a score graph (or an "all"
                   build's prefill)
      attention    one layer's live f32 scores and mask, the larger layer kind: a global layer's [heads, tile, ring]
                   + [tile, ring] (tile = Plan.query_tile rows, or T untiled), a sliding layer's [heads/tp, T, ring]
      activations  f32 rows of T tokens, 3 x hidden (residual, normed, attention out) + the widest row inside a
                   layer (the global layer's queries, the shared MLP's gate+up, the dense experts path's gate+up of one
                   pass: [G, 2I_l], G = Plan.expert_group or all E_l local experts; dense E/tp x I, selective E x I/tp)
      gathered     v4 only: one global layer's K and V gathered from the pool in table order ([kvh, NBc * BS, D]
                   each, at the graph's context bucket; an int8 pool's read back widened), which the attention reads
                   (a v3 ring is read where it lies)

    Not counted: an int8 experts build's per-expert down-projection partials [T, G, H] of one pass before the scale and
    the sum over experts (``prefill_experts_partials``, reported beside it): a contraction a compiler accumulates
    rather than stores; on the CPU trace they are materialized.
    """
    cfg = text_config
    heads = int(cfg.num_attention_heads)
    global_slots = plan.ring_slots(None) if plan.ringed else plan.max_total
    if plan.pooled:
        global_slots = plan.max_total  # v4: a prefill of the largest context bucket gathers that many keys per layer
    window = int(cfg.sliding_window) if cfg.sliding_window else None
    sliding_slots = plan.ring_slots(window) if plan.ringed else plan.max_total
    sliding_heads = heads // plan.tp if plan.tp > 1 else heads
    experts = model.layers[0].experts  # every layer's block has the same layout
    # one pass of the dense experts path: G of its local experts, each its gate+up rows ([E_l, 2I_l, H] on the rank)
    gate_up = experts.gate_up_qweight if plan.int8 else experts.gate_up_proj
    experts_local, gate_up_rows = int(gate_up.shape[0]), int(gate_up.shape[1])
    per_pass = min(plan.expert_group, experts_local) if plan.expert_group else experts_local
    head_dim = max(int(layer.self_attn.head_dim) for layer in model.layers)  # the global layers' (512 on the 26B)
    widest = max(heads * head_dim, 2 * int(cfg.intermediate_size) // plan.tp, per_pass * gate_up_rows)
    graphs = [(b, not plan.last_logits) for b in plan.buckets] + [(b, True) for b in plan.score_buckets]
    gathered = 0
    if plan.pooled:  # every v4 prefill graph of the largest context (and the score graph) gathers MAX keys a layer
        widen = torch.finfo(plan.dtype).bits // 8 if plan.kv_int8 else 1
        gathered = plan.max_total * kv_bytes_per_row(model)["global_per_token_layer"] * widen
    best: dict[str, int] = {}
    for rows, all_rows in graphs:
        tile = min(plan.query_tile, rows) if plan.query_tile else rows
        terms = {
            "logits": 4 * int(cfg.vocab_size) * (rows if all_rows else 1),
            "attention": max(4 * tile * global_slots * (heads + 1), 4 * rows * sliding_slots * (sliding_heads + 1)),
            "activations": 4 * rows * (3 * int(cfg.hidden_size) + widest),
            **({"gathered": gathered} if plan.pooled else {}),
        }
        if sum(terms.values()) > sum(best.values()):
            best = terms
    out = {"prefill_scratch_estimate": sum(best.values())}
    out.update({f"prefill_scratch_{name}": value for name, value in best.items()})
    if plan.int8:
        out["prefill_experts_partials"] = 4 * max(plan.buckets) * per_pass * int(cfg.hidden_size)
    return out


# What a v3 build may hold per NeuronCore: 15 GB of its 16, the rest left to the runtime and the compiler's own buffers.
CORE_BUDGET_BYTES = 15 * 10**9
SLOT_TABLE_SLOTS = (1, 2, 3, 4, 6, 8)
SLOT_TABLE_MAX_TOTAL = (2048, 4096, 8192, 16384, 32768, 65536, 131072)  # agents want 32k-64k (issue 34)


def fits_core(sizes: Mapping[str, int]) -> bool:
    """Resident bytes plus the larger of the two scratch estimates (a call is a prefill or a decode) within budget."""
    scratch = max(sizes.get("prefill_scratch_estimate", 0), sizes.get("decode_scratch_estimate", 0),
                  sizes.get("vision_scratch_estimate", 0))  # the tower runs between the LM's calls, not beside them
    return sizes["total"] + scratch <= CORE_BUDGET_BYTES


def slot_table(text_config, tp: int, quant: str, buckets: tuple[int, ...], decode_batches: tuple[int, ...] = (1, 2, 4),
               slots: Iterable[int] = SLOT_TABLE_SLOTS, max_totals: Iterable[int] = SLOT_TABLE_MAX_TOTAL,
               kv_quant: str = "none", vision: Mapping[str, int] | None = None, prefill_logits: str | None = None,
               query_tile: int | None = None) -> dict:
    """Per attention mode and MAX: per-rank bytes (resident + scratch) of each slot count, and the most slots that fit.
    `vision` (vision_residency): the tower's weights are resident beside the LM's, its scratch is one more call."""
    table: dict = {"kind": "projection (residency from the config; not a measurement)", "budget_bytes": CORE_BUDGET_BYTES,
                   "tp": tp, "quant": quant, "kv_quant": kv_quant, "prefill_buckets": list(buckets), "rows": [],
                   "prefill_logits": prefill_logits or "last",
                   "query_tile": DEFAULT_QUERY_TILE if query_tile is None else query_tile,
                   **({"vision": dict(vision)} if vision else {})}
    for attn_quant in QUANT_MODES:
        for max_total in max_totals:
            row = {"attn_quant": attn_quant, "max_total": max_total, "bytes": {}, "max_slots": 0}
            for s in slots:
                batches = tuple(b for b in decode_batches if b <= s)
                sizes = residency(text_config, tp, quant, max_total, contract="v3", buckets=buckets,
                                  attn_quant=attn_quant, kv_slots=s, decode_batches=batches, kv_quant=kv_quant,
                                  prefill_logits=prefill_logits, query_tile=query_tile)
                if vision:
                    sizes.update(vision)
                    sizes["total"] += vision["vision"]
                row["bytes"][str(s)] = sizes["total"] + max(sizes["prefill_scratch_estimate"],
                                                            sizes["decode_scratch_estimate"],
                                                            sizes.get("vision_scratch_estimate", 0))
                if fits_core(sizes):
                    row["max_slots"] = s
            table["rows"].append(row)
    return table


# v4's projection (issue 34): conversation mixes by need, the issue's two first (an agent's 64k; a 32k agent beside
# three 4k chats), then v3's 4 x 8k and 8 x 4k for comparison, two 32k agents, and a 128k one.
POOL_MIXES = ((65536,), (32768, 4096, 4096, 4096), (8192,) * 4, (4096,) * 8, (32768, 32768), (131072,))
POOL_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)  # context buckets a v4 build compiles (up to its largest)
PREFILL_BOUND = 350 * 10**6  # issue 34: prefill scratch at 32k <= 0.35 GB per rank (the bounded-scratch graphs)
POOL_BLOCK = 128  # positions per block: one DMA of 128 x 512 x 2 B = 128 KiB per K or V head on the 26B


def pool_plan_sizes(lengths: Iterable[int], block_size: int = POOL_BLOCK) -> tuple[int, tuple[int, ...]]:
    """(pool blocks, context buckets) of a v4 build that holds conversations of `lengths` tokens at once: each one
    ceil(L / BS) blocks, plus the null block; the buckets up to the smallest standard one holding the longest."""
    lengths = list(lengths)
    blocks = 1 + sum(-(-n // block_size) for n in lengths)
    top = next((c for c in POOL_CONTEXTS if c >= max(lengths)), max(lengths))
    return blocks, tuple(c for c in POOL_CONTEXTS if c < top) + (top,)


def pool_table(text_config, tp: int, quant: str, buckets: tuple[int, ...], decode_batches: tuple[int, ...] = (1, 2, 4),
               mixes: Iterable[tuple[int, ...]] = POOL_MIXES, kv_quant: str = "none",
               block_size: int = POOL_BLOCK) -> dict:
    """v4 by need: per attention mode and conversation mix, per-rank bytes (resident + the larger scratch) of a pool
    sized for exactly that mix, as a v4 build's defaults hold it (last-row prefill logits, query tiles), the same
    pool with every prefill row and untiled attention (`--prefill-logits all --query-tile 0`, "unbounded_*"), and
    v3's bytes for the same rows (every slot as long as the longest)."""
    table: dict = {"kind": "projection (residency from the config; not a measurement)", "budget_bytes": CORE_BUDGET_BYTES,
                   "tp": tp, "quant": quant, "kv_quant": kv_quant, "prefill_buckets": list(buckets),
                   "block_size": block_size, "rows": []}
    for attn_quant in QUANT_MODES:
        for mix in mixes:
            blocks, contexts = pool_plan_sizes(mix, block_size)
            batches = tuple(b for b in decode_batches if b <= len(mix))
            common = dict(buckets=buckets, attn_quant=attn_quant, kv_slots=len(mix), decode_batches=batches,
                          kv_quant=kv_quant)
            pool = dict(contract="v4", kv_blocks=blocks, block_size=block_size, context_buckets=contexts, **common)
            sizes = residency(text_config, tp, quant, contexts[-1], **pool)
            unbounded = residency(text_config, tp, quant, contexts[-1], prefill_logits="all", query_tile=0,
                                  expert_group=0, **pool)
            v3 = residency(text_config, tp, quant, max(mix), contract="v3", **common)
            scratch = max(sizes["prefill_scratch_estimate"], sizes["decode_scratch_estimate"])
            table["rows"].append({
                "attn_quant": attn_quant, "conversations": list(mix), "kv_blocks": blocks, "context_buckets": list(contexts),
                "kv_cache": sizes["kv_cache"], "resident": sizes["total"],
                "prefill_scratch_estimate": sizes["prefill_scratch_estimate"],
                "decode_scratch_estimate": sizes["decode_scratch_estimate"],
                "bytes": sizes["total"] + scratch, "fits": fits_core(sizes),
                # the same with the prefill scratch held to issue 34's bound (0.35 GB): what the table showed before
                # v4 built bounded scratch, kept for the JSON's readers
                "bytes_bounded_prefill": sizes["total"] + max(min(sizes["prefill_scratch_estimate"], PREFILL_BOUND),
                                                              sizes["decode_scratch_estimate"]),
                "unbounded_prefill_scratch_estimate": unbounded["prefill_scratch_estimate"],
                "unbounded_bytes": unbounded["total"] + max(unbounded["prefill_scratch_estimate"],
                                                            unbounded["decode_scratch_estimate"]),
                "unbounded_fits": fits_core(unbounded),
                "v3_kv_cache": v3["kv_cache"],
                "v3_bytes": v3["total"] + max(v3["prefill_scratch_estimate"], v3["decode_scratch_estimate"]),
                "v3_fits": fits_core(v3),
            })
    return table


def print_pool_table(table: Mapping, as_json: bool) -> None:
    gb = 1e9
    print(f"PROJECTION (v4, KV by need): per-rank GB, tp={table['tp']}, quant={table['quant']}, "
          f"kv-quant={table['kv_quant']}, buckets {table['prefill_buckets']}, blocks of {table['block_size']}; "
          f"fits = resident + the larger scratch within {table['budget_bytes'] / gb:.0f} GB")
    print(f"  {'attention':<9} {'conversations':<28} {'blocks':>6} {'KV':>6} {'resident':>8} {'prefill':>7} "
          f"{'decode':>6} {'total':>6} fits | all rows untiled: prefill, total, fits | v3 KV, total, fits")
    for row in table["rows"]:
        mix = "+".join(str(n) for n in row["conversations"])
        print(f"  {row['attn_quant']:<9} {mix:<28} {row['kv_blocks']:>6} {row['kv_cache'] / gb:6.2f} "
              f"{row['resident'] / gb:8.2f} {row['prefill_scratch_estimate'] / gb:7.2f} "
              f"{row['decode_scratch_estimate'] / gb:6.2f} {row['bytes'] / gb:6.2f} {'yes' if row['fits'] else 'no':>4}"
              f" | {row['unbounded_prefill_scratch_estimate'] / gb:5.2f} {row['unbounded_bytes'] / gb:6.2f} "
              f"{'yes' if row['unbounded_fits'] else 'no':>3}"
              f" | {row['v3_kv_cache'] / gb:5.2f} {row['v3_bytes'] / gb:6.2f} {'yes' if row['v3_fits'] else 'no'}")
    if as_json:
        print(json.dumps(table))


def print_slot_table(table: Mapping, as_json: bool) -> None:
    slots = list(table["rows"][0]["bytes"])
    vision = table.get("vision")
    if vision:
        print(f"with the vision tower: {vision['vision'] / 1e9:.3f} GB resident per rank "
              f"({'sharded' if vision['vision_sharded'] else 'replicated'}), "
              f"{vision['vision_scratch_estimate'] / 1e9:.3f} GB scratch at the largest budget")
    print(f"PROJECTION: per-rank GB (resident + scratch) by KV slots, tp={table['tp']}, quant={table['quant']}, "
          f"kv-quant={table['kv_quant']}, "
          f"buckets {table['prefill_buckets']}; fits = within {table['budget_bytes'] / 1e9:.0f} GB of the core's 16")
    print(f"  {'attention':<9} {'MAX':>6} " + " ".join(f"{s + ' slots':>9}" for s in slots) + "  most that fit")
    for row in table["rows"]:
        cells = " ".join(f"{row['bytes'][s] / 1e9:9.2f}" for s in slots)
        print(f"  {row['attn_quant']:<9} {row['max_total']:>6} {cells}  {row['max_slots']}")
    if as_json:
        print(json.dumps(table))


def print_residency(sizes: Mapping[str, int], tp: int, quant: str, max_total: int, as_json: bool,
                    contract: str = "v1", extra: str = "") -> None:
    print(f"per-rank device residency (contract {contract}, tp={tp}, quant={quant}, MAX={max_total}{extra}, "
          "bf16 compute)")
    for comp in (*COMPONENTS, "vision", "total", "prefill_scratch_estimate", "decode_scratch_estimate",
                 "vision_scratch_estimate"):
        if comp in sizes:
            print(f"  {comp:<11} {sizes[comp] / 1e9:9.3f} GB  ({sizes[comp] / 2**30:7.3f} GiB)")
        if comp == "prefill_scratch_estimate" and comp in sizes:
            parts = ", ".join(f"{name} {sizes[f'prefill_scratch_{name}'] / 1e9:.3f}"
                              for name in ("logits", "attention", "activations", "gathered")
                              if f"prefill_scratch_{name}" in sizes)
            print(f"    = {parts} GB" + (f"; not counted: experts' down partials "
                                         f"{sizes['prefill_experts_partials'] / 1e9:.3f} GB"
                                         if "prefill_experts_partials" in sizes else ""))
    verdict = "fits" if fits_core(sizes) else "does NOT fit"
    print(f"  resident + the larger scratch {verdict} in {CORE_BUDGET_BYTES / 1e9:.0f} GB per core")
    if as_json:
        print(json.dumps({k: int(v) for k, v in sizes.items()}))


# --------------------------------------------------------------------------------------------------------------------
# Lowering check: every graph on torch-xla (CPU PJRT), the HLO neuronx-cc would compile
# --------------------------------------------------------------------------------------------------------------------

LOWERING_NOTE = "lowering is necessary for neuronx-cc, not sufficient"


def check_lowering(cfg, plan: Plan, vision_config=None, budgets: Iterable[int] = ()) -> dict:
    """Build the device module (rank-local shapes, KV as aliased states) on the XLA device with random weights and
    run every graph twice at different positions. Pass: no aten:: fallback, one compilation on the first call of a
    graph, none on the second. The collectives are identity here (one process); NxD puts its own in.
    """
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
    except ImportError as exc:
        raise SystemExit(f"--check-lowering needs torch-xla (pip install -r requirements-xla.txt): {exc}") from exc

    check_supported(cfg, plan.tp)
    device = torch_xla.device()
    # As NxD traces it: KV states are parameters, the graph returns their new values and the caller aliases them.
    plan = Plan(**{**plan.__dict__, "kv_as_params": True, "inplace_kv": False})
    model = build_model(cfg, plan)
    randomize(model)
    model.to(device)
    torch_xla.sync()  # weights and states become device data before the first graph
    xm.wait_device_ops()

    def counters() -> dict[str, int]:
        return {n: met.counter_value(n) or 0 for n in met.counter_names()}

    graphs = []
    last_slot = plan.kv_slots - 1
    for graph in all_graphs(plan):
        key, t, _, batch, context = graph
        calls = []
        # First call at 0, second at the far end of the context (the ring has wrapped there); v3 moves the rows to
        # other slots too (the second call's slots counted down from the last one; v4: other block tables as well).
        for start, slots in ((0 if t > 1 else min(min(plan.buckets), context - 1), list(range(batch))),
                             (context - t, [last_slot - r for r in range(batch)])):
            example = graph_example(cfg, plan, graph, start, slots)
            inputs = [x.to(device) for x in example]
            before = counters()
            out = model(*inputs)
            for state, new in zip(model.state_tensors(), out[1:], strict=True):
                state.data = new  # what the input/output alias does on the device
            torch_xla.sync()
            xm.wait_device_ops()
            finite = bool(torch.isfinite(out[0].cpu()).all())
            after = counters()
            delta = {n: v - before.get(n, 0) for n, v in after.items() if v != before.get(n, 0)}
            calls.append({
                "start": start,
                "positions": example[1][:, 0].tolist(),
                **({"slots": slots} if plan.slotted else {}),
                **({"block_table": example[3].tolist()} if plan.pooled else {}),
                "compilations": delta.get("UncachedCompile", 0),
                "aten_fallbacks": {n: v for n, v in delta.items() if n.startswith("aten::")},
                "finite_logits": finite,
            })
        ok = (
            not any(c["aten_fallbacks"] for c in calls)
            and calls[0]["compilations"] == 1
            and calls[1]["compilations"] == 0
            and all(c["finite_logits"] for c in calls)
        )
        experts = decode_experts(plan, cfg)[batch] if plan.slotted and t == 1 else None
        graphs.append({"graph": key, "T": t, "B": batch, **({"experts": experts} if experts else {}),
                       "calls": calls, "pass": ok})
    if vision_config is not None:
        graphs += lower_vision(vision_config, cfg, plan, budgets, device, counters)
    return {
        "contract": plan.contract,
        "block_ids": plan.block_ids,  # --vision: the prefill graphs take image-block ids (lowered with a block)
        **({"kv_slots": plan.kv_slots, "decode_batches": list(plan.decode_batches), "kv_quant": plan.kv_quant}
           if plan.slotted else {}),
        **({"kv_blocks": plan.kv_blocks, "block_size": plan.block_size,
            "context_buckets": list(plan.context_buckets)} if plan.pooled else {}),
        "max_total": plan.max_total,
        "prefill_buckets": list(plan.buckets),
        "tp": plan.tp,
        "quant": plan.quant,
        "experts": plan.experts,
        "attn_quant": plan.attn_quant,
        "torch_xla": torch_xla.__version__,
        "graphs": graphs,
        "pass": all(g["pass"] for g in graphs),
        "note": LOWERING_NOTE,
    }


def randomize_vision(tower: VisionTower, seed: int = 0) -> None:
    """Random tower weights of a sane scale; clip bounds wide open, standardization the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if name.endswith(("input_min", "output_min")):
                p.fill_(-1e4)
            elif name.endswith(("input_max", "output_max")):
                p.fill_(1e4)
            elif name.endswith("std_bias"):
                p.zero_()
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.fill_(1.0)


def lower_vision(vision_config, text_config, plan: Plan, budgets: Iterable[int], device, counters) -> list[dict]:
    """check_lowering's part for the tower: each budget's graph called twice, with images of two aspects (other real
    rows, other pad rows), rank-local shapes (sharded when the bytes say so), identity collectives."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    tower = build_vision(vision_config, text_config, Plan(tp=plan.tp, dtype=plan.dtype, vision_tp=plan.vision_tp))
    randomize_vision(tower)
    tower.to(device)
    torch_xla.sync()
    xm.wait_device_ops()
    graphs = []
    for budget in sorted(budgets):
        calls = []
        for aspect in ((1, 1), (3, 2)):
            pixels, positions = vision_example(vision_config, budget, aspect)
            before = counters()
            out = tower(pixels.to(device), positions.to(device))
            torch_xla.sync()
            xm.wait_device_ops()
            finite = bool(torch.isfinite(out.cpu()).all())
            after = counters()
            delta = {n: v - before.get(n, 0) for n, v in after.items() if v != before.get(n, 0)}
            calls.append({"aspect": list(aspect), "real_rows": int((positions[0] != -1).all(-1).sum()),
                          "compilations": delta.get("UncachedCompile", 0),
                          "aten_fallbacks": {n: v for n, v in delta.items() if n.startswith("aten::")},
                          "finite_logits": finite})
        ok = (not any(c["aten_fallbacks"] for c in calls) and calls[0]["compilations"] == 1
              and calls[1]["compilations"] == 0 and all(c["finite_logits"] for c in calls))
        k = int(vision_config.pooling_kernel_size)
        graphs.append({"graph": f"vision_{budget}", "T": budget * k * k, "B": 1, "sharded": tower.sharded,
                       "calls": calls, "pass": ok})
    return graphs


def print_lowering(report: Mapping, as_json: bool) -> None:
    print(f"lowering check on torch-xla {report['torch_xla']} (contract {report['contract']}, MAX={report['max_total']},"
          f" buckets {report['prefill_buckets']}, tp={report['tp']} rank-local, quant={report['quant']},"
          f" experts={report['experts']}, attn-quant={report['attn_quant']}): "
          f"{LOWERING_NOTE}")
    if report.get("block_ids"):
        print("  block-aware prefill: block_ids [1, T] in, an image block in every prefill call")
    if "kv_slots" in report:
        print(f"  {report['kv_slots']} KV slots, decode batches {report['decode_batches']}, kv-quant {report['kv_quant']}")
    print(f"  {'graph':<14} {'B':>3} {'T':>5} {'compiles 1st/2nd':>17}  aten:: fallbacks")
    for g in report["graphs"]:
        first, second = g["calls"]
        fallbacks = {k: v for c in g["calls"] for k, v in c["aten_fallbacks"].items()} or "none"
        verdict = "ok" if g["pass"] else "FAIL"
        experts = f"  experts {g['experts']}" if "experts" in g else ""
        if "sharded" in g:
            experts = "  tower " + ("TP-sharded" if g["sharded"] else "replicated")
        print(f"  {g['graph']:<14} {g['B']:>3} {g['T']:>5} {first['compilations']:>8}/{second['compilations']:<8}  "
              f"{fallbacks}  {verdict}{experts}")
    print("PASS" if report["pass"] else "FAIL")
    if as_json:
        print(json.dumps(report))


# --------------------------------------------------------------------------------------------------------------------
# Roofline: bytes read per decoded token, and the decode rate they project to (a projection, not a measurement)
# --------------------------------------------------------------------------------------------------------------------

CHIP_HBM_BYTES_PER_S = 820 * 2**30  # Inferentia2 chip (both NeuronCore-v2): 820 GiB/s of HBM bandwidth
CHIP_BF16_FLOPS = 190e12  # Inferentia2 chip: 190 BF16 TFLOPS (the int8 weights are widened to bf16 for the matmul)
# The published xlarge build: dense experts, TP=2, int8 experts/shared MLP/lm_head, bf16 attention, MAX=512, and the
# decode rate it reached on the device. Its efficiency (bytes it reads per token x 6 / 820 GiB/s) is the yardstick.
PUBLISHED_TOK_S = 6.0
PUBLISHED_PLAN = dict(tp=2, quant="int8", attn_quant="none", experts="dense", max_total=512, contract="v1", buckets=(128,))
# The v1 contract's KV traffic per decoded token: the one-hot blend reads and writes every slot, attention reads it.
V1_KV_PASSES = 3


def expert_path_seconds(cfg, tp: int, weight_bytes: int, tokens: int, path: str) -> float:
    """Roofline time of one layer's experts on one rank for ``tokens`` tokens: max(bytes / bw, flops / peak).

    Intermediate split (every rank holds 1/tp of every expert). Dense reads all E slices once and runs every token
    through all of them; selective gathers one slice per (token, routed expert), N*K of them (no dedup: static
    shapes), and runs only those.
    """
    h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size // tp, cfg.num_experts, cfg.top_k_experts
    scale_bytes = (2 * i + h) * 4 if weight_bytes == 1 else 0  # f32 per-channel scales of an int8 expert
    slice_bytes = 3 * h * i * weight_bytes + scale_bytes  # one expert's gate, up and down on this rank
    slices = e if path == "dense" else tokens * k
    macs = tokens * (e if path == "dense" else k) * 3 * h * i
    return max(slices * slice_bytes / (CHIP_HBM_BYTES_PER_S / tp), 2 * macs / (CHIP_BF16_FLOPS / tp))


def selective_token_limit(cfg, tp: int, quant: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """The largest token count at which gathering the routed experts is cheaper than dense (0: never).

    Decided by the roofline since no device is here. For the 26B (E=128, K=8) it is 15 tokens (N*K < E: past that
    the gathers read more than all experts once), so decode (N=1) is selective and a 128-token prefill is dense.
    """
    weight_bytes = 1 if quant == "int8" else torch.finfo(dtype).bits // 8
    limit = 0
    for tokens in range(1, cfg.num_experts + 1):
        selective = expert_path_seconds(cfg, tp, weight_bytes, tokens, "selective")
        if selective < expert_path_seconds(cfg, tp, weight_bytes, tokens, "dense"):
            limit = tokens
    return limit


def bytes_read_per_token(model: RecipeModel, tokens: int = 1) -> dict[str, int]:
    """Device bytes one rank reads for one graph call of ``tokens`` tokens, per component (weights + KV: v1's blend
    reads and writes every slot, v2's rings are read once by attention; a v3 decode step of ``tokens`` rows reads
    those rows' slots, tokens / S of the cache)."""
    states = set(model.state_names)
    sizes = dict.fromkeys(COMPONENTS, 0)
    for prefix, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for short, t in tensors:
            name = f"{prefix}.{short}" if prefix else short
            component = component_of(name, states)
            nbytes = t.numel() * t.element_size()
            if isinstance(module, SelectiveExperts) and tokens <= module.selective_tokens:
                nbytes = nbytes * tokens * module.top_k // module.num_experts  # N*K gathered expert slices
            if component == "kv_cache" and model.plan.contract == "v1":
                nbytes *= V1_KV_PASSES  # v2 writes O(T) slots by index: attention's one read is what counts
            elif component == "kv_cache" and model.plan.contract == "v3":
                nbytes = nbytes * tokens // model.plan.kv_slots  # each decode row reads its own slot's rings
            sizes[component] += nbytes
    sizes["total"] = sum(sizes[c] for c in COMPONENTS)
    return sizes


def _max_count_expectation(experts: int, top_k: int, tp: int) -> float:
    """E[max over ranks of how many of a token's top_k experts a rank holds], experts split evenly by rank.

    Uniform routing (every top_k subset equally likely): P(max <= m) = [z^K] (sum_{j<=m} C(E/tp, j) z^j)^tp / C(E, K).
    """
    from math import comb

    per_rank = experts // tp
    total = comb(experts, top_k)

    def at_most(m: int) -> float:
        poly = [1]
        factor = [comb(per_rank, j) for j in range(min(m, per_rank) + 1)]
        for _ in range(tp):
            poly = [sum(poly[a] * factor[n - a] for a in range(len(poly)) if 0 <= n - a < len(factor))
                    for n in range(len(poly) + len(factor) - 1)]
        return (poly[top_k] if top_k < len(poly) else 0) / total

    return sum(1.0 - at_most(m) for m in range(top_k))  # E[max] = sum_m P(max > m)


def tp_split_comparison(cfg, tp: int, quant: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Expert bytes per rank per decoded token, all layers: split by expert vs split by intermediate dim."""
    weight_bytes = 1 if quant == "int8" else torch.finfo(dtype).bits // 8
    h, i, k, layers = cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k_experts, cfg.num_hidden_layers
    scales = (2 * i + h) * 4 if weight_bytes == 1 else 0
    expert = (3 * h * i * weight_bytes + scales) * layers  # one whole expert, every layer
    expected_max = _max_count_expectation(cfg.num_experts, k, tp)
    return {
        "by_expert_static_gather": {"worst": k * expert, "expected": k * expert,
                                    "why": "a static gather must hold all K experts on every rank (all may be local)"},
        "by_expert_ideal_dynamic": {"worst": k * expert, "expected": round(expected_max * expert),
                                    "why": "only the local experts, but the step waits for the rank holding most "
                                           "(not expressible with static shapes)"},
        "by_intermediate": {"worst": k * expert // tp, "expected": k * expert // tp,
                            "why": "every rank gathers its 1/tp of all K experts, whatever the routing"},
        "chosen": "by_intermediate",
    }


def roofline(text_config, tp: int, quant: str, attn_quant: str, max_total: int, bucket: int, contract: str = "v1",
             buckets: tuple[int, ...] | None = None, kv_slots: int = 1, decode_batches: tuple[int, ...] = (1,),
             kv_quant: str = "none") -> dict:
    """Per-rank bytes per decoded token by component, dense and selective, and the decode rates they project to;
    for v3 also per decode batch size: the bytes of one step over B rows and its per-stream and aggregate rate."""
    buckets = buckets or (bucket,)

    def model_for(**overrides) -> RecipeModel:
        fields = dict(tp=tp, quant=quant, attn_quant=attn_quant, experts="dense", max_total=max_total,
                      contract=contract, buckets=buckets, kv_slots=kv_slots, decode_batches=decode_batches,
                      kv_quant=kv_quant) | overrides
        return build_model(text_config, Plan(dtype=torch.bfloat16, kv_as_params=True, inplace_kv=False, **fields),
                           device="meta")

    published = model_for(**PUBLISHED_PLAN, kv_slots=1, decode_batches=(1,), kv_quant="none")
    published_bytes = bytes_read_per_token(published)["total"] * PUBLISHED_PLAN["tp"]
    efficiency = PUBLISHED_TOK_S * published_bytes / CHIP_HBM_BYTES_PER_S

    def variant(experts: str) -> dict:
        sizes = bytes_read_per_token(model_for(experts=experts))
        chip = sizes["total"] * tp
        ceiling = CHIP_HBM_BYTES_PER_S / chip
        return {
            "bytes_per_rank": sizes,
            "bytes_per_token_chip": chip,
            "projected_tok_s_at_820_gib_s": round(ceiling, 1),
            "projected_tok_s_at_published_efficiency": round(ceiling * efficiency, 1),
        }

    limit = selective_token_limit(text_config, tp, quant)
    batched = {}
    if contract == "v3":
        # One step over B rows: attention, shared MLP, lm_head and the rest read once for all rows; the routed
        # experts (B * K gathered slices while B <= the selective limit, all E above) and the B rows' KV grow with B.
        selective = model_for(experts="selective")
        for b in decode_batches:
            sizes = bytes_read_per_token(selective, tokens=b)
            step_s = sizes["total"] * tp / CHIP_HBM_BYTES_PER_S
            batched[str(b)] = {
                "bytes_per_rank": sizes,
                "experts_path": "selective" if b <= limit else "dense",
                "at_820_gib_s": {"tok_s_per_stream": round(1 / step_s, 2), "tok_s_aggregate": round(b / step_s, 2)},
                "at_published_efficiency": {"tok_s_per_stream": round(efficiency / step_s, 2),
                                            "tok_s_aggregate": round(b * efficiency / step_s, 2)},
            }
    return {
        "kind": "projection (roofline from the config; not a measurement)",
        "tp": tp,
        "quant": quant,
        "attn_quant": attn_quant,
        "max_total": max_total,
        "kv_model": (f"v1 contract at MAX={max_total}: every slot read and written by the blend, read by attention"
                     if contract == "v1" else
                     f"{contract} contract at MAX={max_total}: sliding rings of window + {max(buckets)} slots and global "
                     f"layers' MAX + {max(buckets)}, read once by attention, written by index"
                     + (f"; {kv_slots} KV slots, a decode row reads its own" if contract == "v3" else "")),
        "chip": {"hbm_bytes_per_s": CHIP_HBM_BYTES_PER_S, "bf16_flops": CHIP_BF16_FLOPS},
        "published": {"tok_s_measured": PUBLISHED_TOK_S, "plan": PUBLISHED_PLAN,
                      "bytes_per_token_chip": published_bytes, "efficiency": round(efficiency, 4)},
        "dense": variant("dense"),
        "selective": variant("selective"),
        "selective_max_tokens": limit,
        "prefill_bucket": bucket,
        "prefill_experts": "selective" if bucket <= limit else "dense",
        "tp_split": tp_split_comparison(text_config, tp, quant),
        **({"kv_slots": kv_slots, "decode_batches": batched} if contract == "v3" else {}),
    }


# Roofline by context (issue 34): one stream at 8k, 32k, 64k; four streams with one at 32k.
CONTEXT_SCENARIOS = (("1 stream at 8k", (8192,)), ("1 stream at 32k", (32768,)), ("1 stream at 64k", (65536,)),
                     ("4 streams, one at 32k", (32768, 4096, 4096, 4096)), ("4 streams at 8k", (8192,) * 4))


def context_roofline(text_config, tp: int, quant: str, attn_quant: str, buckets: tuple[int, ...],
                     kv_quant: str = "none", block_size: int = POOL_BLOCK,
                     scenarios: Iterable[tuple[str, tuple[int, ...]]] = CONTEXT_SCENARIOS) -> dict:
    """Per-rank bytes of one decode step and the rates they project to, by the contexts the rows hold.

    v4 (a 64k build, one graph per context bucket): every row reads its sliding rings (window-bounded) and, on global
    layers, the blocks of the call's context bucket. Two ways to run a batch whose rows sit in different buckets:
    one call at the longest row's bucket (short rows read null blocks up to it), or one call per bucket (the weights
    read once per call). Both are projected; `best` is the cheaper. v3 for comparison, a build of the same reach
    (MAX = 64k): every slot MAX + bucket long, read whole whatever its row holds (it fits HBM only for one row)."""
    published = build_model(text_config, Plan(dtype=torch.bfloat16, kv_as_params=True, inplace_kv=False,
                                              **PUBLISHED_PLAN), device="meta")
    efficiency = PUBLISHED_TOK_S * bytes_read_per_token(published)["total"] * PUBLISHED_PLAN["tp"] / CHIP_HBM_BYTES_PER_S
    top = max(POOL_CONTEXTS[:-1])
    contexts = tuple(c for c in POOL_CONTEXTS if c <= top)

    def plan_for(contract: str, rows: int, max_total: int) -> Plan:
        batches = tuple(b for b in (1, 2, 4) if b <= rows)
        return Plan(dtype=torch.bfloat16, kv_as_params=True, inplace_kv=False, tp=tp, quant=quant,
                    attn_quant=attn_quant, experts="selective", max_total=max_total, contract=contract,
                    buckets=tuple(buckets), kv_slots=rows, decode_batches=batches, kv_quant=kv_quant,
                    **({"kv_blocks": 2, "block_size": block_size, "context_buckets": contexts}
                       if contract == "v4" else {}))

    def bucket_of(n: int) -> int:
        return next(c for c in contexts if c >= n)

    weights_model = build_model(text_config, plan_for("v3", 4, 4096), device="meta")

    @functools.cache
    def weights(rows: int) -> int:
        """What a call of `rows` rows reads besides KV (the experts gathered per row)."""
        sizes = bytes_read_per_token(weights_model, tokens=rows)
        return sizes["total"] - sizes["kv_cache"]

    per_row = kv_bytes_per_row(build_model(text_config, plan_for("v4", 4, top), device="meta"))

    def rates(step_bytes: int, rows: int) -> dict:
        step_s = step_bytes * tp / CHIP_HBM_BYTES_PER_S
        return {"bytes_per_rank": step_bytes,
                "at_820_gib_s": {"tok_s_per_stream": round(1 / step_s, 1), "tok_s_aggregate": round(rows / step_s, 1)},
                "at_published_efficiency": {"tok_s_per_stream": round(efficiency / step_s, 1),
                                            "tok_s_aggregate": round(rows * efficiency / step_s, 1)}}

    out: dict = {"kind": "projection (roofline from the config; not a measurement)", "tp": tp, "quant": quant,
                 "attn_quant": attn_quant, "kv_quant": kv_quant, "block_size": block_size,
                 "context_buckets": list(contexts), "published_efficiency": round(efficiency, 4),
                 "kv_per_row": per_row, "scenarios": []}
    for name, lengths in scenarios:
        rows = len(lengths)
        sliding = rows * per_row["sliding"]
        one_call = weights(rows) + sliding + rows * bucket_of(max(lengths)) * per_row["global_per_token"]
        groups: dict[int, int] = {}
        for n in lengths:
            groups[bucket_of(n)] = groups.get(bucket_of(n), 0) + 1
        by_bucket = sum(weights(k) + k * per_row["sliding"] + k * c * per_row["global_per_token"]
                        for c, k in groups.items())
        v3_model = build_model(text_config, plan_for("v3", rows, top), device="meta")  # the same reach: MAX = 64k
        v3 = bytes_read_per_token(v3_model, tokens=rows)["total"]
        best = min(("one_call", one_call), ("by_bucket", by_bucket), key=lambda kv: kv[1])
        out["scenarios"].append({"name": name, "contexts": list(lengths), "one_call": rates(one_call, rows),
                                 "by_bucket": rates(by_bucket, rows), "best": best[0], "v3": rates(v3, rows)})
    return out


def print_context_roofline(report: Mapping, as_json: bool) -> None:
    gb = 1e9
    print(f"PROJECTION (roofline by context, not a measurement): tp={report['tp']}, quant={report['quant']}, "
          f"attention={report['attn_quant']}, kv-quant={report['kv_quant']}; v4 blocks of {report['block_size']}, "
          f"context buckets {report['context_buckets']}; tok/s at the published efficiency "
          f"({100 * report['published_efficiency']:.1f}% of 820 GiB/s)")
    print(f"  {'scenario':<24} {'v4 GB/step':>10} {'per stream':>10} {'aggregate':>9} {'(how)':<10} "
          f"{'v3 GB/step':>10} {'per stream':>10} {'aggregate':>9}")
    for row in report["scenarios"]:
        v4, v3 = row[row["best"]], row["v3"]
        print(f"  {row['name']:<24} {v4['bytes_per_rank'] / gb:10.3f} "
              f"{v4['at_published_efficiency']['tok_s_per_stream']:10.1f} "
              f"{v4['at_published_efficiency']['tok_s_aggregate']:9.1f} {row['best']:<10} "
              f"{v3['bytes_per_rank'] / gb:10.3f} {v3['at_published_efficiency']['tok_s_per_stream']:10.1f} "
              f"{v3['at_published_efficiency']['tok_s_aggregate']:9.1f}")
    if as_json:
        print(json.dumps(report))


def print_roofline(report: Mapping, as_json: bool) -> None:
    gb = 1e9
    print(f"PROJECTION (roofline, not a measurement): bytes read per rank per decoded token, tp={report['tp']}, "
          f"quant={report['quant']}, attention={report['attn_quant']}, {report['kv_model']}")
    print(f"  {'component':<11} {'dense GB':>9} {'selective GB':>13}")
    for comp in (*COMPONENTS, "total"):
        d, s = report["dense"]["bytes_per_rank"][comp], report["selective"]["bytes_per_rank"][comp]
        print(f"  {comp:<11} {d / gb:9.3f} {s / gb:13.3f}")
    pub = report["published"]
    print(f"  published dense build: {pub['tok_s_measured']} tok/s measured on {pub['bytes_per_token_chip'] / gb:.2f} GB "
          f"per token chip-wide = {100 * pub['efficiency']:.1f}% of 820 GiB/s")
    for name in ("dense", "selective"):
        v = report[name]
        print(f"  projected {name:<9}: {v['bytes_per_token_chip'] / gb:6.2f} GB/token chip-wide -> "
              f"{v['projected_tok_s_at_820_gib_s']:6.1f} tok/s at 820 GiB/s, "
              f"{v['projected_tok_s_at_published_efficiency']:5.1f} tok/s at the published efficiency (projection)")
    print(f"  experts path per graph: selective up to {report['selective_max_tokens']} tokens; "
          f"prefill bucket {report['prefill_bucket']} -> {report['prefill_experts']}")
    for name, row in report["tp_split"].items():
        if isinstance(row, dict):
            print(f"  tp split {name:<24} experts/rank/token worst {row['worst'] / gb:.3f} GB, "
                  f"expected {row['expected'] / gb:.3f} GB")
    if "decode_batches" in report:
        print(f"  batched decode over {report['kv_slots']} KV slots (PROJECTION): one step of B rows")
        print(f"  {'B':>3} {'experts':>9} {'GB/rank/step':>13} {'per stream':>11} {'aggregate':>10} "
              f"{'per stream':>11} {'aggregate':>10}   tok/s: at 820 GiB/s | at the published efficiency")
        for b, row in report["decode_batches"].items():
            peak, pub = row["at_820_gib_s"], row["at_published_efficiency"]
            print(f"  {b:>3} {row['experts_path']:>9} {row['bytes_per_rank']['total'] / gb:13.3f} "
                  f"{peak['tok_s_per_stream']:11.1f} {peak['tok_s_aggregate']:10.1f} "
                  f"{pub['tok_s_per_stream']:11.1f} {pub['tok_s_aggregate']:10.1f}")
    if as_json:
        print(json.dumps(report))


# --------------------------------------------------------------------------------------------------------------------
# --bench-experts: the CPU-traced decode step, dense vs selective experts, measured side by side in one run
# --------------------------------------------------------------------------------------------------------------------

# The 26B's routing (128 experts, top-8) and vocabulary at a width a CPU runs: experts are ~85% of a dense decode
# step's multiply-adds here, as they are (~85%) in the 26B.
BENCH_EXPERTS_CONFIG = dict(
    vocab_size=262144,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    sliding_window=128,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=512,
    attention_k_eq_v=True,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


@torch.no_grad()
def randomize(model: RecipeModel, seed: int = 0) -> None:
    """Random weights of a sane scale (unit-variance activations), int8 ones on the full [-127, 127] range."""
    gen = torch.Generator().manual_seed(seed)
    states = set(model.state_names)
    for name, p in model.named_parameters():
        if name in states:
            continue
        prefix, short = name.rsplit(".", 1) if "." in name else ("", name)
        owner = model.get_submodule(prefix)
        if p.dtype == torch.int8:
            p.copy_(torch.randint(-127, 128, p.shape, generator=gen, dtype=torch.int8))
        elif isinstance(owner, (ShardLinear, DenseExperts)) and short in owner.keep_f32:
            fan_in = getattr(owner, short.replace("scale", "qweight")).shape[-1]
            p.fill_(1.0 / (73.3 * fan_in**0.5))  # uniform int8 has std ~73.3: rows of std 1/sqrt(fan_in)
        elif p.is_floating_point() and p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        elif p.is_floating_point():
            p.fill_(1.0)  # norms, layer scalars, router scales
        else:
            p.zero_()  # DenseExperts.rank: rank 0 of 1


def bench_experts(
    quant: str, steps: int, max_total: int = 512, bucket: int = 64, seed: int = 0,
    config: Mapping = BENCH_EXPERTS_CONFIG,
) -> dict:
    """Trace the same random model twice (dense / selective experts), prefill both, then time decode steps.

    The two graphs run alternately on the same inputs, so load on a shared machine hits both alike; the median
    step is reported. Their logits are compared too: a fast wrong graph would be no result.
    """
    import statistics
    import time

    cfg = text_config_from_dict(config)
    models = {}
    for experts in EXPERT_MODES:
        models[experts] = build_model(cfg, Plan(quant=quant, max_total=max_total, experts=experts))
    randomize(models["dense"], seed)
    shared = {k: v for k, v in models["dense"].state_dict().items() if not k.endswith("experts.rank")}
    missing, unexpected = models["selective"].load_state_dict(shared, strict=False)
    assert not unexpected and not [m for m in missing if m not in set(models["selective"].state_names)], missing
    graphs = {name: trace_cpu(model, cfg, bucket) for name, model in models.items()}

    gen = torch.Generator().manual_seed(seed + 1)
    embeds = torch.randn(1, bucket + steps + 2, cfg.hidden_size, generator=gen)  # [1, T_all, H]
    times: dict[str, list[float]] = {name: [] for name in graphs}
    worst = 0.0
    with torch.no_grad():
        prefill = contract_inputs(embeds[:, :bucket], torch.arange(bucket)[None], max_total, cfg.sliding_window)
        for graph in graphs.values():
            graph(*prefill)
        for step in range(steps + 2):  # the first two steps warm up (allocator, first-call paths) and are not timed
            pos = bucket + step
            inputs = contract_inputs(embeds[:, pos : pos + 1], torch.tensor([[pos]]), max_total, cfg.sliding_window)
            logits = {}
            for name, graph in graphs.items():
                start = time.perf_counter()
                logits[name] = graph(*inputs)[0]
                if step >= 2:
                    times[name].append(time.perf_counter() - start)
            worst = max(worst, float((logits["dense"] - logits["selective"]).abs().max()))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "kind": "measurement (CPU, this machine; the decode step of the CPU-traced graph)",
        "config": {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                          "num_experts", "top_k_experts", "moe_intermediate_size")},
        "layer_types": {"sliding": cfg.layer_types.count("sliding_attention"),
                        "global": cfg.layer_types.count("full_attention")},
        "quant": quant,
        "max_total": max_total,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "dense_ms": round(1e3 * medians["dense"], 2),
        "selective_ms": round(1e3 * medians["selective"], 2),
        "dense_ms_all": [round(1e3 * t, 2) for t in times["dense"]],
        "selective_ms_all": [round(1e3 * t, 2) for t in times["selective"]],
        "speedup": round(medians["dense"] / medians["selective"], 2),
        "max_abs_logit_diff": worst,
    }


def keep_freed_memory() -> str:
    """glibc returns blocks of 32 MB and more to the OS on free, so a graph whose temporaries pass that size (the
    int8 lm_head widened per call, a 4-row expert gather) pays fresh page faults on every call, in proportion to the
    bytes, whatever the rows. A caching allocator (jemalloc, tcmalloc: PyTorch's CPU inference advice) keeps them;
    raising glibc's mmap and trim thresholds does the same in-process. Returns what was set, for the report."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return "default (no libc found)"
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    return "glibc mmap and trim thresholds 1 GiB (freed temporaries reused)" if ok else "default (mallopt refused)"


def bench_batched(quant: str, steps: int, batches: tuple[int, ...] = (1, 2, 4), max_total: int = 512, bucket: int = 64,
                  seed: int = 0, config: Mapping = BENCH_EXPERTS_CONFIG) -> dict:
    """One v3 trace (selective experts, S = max(batches) slots), every slot prefilled; then each timed step decodes the
    same rows as one call of every batch size (B = 4: slots 0..3; B = 2: slots 0, 1; B = 1: each slot alone), on the
    same inputs at the same positions, so a shared machine's load hits every size alike and every row's logits can
    be compared with its B = 1 run. The batch sizes run in turn within a step; medians are reported.
    """
    import statistics
    import time

    allocator = keep_freed_memory()
    cfg = text_config_from_dict(config)
    slots = max(batches)
    plan = Plan(quant=quant, max_total=max_total, experts="selective", contract="v3", buckets=(bucket,),
                kv_slots=slots, decode_batches=tuple(batches))
    model = build_model(cfg, plan)
    randomize(model, seed)
    graph = trace_cpu(model, cfg, bucket)
    gen = torch.Generator().manual_seed(seed + 1)
    times: dict[int, list[float]] = {b: [] for b in batches}
    worst = {b: 0.0 for b in batches}
    with torch.no_grad():
        for slot in range(slots):
            prompt = torch.randn(1, bucket, cfg.hidden_size, generator=gen)  # [1, bucket, H]
            graph(prompt, torch.arange(bucket)[None], torch.tensor([slot]))
        for step in range(steps + 2):  # the first two steps warm up (allocator, first-call paths) and are not timed
            embeds = torch.randn(slots, 1, cfg.hidden_size, generator=gen)  # [S, 1, H]: one new token per slot
            positions = torch.full((slots, 1), bucket + step, dtype=torch.int64)  # [S, 1]
            logits: dict[int, torch.Tensor] = {}
            for b in sorted(batches, reverse=True):
                # B = 1 runs every slot alone (the reference rows); a larger B runs slots 0..B-1 in one call.
                runs = [list(range(b))] if b > 1 else [[r] for r in range(slots)]
                rows = []
                for ids in runs:
                    start = time.perf_counter()
                    out = graph(embeds[ids], positions[ids], torch.tensor(ids))[0]  # [B, 1, V]
                    elapsed = time.perf_counter() - start
                    if step >= 2 and (b > 1 or ids == [0]):
                        times[b].append(elapsed)
                    rows.append(out[:, 0])
                logits[b] = torch.cat(rows)  # [B or S, V]
            for b in batches:  # B = 1 is the reference itself (0 by construction)
                worst[b] = max(worst[b], float((logits[b][:b] - logits[1][:b]).abs().max()))
    medians = {b: statistics.median(times[b]) for b in batches}
    return {
        "kind": "measurement (CPU, this machine; decode steps of one CPU-traced v3 graph)",
        "allocator": allocator,
        "config": {k: config[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                          "num_experts", "top_k_experts", "moe_intermediate_size")},
        "quant": quant,
        "max_total": max_total,
        "kv_slots": slots,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "decode_experts": {str(b): path for b, path in decode_experts(plan, cfg).items()},
        "batches": {str(b): {"step_ms": round(1e3 * medians[b], 2),
                             "tok_s_per_stream": round(1 / medians[b], 2),
                             "tok_s_aggregate": round(b / medians[b], 2),
                             "max_abs_logit_diff_vs_b1": worst[b]} for b in batches},
        "aggregate_speedup_vs_b1": {str(b): round(b * medians[1] / medians[b], 2) for b in batches},
    }


def print_bench_batched(result: Mapping, as_json: bool) -> None:
    c = result["config"]
    print(f"MEASURED on this CPU ({result['threads']} threads), batched decode of one traced v3 graph "
          f"({result['kv_slots']} KV slots), quant={result['quant']}: vocab {c['vocab_size']}, hidden "
          f"{c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_experts']} experts of "
          f"{c['moe_intermediate_size']}, top-{c['top_k_experts']}")
    print(f"  {'B':>3} {'experts':>9} {'ms/step':>9} {'tok/s/stream':>13} {'tok/s aggregate':>16} {'vs B=1':>7} "
          f"{'max |logit - B=1|':>18}")
    for b, row in result["batches"].items():
        print(f"  {b:>3} {result['decode_experts'][b]:>9} {row['step_ms']:9.2f} {row['tok_s_per_stream']:13.2f} "
              f"{row['tok_s_aggregate']:16.2f} {result['aggregate_speedup_vs_b1'][b]:6.2f}x "
              f"{row['max_abs_logit_diff_vs_b1']:18.2e}")
    if as_json:
        print(json.dumps(result))


def print_bench_experts(result: Mapping, as_json: bool) -> None:
    c = result["config"]
    print(f"MEASURED on this CPU ({result['threads']} threads), decode step of the traced graph, quant={result['quant']}: "
          f"vocab {c['vocab_size']}, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
          f"{c['num_experts']} experts of {c['moe_intermediate_size']}, top-{c['top_k_experts']}")
    print(f"  dense     {result['dense_ms']:9.2f} ms/step (median of {result['steps']})")
    print(f"  selective {result['selective_ms']:9.2f} ms/step")
    print(f"  speedup   {result['speedup']:9.2f}x   (max |dense - selective| logit {result['max_abs_logit_diff']:.2e})")
    if as_json:
        print(json.dumps(result))


# --------------------------------------------------------------------------------------------------------------------
# Artifacts shared by both targets
# --------------------------------------------------------------------------------------------------------------------


def write_host_artifacts(checkpoint: Path, reader: CheckpointReader, out: Path) -> None:
    cfg_dir = out / "cfg"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    for name in CFG_FILES:
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, cfg_dir / name)
    table = reader.get("embed_tokens.weight").to(torch.bfloat16).contiguous()  # [V, H]; clone off the mmap
    torch.save(table.clone(), out / "embed_tokens.pt")


def write_graph_json(
    out: Path,
    *,
    cfg,
    max_total: int,
    bucket: int,
    tp: int,
    graph_file: str,
    quant: str,
    plan: Plan | None = None,
    weight_files: list[str] | None = None,
) -> dict:
    """graph.json: v1's record as published; v2 adds every shape the host needs (see CONTRACT_V2)."""
    if plan is not None and plan.pooled:
        record = v4_record(cfg, plan, max_total=max_total, tp=tp, graph_file=graph_file, quant=quant,
                           weight_files=weight_files)
    elif plan is not None and plan.contract == "v3":
        record = v3_record(cfg, plan, max_total=max_total, tp=tp, graph_file=graph_file, quant=quant,
                           weight_files=weight_files)
    elif plan is None or plan.contract == "v1":
        record = {
            "contract": CONTRACT,
            "max_total": max_total,
            "prefill_bucket": bucket,
            "input_dtype": "float32",
            "tp": tp,
            "softcap_in_graph": False,
            "sliding_window": int(cfg.sliding_window),
            "graph_file": graph_file,
            "quant": quant,
        }
    else:
        window = int(cfg.sliding_window)
        record = {
            "contract": CONTRACT_V2,
            "max_total": max_total,
            "prefill_buckets": sorted(plan.buckets),
            "prefill_bucket": max(plan.buckets),  # the most tokens one call takes
            "input_dtype": "float32",
            "inputs": {"inputs_embeds": ["float32", [1, "T", int(cfg.hidden_size)]], "position_ids": ["int64", [1, "T"]]},
            "outputs": {"logits": ["float32", [1, "T", int(cfg.vocab_size)]]},
            "tp": tp,
            "softcap_in_graph": False,
            "sliding_window": window,
            "kv_slots": {"sliding_attention": plan.ring_slots(window), "full_attention": plan.ring_slots(None)},
            "graph_file": graph_file,
            "quant": quant,
            "weights": "separate" if weight_files else "inside",
            "weight_files": list(weight_files or []),
        }
    if plan is not None and plan.block_ids:
        record["inputs"]["block_ids"] = ["int64", [1, "T"]]
        record["block_ids"] = {
            "graphs": "prefill",  # decode takes no block ids: a decode step never holds an image token
            "meaning": "0 = text; the tokens of one image share one id > 0 (ids are per call)",
            "bidirectional_layers": sorted({"sliding_attention"} & (
                {"sliding_attention"} if cfg.use_bidirectional_attention == "vision" else set())),
        }
    if plan is not None and plan.ringed:
        record.update(logits_record(plan))
        if plan.last_logits:
            record["inputs"]["last_index"] = ["int64", [1]]  # after block_ids, as the graphs take them
    (out / "graph.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def logits_record(plan: Plan) -> dict:
    """graph.json's record of which rows the prefill graphs return (issue 34). Absent in older builds: every row,
    no score graph, untiled attention (the server keeps serving those as it always did)."""
    record: dict = {"prefill_logits": plan.prefill_logits, "query_tile": plan.query_tile,
                    "expert_group": plan.expert_group}
    if plan.last_logits:
        record["score_buckets"] = list(plan.score_buckets)
        record["last_index"] = {
            "graphs": "prefill",
            "meaning": "the chunk's last real row (0-based, pads follow it): the prefill graph returns logits "
                       "[1, 1, V] of that row; the score graphs take no last_index and return every row [1, T, V]",
        }
    return record


def v3_record(cfg, plan: Plan, *, max_total: int, tp: int, graph_file: str, quant: str,
              weight_files: list[str] | None) -> dict:
    """graph.json of a v3 build: v2's record with S KV slots and the decode graphs. Every shape the host sends or
    the device holds is declared: the inputs per graph kind, each layer kind's rank-local cache [S, kvh, R, D]."""
    window = int(cfg.sliding_window)
    template = build_model(cfg, plan, device="meta")
    caches = {}
    for idx, layer_type in enumerate(template.layer_types):
        caches.setdefault(layer_type, list(template.layers[idx].self_attn.k_cache.shape))
    h, v = int(cfg.hidden_size), int(cfg.vocab_size)
    return {
        "contract": CONTRACT_V3,
        "max_total": max_total,
        "prefill_buckets": sorted(plan.buckets),
        "prefill_bucket": max(plan.buckets),
        "kv_slots": plan.kv_slots,
        "decode_batches": list(plan.decode_batches),
        "input_dtype": "float32",
        "inputs": {"inputs_embeds": ["float32", ["B", "T", h]], "position_ids": ["int64", ["B", "T"]],
                   "slot_ids": ["int64", ["B"]]},
        "outputs": {"logits": ["float32", ["B", "T", v]]},
        "graphs": {"prefill": {"B": [1], "T": sorted(plan.buckets)}, "decode": {"B": list(plan.decode_batches), "T": [1]},
                   **({"score": {"B": [1], "T": list(plan.score_buckets)}} if plan.last_logits else {})},
        "decode_experts": {str(b): path for b, path in decode_experts(plan, cfg).items()},
        "tp": tp,
        "softcap_in_graph": False,
        "sliding_window": window,
        "ring_slots": {"sliding_attention": plan.ring_slots(window), "full_attention": plan.ring_slots(None)},
        "kv_quant": plan.kv_quant,
        "kv_cache": {"layout": "[slot, kv_heads_per_rank, ring, head_dim], K and V per layer"
                     + (" (int8, with f32 scales [slot, kv_heads_per_rank, ring, 1])" if plan.kv_int8 else ""),
                     **caches},
        "pad_rows": "spare rows of a decode batch (B rounded up to a compiled size) write zeros into a real row's "
                    "own slot, ahead of its position, where its next call writes before any query reads",
        "graph_file": graph_file,
        "quant": quant,
        "weights": "separate" if weight_files else "inside",
        "weight_files": list(weight_files or []),
    }


def v4_record(cfg, plan: Plan, *, max_total: int, tp: int, graph_file: str, quant: str,
              weight_files: list[str] | None) -> dict:
    """graph.json of a v4 build: v3's record, the global layers' block pool and the graphs per context bucket."""
    record = v3_record(cfg, plan, max_total=max_total, tp=tp, graph_file=graph_file, quant=quant,
                       weight_files=weight_files)
    contexts = list(plan.context_buckets)
    record.update({
        "contract": CONTRACT_V4,
        "kv_blocks": plan.kv_blocks,
        "block_size": plan.block_size,
        "context_buckets": contexts,
        "null_block": 0,
        "inputs": {**record["inputs"], "block_table": ["int32", ["B", "NBc"]]},
        "graphs": {"prefill": {"B": [1], "T": sorted(plan.buckets), "NBc": [c // plan.block_size for c in contexts]},
                   "decode": {"B": list(plan.decode_batches), "T": [1],
                              "NBc": [c // plan.block_size for c in contexts]},
                   # one score graph, at the largest context (Plan.score_context): the host pads its table
                   **({"score": {"B": [1], "T": list(plan.score_buckets),
                                 "NBc": [plan.score_context // plan.block_size]}} if plan.last_logits else {})},
        "ring_slots": {"sliding_attention": plan.ring_slots(int(cfg.sliding_window))},
    })
    record["kv_cache"]["layout"] = (
        "sliding layers [slot, kv_heads_per_rank, ring, head_dim]; global layers a pool [block, kv_heads_per_rank, "
        "block_size, head_dim] read through block_table (row b's position p: block_table[b, p // block_size]), "
        "K and V per layer" + (" (int8, with f32 scales of width 1)" if plan.kv_int8 else ""))
    record["pad_rows"] = (record["pad_rows"] + "; positions past a row's blocks (table entry 0) or past the table "
                          "write into block 0, the null block no row owns")
    return record


# --------------------------------------------------------------------------------------------------------------------
# --target cpu: the same contract as one TorchScript file
# --------------------------------------------------------------------------------------------------------------------


class ContractDispatch(nn.Module):
    """Routes by T like ModelBuilder does: T == bucket -> prefill graph, T == 1 -> decode graph, else an error."""

    def __init__(self, core: nn.Module, bucket: int) -> None:
        super().__init__()
        self.core = core
        self.bucket = bucket

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        onehot: torch.Tensor,
        full_mask: torch.Tensor,
        sliding_mask: torch.Tensor,
    ):
        t = inputs_embeds.size(1)
        if t == 1:
            return self.core.decode(inputs_embeds, position_ids, onehot, full_mask, sliding_mask)
        if t == self.bucket:
            return self.core.prefill(inputs_embeds, position_ids, onehot, full_mask, sliding_mask)
        raise RuntimeError("no graph for this input shape: T must be 1 (decode) or the prefill bucket")


class ContractDispatchV2(nn.Module):
    """v2 routing by T: 1 -> decode, one of the buckets -> prefill, else an error (ModelBuilder refuses it too)."""

    def __init__(self, core: nn.Module, buckets: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor):
        t = inputs_embeds.size(1)
        if t == 1:
            return self.core.decode(inputs_embeds, position_ids)
        if t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids)
        raise RuntimeError("no graph for this input shape: T must be 1 (decode) or one of the prefill buckets")


class ContractDispatchV3(nn.Module):
    """v3 routing by (B, T): T == 1 and B a decode batch -> decode (the selective or the dense trace, by B), B == 1
    and T a bucket -> prefill into the slot named by slot_ids, else an error."""

    def __init__(self, core: nn.Module, buckets: list[int], decode_batches: list[int], selective_rows: int) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.decode_batches = decode_batches
        self.selective_rows = selective_rows  # decode batches up to this many rows hold the selective experts path

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, slot_ids: torch.Tensor):
        b = inputs_embeds.size(0)
        t = inputs_embeds.size(1)
        if t == 1 and b in self.decode_batches:
            if b <= self.selective_rows:
                return self.core.decode(inputs_embeds, position_ids, slot_ids)
            return self.core.decode_dense(inputs_embeds, position_ids, slot_ids)
        if b == 1 and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, slot_ids)
        raise RuntimeError("no graph for this input shape: [B, 1] with B a decode batch, or [1, T] with T a bucket")


class ContractDispatchV4(nn.Module):
    """v4 routing by (B, T, NBc): as v3, and the block table's width must be one of the context buckets (in blocks);
    ModelBuilder keys one graph per (bucket or decode batch, context bucket)."""

    def __init__(self, core: nn.Module, buckets: list[int], decode_batches: list[int], selective_rows: int,
                 context_blocks: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.decode_batches = decode_batches
        self.selective_rows = selective_rows
        self.context_blocks = context_blocks

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, slot_ids: torch.Tensor,
                block_table: torch.Tensor):
        b = inputs_embeds.size(0)
        t = inputs_embeds.size(1)
        if block_table.size(0) != b or block_table.size(1) not in self.context_blocks:
            raise RuntimeError("no graph for this block table: [B, NBc] with NBc a context bucket in blocks")
        if t == 1 and b in self.decode_batches:
            if b <= self.selective_rows:
                return self.core.decode(inputs_embeds, position_ids, slot_ids, block_table)
            return self.core.decode_dense(inputs_embeds, position_ids, slot_ids, block_table)
        if b == 1 and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, slot_ids, block_table)
        raise RuntimeError("no graph for this input shape: [B, 1] with B a decode batch, or [1, T] with T a bucket")


class ContractDispatchV4Last(nn.Module):
    """ContractDispatchV4 of a last-row build: prefill takes last_index [1] after the block table; without it, T a
    score bucket and a table as wide as the score context (`score_blocks`) runs the score graph (every row)."""

    def __init__(self, core: nn.Module, buckets: list[int], decode_batches: list[int], selective_rows: int,
                 context_blocks: list[int], score_buckets: list[int], score_blocks: int) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.decode_batches = decode_batches
        self.selective_rows = selective_rows
        self.context_blocks = context_blocks
        self.score_buckets = score_buckets
        self.score_blocks = score_blocks

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, slot_ids: torch.Tensor,
                block_table: torch.Tensor, last_index: torch.Tensor | None = None):
        b = inputs_embeds.size(0)
        t = inputs_embeds.size(1)
        if block_table.size(0) != b or block_table.size(1) not in self.context_blocks:
            raise RuntimeError("no graph for this block table: [B, NBc] with NBc a context bucket in blocks")
        if t == 1 and b in self.decode_batches:
            if b <= self.selective_rows:
                return self.core.decode(inputs_embeds, position_ids, slot_ids, block_table)
            return self.core.decode_dense(inputs_embeds, position_ids, slot_ids, block_table)
        if b == 1 and last_index is not None and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, slot_ids, block_table, last_index)
        if b == 1 and last_index is None and t in self.score_buckets and block_table.size(1) == self.score_blocks:
            return self.core.score(inputs_embeds, position_ids, slot_ids, block_table)
        raise RuntimeError("no graph for this input shape: [B, 1] with B a decode batch, [1, T] with T a bucket and "
                           "last_index, or [1, T] with T a score bucket at the score context's width")


class ContractDispatchV2Blocks(nn.Module):
    """ContractDispatchV2 of a block-aware build: prefill takes block_ids [1, T] (absent: all text), decode does not
    (a decode step never holds an image token)."""

    def __init__(self, core: nn.Module, buckets: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                block_ids: torch.Tensor | None = None):
        t = inputs_embeds.size(1)
        if t == 1:
            return self.core.decode(inputs_embeds, position_ids)
        if t in self.buckets:
            if block_ids is None:
                block_ids = torch.zeros_like(position_ids)
            return self.core.prefill(inputs_embeds, position_ids, block_ids)
        raise RuntimeError("no graph for this input shape: T must be 1 (decode) or one of the prefill buckets")


class ContractDispatchV3Blocks(nn.Module):
    """ContractDispatchV3 of a block-aware build: prefill takes block_ids [1, T] after slot_ids (absent: all text)."""

    def __init__(self, core: nn.Module, buckets: list[int], decode_batches: list[int], selective_rows: int) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.decode_batches = decode_batches
        self.selective_rows = selective_rows

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, slot_ids: torch.Tensor,
                block_ids: torch.Tensor | None = None):
        b = inputs_embeds.size(0)
        t = inputs_embeds.size(1)
        if t == 1 and b in self.decode_batches:
            if b <= self.selective_rows:
                return self.core.decode(inputs_embeds, position_ids, slot_ids)
            return self.core.decode_dense(inputs_embeds, position_ids, slot_ids)
        if b == 1 and t in self.buckets:
            if block_ids is None:
                block_ids = torch.zeros_like(position_ids)
            return self.core.prefill(inputs_embeds, position_ids, slot_ids, block_ids)
        raise RuntimeError("no graph for this input shape: [B, 1] with B a decode batch, or [1, T] with T a bucket")


class ContractDispatchV2Last(nn.Module):
    """v2 routing of a last-row build (Plan.last_logits): T == 1 -> decode; T a bucket with last_index [1] -> that
    bucket's prefill graph (logits [1, 1, V] of row last_index); T a score bucket without it -> the score graph
    (every row's logits); else an error, as ModelBuilder refuses a shape it has no graph for."""

    def __init__(self, core: nn.Module, buckets: list[int], score_buckets: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.score_buckets = score_buckets

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                last_index: torch.Tensor | None = None):
        t = inputs_embeds.size(1)
        if t == 1:
            return self.core.decode(inputs_embeds, position_ids)
        if last_index is not None and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, last_index)
        if last_index is None and t in self.score_buckets:
            return self.core.score(inputs_embeds, position_ids)
        raise RuntimeError("no graph for this input shape: T must be 1 (decode), a prefill bucket with last_index, "
                           "or a score bucket without it")


class ContractDispatchV2LastBlocks(nn.Module):
    """ContractDispatchV2Last of a block-aware build: prefill and score take block_ids [1, T] before last_index."""

    def __init__(self, core: nn.Module, buckets: list[int], score_buckets: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.score_buckets = score_buckets

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                block_ids: torch.Tensor | None = None, last_index: torch.Tensor | None = None):
        t = inputs_embeds.size(1)
        if t == 1:
            return self.core.decode(inputs_embeds, position_ids)
        if block_ids is None:
            block_ids = torch.zeros_like(position_ids)
        if last_index is not None and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, block_ids, last_index)
        if last_index is None and t in self.score_buckets:
            return self.core.score(inputs_embeds, position_ids, block_ids)
        raise RuntimeError("no graph for this input shape: T must be 1 (decode), a prefill bucket with last_index, "
                           "or a score bucket without it")


class ContractDispatchV3Last(nn.Module):
    """ContractDispatchV3 of a last-row build: prefill takes last_index [1] after slot_ids; the score graph (T a
    score bucket, no last_index) returns every row."""

    def __init__(self, core: nn.Module, buckets: list[int], decode_batches: list[int], selective_rows: int,
                 score_buckets: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.decode_batches = decode_batches
        self.selective_rows = selective_rows
        self.score_buckets = score_buckets

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, slot_ids: torch.Tensor,
                last_index: torch.Tensor | None = None):
        b = inputs_embeds.size(0)
        t = inputs_embeds.size(1)
        if t == 1 and b in self.decode_batches:
            if b <= self.selective_rows:
                return self.core.decode(inputs_embeds, position_ids, slot_ids)
            return self.core.decode_dense(inputs_embeds, position_ids, slot_ids)
        if b == 1 and last_index is not None and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, slot_ids, last_index)
        if b == 1 and last_index is None and t in self.score_buckets:
            return self.core.score(inputs_embeds, position_ids, slot_ids)
        raise RuntimeError("no graph for this input shape: [B, 1] with B a decode batch, [1, T] with T a bucket and "
                           "last_index, or [1, T] with T a score bucket")


class ContractDispatchV3LastBlocks(nn.Module):
    """ContractDispatchV3Last of a block-aware build: block_ids [1, T] after slot_ids, then last_index."""

    def __init__(self, core: nn.Module, buckets: list[int], decode_batches: list[int], selective_rows: int,
                 score_buckets: list[int]) -> None:
        super().__init__()
        self.core = core
        self.buckets = buckets
        self.decode_batches = decode_batches
        self.selective_rows = selective_rows
        self.score_buckets = score_buckets

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, slot_ids: torch.Tensor,
                block_ids: torch.Tensor | None = None, last_index: torch.Tensor | None = None):
        b = inputs_embeds.size(0)
        t = inputs_embeds.size(1)
        if t == 1 and b in self.decode_batches:
            if b <= self.selective_rows:
                return self.core.decode(inputs_embeds, position_ids, slot_ids)
            return self.core.decode_dense(inputs_embeds, position_ids, slot_ids)
        if block_ids is None:
            block_ids = torch.zeros_like(position_ids)
        if b == 1 and last_index is not None and t in self.buckets:
            return self.core.prefill(inputs_embeds, position_ids, slot_ids, block_ids, last_index)
        if b == 1 and last_index is None and t in self.score_buckets:
            return self.core.score(inputs_embeds, position_ids, slot_ids, block_ids)
        raise RuntimeError("no graph for this input shape: [B, 1] with B a decode batch, [1, T] with T a bucket and "
                           "last_index, or [1, T] with T a score bucket")


def trace_cpu(model: RecipeModel, cfg, bucket: int) -> torch.jit.ScriptModule:
    """prefill and decode (T=1) traced into one module over one set of KV buffers.

    v1 traces prefill at its bucket. v2 traces it once at the smallest bucket and serves every bucket with it: the
    traced ops take their sizes from the inputs (tests/test_recipe_v2.py runs each bucket against the eager module).
    """
    max_total, contract = model.plan.max_total, model.plan.contract
    first = min(model.plan.buckets) if model.plan.ringed else bucket
    plan = model.plan
    # v4: traced at the smallest context bucket; every size is read from the inputs, so it serves them all
    # (tests/test_recipe_v4.py runs each bucket against the eager module and transformers).
    context = min(plan.context_buckets) if plan.pooled else max_total
    pool = (plan.kv_blocks, plan.block_size) if plan.pooled else None
    last = plan.last_logits

    def example(t: int, start: int, batch: int = 1, with_last: bool = False) -> tuple[torch.Tensor, ...]:
        return example_inputs(cfg, t, min(start, context - t) if plan.pooled else start, context, contract, batch,
                              blocks=plan.block_ids and t > 1, blocks_of=pool, last=with_last)

    inputs = {"prefill": example(first, 0, with_last=last), "decode": example(1, first)}
    if last:  # the score graph: the prefill's inputs without last_index, every row's logits
        inputs["score"] = example(first, 0)
    if plan.slotted:
        # v3: as v2's prefill, one decode trace serves every batch size (shapes come from the inputs), except that the
        # experts path is frozen by the traced batch: decode is traced at the smallest batch, decode_dense at the
        # smallest one past the selective limit (if none is, it is never called and traced at the smallest too).
        paths = decode_experts(model.plan, cfg)
        selective = [b for b, path in paths.items() if path == "selective"]
        dense = [b for b, path in paths.items() if path == "dense"] or [min(paths)]
        inputs["decode"] = example(1, first, min(selective or dense))
        inputs["decode_dense"] = example(1, first, min(dense))
    # TorchScript is the contract (torch.jit.load on the server, as for Neuron's ModelBuilder output), so its
    # deprecation notices in recent torch are noise here.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        # check_trace would re-run each method and see different KV buffers (the graph mutates them by design).
        traced = torch.jit.trace_module(model, inputs, check_trace=False)
        for name, buf in traced.named_buffers():
            if name in set(model.state_names):
                buf.zero_()  # tracing ran the graphs once; ship empty caches
        model.reset_states()
        blocks = model.plan.block_ids
        if plan.pooled:
            rows = max(selective) if selective else 0
            contexts = [c // plan.block_size for c in plan.context_buckets]
            if last:
                return torch.jit.script(ContractDispatchV4Last(
                    traced, sorted(plan.buckets), list(plan.decode_batches), rows, contexts,
                    list(plan.score_buckets), plan.score_context // plan.block_size))
            return torch.jit.script(ContractDispatchV4(traced, sorted(plan.buckets), list(plan.decode_batches), rows,
                                                       contexts))
        scores = list(model.plan.score_buckets)
        if contract == "v3":
            rows = max(selective) if selective else 0
            if last:
                last_v3 = ContractDispatchV3LastBlocks if blocks else ContractDispatchV3Last
                return torch.jit.script(last_v3(traced, sorted(model.plan.buckets), list(model.plan.decode_batches),
                                                rows, scores))
            dispatch_v3 = ContractDispatchV3Blocks if blocks else ContractDispatchV3
            return torch.jit.script(dispatch_v3(traced, sorted(model.plan.buckets), list(model.plan.decode_batches),
                                                rows))
        if contract == "v2":
            if last:
                last_v2 = ContractDispatchV2LastBlocks if blocks else ContractDispatchV2Last
                return torch.jit.script(last_v2(traced, sorted(model.plan.buckets), scores))
            dispatch_v2 = ContractDispatchV2Blocks if blocks else ContractDispatchV2
            return torch.jit.script(dispatch_v2(traced, sorted(model.plan.buckets)))
        return torch.jit.script(ContractDispatch(traced, bucket))


def strip_weights(scripted: torch.jit.ScriptModule, model: RecipeModel, prefix: str = "core.") -> None:
    """--weights separate: leave the traced graph without weight data (KV states stay: they are zeros, not weights).

    The traced ops read parameters by attribute, so the server puts the per-rank tensors back under the same names.
    """
    states = set(model.state_names)
    for name, _ in model.named_parameters():
        if name in states:
            continue
        owner_path, leaf = (prefix + name).rsplit(".", 1)
        owner = functools.reduce(getattr, owner_path.split("."), scripted)  # ScriptModules lack get_submodule
        setattr(owner, leaf, torch.empty(0, dtype=getattr(owner, leaf).dtype))


def write_rank_weights(out: Path, model: RecipeModel, full: Mapping[str, torch.Tensor]) -> list[str]:
    """One safetensors file per rank, named and keyed as NxD's ModelBuilder.shard_checkpoint writes them."""
    from safetensors.torch import save_file

    files = []
    for rank in range(model.plan.tp):
        rel = RANK_WEIGHTS.format(rank=rank)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(shard_state_dict(model, full, rank, model.plan.tp), str(out / rel))
        files.append(rel)
    return files


def plan_from_args(args: argparse.Namespace, **overrides: object) -> Plan:
    values: dict = dict(tp=args.tp, quant=args.quant, max_total=args.max_total, contract=args.contract,
                        buckets=tuple(args.prefill_buckets), experts=args.experts, attn_quant=args.attn_quant,
                        kv_slots=args.kv_slots, decode_batches=tuple(args.decode_batches), kv_quant=args.kv_quant,
                        block_ids=bool(args.vision), vision_tp=args.vision_tp, kv_blocks=args.kv_blocks,
                        block_size=args.block_size, context_buckets=tuple(args.context_buckets),
                        prefill_logits=args.prefill_logits, query_tile=args.query_tile,
                        expert_group=args.expert_group)
    values.update(overrides)
    return Plan(**values)


def build_cpu(args: argparse.Namespace, cfg, reader: CheckpointReader, out: Path) -> dict:
    dtype = DTYPES[args.dtype or "float32"]
    if args.tp != 1:
        print(f"note: --target cpu runs on one rank; tp {args.tp} -> 1 (the split is exercised by the tests)")
    plan = plan_from_args(args, tp=1, dtype=dtype)
    model = build_model(cfg, plan)
    full = convert_checkpoint(reader, model)
    load_rank(model, full)

    # Run it once before tracing: a broken checkpoint shows up as non-finite logits, not a silent artifact.
    with torch.no_grad():
        graphs = all_graphs(plan)
        logits = model(*graph_example(cfg, plan, next(g for g in graphs if g[1] > 1)))[0]
        step = model(*graph_example(cfg, plan, next(g for g in graphs if g[1] == 1)))[0]
    if not (torch.isfinite(logits).all() and torch.isfinite(step).all()):
        raise RuntimeError("non-finite logits from the CPU module; refusing to write the artifact")
    model.reset_states()

    scripted = trace_cpu(model, cfg, args.prefill_bucket)
    weight_files = None
    if args.weights == "separate":
        weight_files = write_rank_weights(out, model, full)
        strip_weights(scripted, model)
    del full
    torch.jit.save(scripted, str(out / "model.pt"))
    return write_graph_json(
        out,
        cfg=cfg,
        max_total=args.max_total,
        bucket=args.prefill_bucket,
        tp=1,
        graph_file="model.pt",
        quant=args.quant,
        plan=plan,
        weight_files=weight_files,
    )


# --------------------------------------------------------------------------------------------------------------------
# --target neuron: the thin NxD layer
# --------------------------------------------------------------------------------------------------------------------


# Why the compiler flags are NxD's own (``--compiler-args`` unset): ModelBuilder then compiles with
# ``--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1`` (NxD appends ``--auto-cast=none``
# to any flags lacking ``--auto-cast`` and warns that other values may lower accuracy). The published build passed
# ``--model-type transformer --auto-cast all --auto-cast-type bf16`` and swapped in an explicit tanh-GELU module.
# ``--model-type transformer`` is in NxD's default already. ``--auto-cast all`` casts every f32 operation to bf16:
# the way to bf16 for a module built in f32, which this one is not (``_cast_floats`` makes it bf16), and it would
# undo the f32 kept on purpose: the int8 scales (``keep_f32``), the masks (finfo(f32).min is -inf in bf16), HF's
# f32 RMSNorm and softmax, the f32 logits. The activation stays transformers' own ``gelu_pytorch_tanh``:
# ``F.gelu(approximate="tanh")``, which torch-xla lowers natively (pytorch/xla #3039, #3531) to the same
# 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) the explicit module spells out, so the HLO is the same math. To
# reproduce the published build exactly, pass its flags with ``--compiler-args``.
NEURON_NOTES = """\
--target neuron:
  Runs on a Neuron host (trn1/inf2 with the Neuron SDK): trace(initialize_model_weights=True) shards the weights
  and loads them onto the NeuronCores, so the compile host needs Neuron devices with HBM for one rank's shard
  each, not only host RAM. ModelBuilder writes the per-rank sharded safetensors (~26.7 GB for the 26B int8
  build) and the NEFFs to OUT/compiler_workdir; the weights also live inside OUT/sqz_neff.pt, so the work
  directory is deleted once the sharded checkpoint has been checked (--keep-compiler-workdir keeps it; move it
  out of OUT before publishing OUT). The build fails if a tensor-parallel weight was left unsharded.
  On the device the graph returns the logits alone (NxD drops aliased outputs; the KV stays in nxd_model.state);
  the --target cpu trace returns (logits, *kv).
  Compiler flags: NxD's defaults (--auto-cast=none --model-type=transformer -O1); see NEURON_NOTES' comment in
  the script for why, and --compiler-args to override.
"""


def _sibling(name: str) -> object:
    """A module from a file next to this script, loaded by path: the script runs standalone, outside ``server``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_neuron() -> dict[str, object]:
    """The only place the Neuron stack is imported (so CPU runs and tests never need it)."""
    try:
        # transformers.utils.fx stand-in + neuron.SPMDModel: the same preparation the server's graph load does.
        _sibling("neuron_prelude").prepare_neuron_imports()
        import torch_neuronx  # noqa: F401  (registers the Neuron TorchScript classes)
        from neuronx_distributed.parallel_layers import mappings
        from neuronx_distributed.trace import trace as nxd_trace
        from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder
    except ImportError as exc:
        raise SystemExit(f"--target neuron needs torch-neuronx and neuronx-distributed: {exc}") from exc
    return {
        "mappings": mappings,
        "nxd_trace": nxd_trace,
        "BaseModelInstance": BaseModelInstance,
        "ModelBuilder": ModelBuilder,
    }


def check_sharded_checkpoint(template: nn.Module, workdir: Path, tp: int) -> None:
    """Fail loudly unless every rank's sharded checkpoint holds each weight at the module's rank-local shape.

    The sharding relies on our modules being in NxD's supported-modules registry (patched in ``build_neuron``);
    if a later NxD moves it, the sharder copies full tensors instead of slices, and nothing else would say so.
    ``template`` is built with the build's Plan (on "meta"): its parameters have the rank-local shapes.
    """
    from safetensors import safe_open

    expected = {name: tuple(p.shape) for name, p in template.named_parameters()}
    parallel = {name for name, p in template.named_parameters() if is_parallel(p)}
    problems: list[str] = []
    for rank in range(tp):
        found = sorted(workdir.rglob(f"tp{rank}_sharded_checkpoint.safetensors"))
        if len(found) != 1:
            problems.append(f"rank {rank}: {len(found)} tp{rank}_sharded_checkpoint.safetensors under {workdir}")
            continue
        with safe_open(str(found[0]), framework="pt") as handle:
            shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
        problems += [f"rank {rank}: {name} missing" for name in sorted(parallel - shapes.keys())]
        problems += [
            f"rank {rank}: {name} is {shape}, the rank-local shape is {expected[name]}"
            for name, shape in sorted(shapes.items())
            if name in expected and shape != expected[name]
        ]
    if problems:
        shown = "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
        raise SystemExit(
            f"the sharded checkpoint does not match tp={tp} ({len(problems)} problems; did NxD stop sharding our "
            f"ShardLinear/DenseExperts?):\n  {shown}"
        )


def build_neuron(args: argparse.Namespace, cfg, reader: CheckpointReader, out: Path) -> dict:
    nxd = import_neuron()
    mappings, nxd_trace = nxd["mappings"], nxd["nxd_trace"]
    BaseModelInstance, ModelBuilder = nxd["BaseModelInstance"], nxd["ModelBuilder"]  # noqa: N806

    # NxD's sharder only splits parameters of module classes it knows; ours carry the same TP attributes.
    # check_sharded_checkpoint below fails the build if this stops working.
    registry = "__SUPPORTED_SHARDED_MODULES"
    setattr(nxd_trace, registry, tuple(getattr(nxd_trace, registry)) + (ShardLinear, DenseExperts))

    coll = Collectives(
        all_reduce=mappings.reduce_from_tensor_model_parallel_region,
        gather_last=mappings.gather_from_tensor_model_parallel_region,
    )
    dtype = DTYPES[args.dtype or "bfloat16"]
    plan = plan_from_args(args, dtype=dtype, kv_as_params=True, inplace_kv=False)

    class Instance(BaseModelInstance):
        """Builds the module per key and aliases its KV parameters to outputs 1.. (device-resident states)."""

        def __init__(self) -> None:
            super().__init__(module_cls=lambda: build_device_module(cfg, plan, coll), input_output_aliases={})

        def load_module(self) -> None:
            self.module = self.module_cls()
            self.input_output_aliases = [self.module.state_aliases()]

    converted: dict[str, torch.Tensor] = {}
    template = build_model(cfg, plan, LOCAL, device="meta")  # names and rank-local shapes only

    def checkpoint_loader() -> dict[str, torch.Tensor]:
        if not converted:
            converted.update(convert_checkpoint(reader, template))
        return dict(converted)  # the sharder replaces entries per rank: hand out a fresh mapping each call

    workdir = out / "compiler_workdir"
    builder = ModelBuilder(
        router=None,
        tp_degree=args.tp,
        checkpoint_loader=checkpoint_loader,
        compiler_workdir=str(workdir),
    )
    for graph in all_graphs(plan):
        builder.add(
            key=graph[0],
            model_instance=Instance(),
            example_inputs=[graph_example(cfg, plan, graph)],
            compiler_args=args.compiler_args,  # None: NxD's defaults, on purpose (see NEURON_NOTES' comment)
        )
    separate = args.weights == "separate"
    # inside: needs the NeuronCores: the sharded weights are written to the work dir and loaded onto the device here.
    # separate: the saved graph holds no weights; NxD writes each rank's shard, the server hands them to
    # nxd_model.initialize(weights, start_rank) from memory-mapped files (no 27 GB pass through host RAM).
    nxd_model = builder.trace(initialize_model_weights=not separate)
    weight_files = None
    if separate:
        (out / RANK_WEIGHTS).parent.mkdir(parents=True, exist_ok=True)
        builder.shard_checkpoint(str((out / RANK_WEIGHTS).parent))
        weight_files = [RANK_WEIGHTS.format(rank=r) for r in range(args.tp)]
    torch.jit.save(nxd_model, str(out / "sqz_neff.pt"))
    converted.clear()
    # Before graph.json: a badly sharded build must not look like a complete artifact directory.
    check_sharded_checkpoint(template, (out / RANK_WEIGHTS).parent if separate else workdir, args.tp)
    record = write_graph_json(
        out,
        cfg=cfg,
        max_total=args.max_total,
        bucket=args.prefill_bucket,
        tp=args.tp,
        graph_file="sqz_neff.pt",
        quant=args.quant,
        plan=plan,
        weight_files=weight_files,
    )
    if not args.keep_compiler_workdir:
        shutil.rmtree(workdir)  # ~26.7 GB of sharded weights + NEFFs; sqz_neff.pt carries the weights itself
    return record


# --------------------------------------------------------------------------------------------------------------------
# The vision tower (--vision): transformers' Gemma-4 vision encoder + embed_vision, its own graph per budget
# --------------------------------------------------------------------------------------------------------------------

# NxD's shard names, in a folder of their own beside the language model's
VISION_WEIGHTS = "weights/vision/tp{rank}_sharded_checkpoint.safetensors"
VISION_GRAPH = "vision.pt"  # --target cpu; --target neuron writes vision_neff.pt (one NEFF per budget, shared weights)
# Soft tokens per image (max_soft_tokens; the processor allows 70/140/280/560/1120) built by default. 1120 builds too,
# at ~3.4 GB of scratch per core for one layer's f32 [heads, 10080, 10080] scores (--residency --vision).
VISION_BUDGETS = (70, 280)
SUPPORTED_BUDGETS = (70, 140, 280, 560, 1120)
# The 26B-A4B's tower when a config has no vision_config (a text-only config.json given to --residency): 27 layers of
# width 1152, 16 heads of 72, MLP 4304, patch 16, projection into the text width 2816 (the GGUF projector's metadata
# of the published checkpoint, ollama gemma4:26b-a4b-it, blob d8e2de16e175); pooling 3 and a 10,240-row position
# table are transformers' Gemma4VisionConfig defaults.
VISION_26B = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
                  position_embedding_size=10240)
# Shard the tower over the ranks only when that frees more than this per rank: below it the two all-reduces per layer
# cost more than the bytes are worth (a tiny test tower); the 26B's tower frees ~0.55 GB per rank (KV slots).
VISION_SHARD_MIN_BYTES = 64 * 2**20
VISION_TP_MODES = ("auto", "sharded", "replicated")


def vision_config_from_dict(raw: Mapping) -> object | None:
    """The checkpoint's ``Gemma4VisionConfig`` (None when config.json has no vision tower)."""
    from transformers import Gemma4VisionConfig

    data = raw.get("vision_config")
    if not data:
        return None
    data = dict(data)
    data.pop("model_type", None)
    data.pop("architectures", None)
    return Gemma4VisionConfig(**data)


def vision_sharded(vcfg, tp: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the tower is TP-sharded (attention heads and MLP split like the language model's) or replicated on
    every rank, chosen by bytes: sharding frees (tp - 1) / tp of the layer weights on each rank."""
    heads, kv, inter = vcfg.num_attention_heads, vcfg.num_key_value_heads, vcfg.intermediate_size
    if tp < 2 or heads % tp or kv % tp or inter % tp:
        return False
    width = torch.finfo(dtype).bits // 8
    per_layer = (2 * heads + 2 * kv) * vcfg.head_dim * vcfg.hidden_size + 3 * vcfg.hidden_size * inter
    freed = vcfg.num_hidden_layers * per_layer * width * (tp - 1) // tp
    return freed > VISION_SHARD_MIN_BYTES


class VisionTower(nn.Module):
    """``Gemma4Model.get_image_features(...).pooler_output`` of one image as a static graph.

        tower(pixel_values f32 [1, P, 3 * patch**2], position_ids int64 [1, P, 2]) -> soft tokens f32 [1, P // k**2, H]

    P = budget * k**2 patch rows (k = pooling_kernel_size), padded with position (-1, -1) as the image processor pads
    them; the first N = real patches // k**2 rows are the image's soft tokens (the host slices them; the rest is the
    pooled padding transformers strips with a boolean index, a data-dependent shape no device graph can have).

    Built from transformers' own modules (patch embedder, encoder layers, rotary, embed_vision) under their checkpoint
    names (``vision_tower.*``, ``embed_vision.*``); only what does not trace statically is rewritten: the padding mask
    (an additive f32 mask from the positions), the pooler's ``one_hot`` (a compare with an arange) and the strip.
    TP (``sharded``): q/k/v and gate/up column-parallel, o and down row-parallel (``ShardLinear``), the rest replicated.
    """

    def __init__(self, vision_config, text_config, *, tp: int = 1, sharded: bool = False,
                 dtype: torch.dtype = torch.float32, coll: Collectives = LOCAL) -> None:
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

        cfg = copy.deepcopy(vision_config)
        cfg._attn_implementation = "eager"  # the mask comes in as a tensor, added as it is
        self.vision_config = cfg
        self.k = int(cfg.pooling_kernel_size)
        self.vision_tower = Gemma4VisionModel(cfg)
        self.embed_vision = Gemma4MultimodalEmbedder(cfg, text_config)
        self.tp, self.sharded = tp, sharded
        split = sharded and tp > 1
        for layer in self.vision_tower.encoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for owner, name, mode in ((attn, "q_proj", "col"), (attn, "k_proj", "col"), (attn, "v_proj", "col"),
                                      (attn, "o_proj", "row"), (mlp, "gate_proj", "col"), (mlp, "up_proj", "col"),
                                      (mlp, "down_proj", "row")):
                clipped = getattr(owner, name)  # Gemma4ClippableLinear: clamp, linear, clamp
                lin = clipped.linear
                clipped.linear = ShardLinear(lin.in_features, lin.out_features, mode=mode if split else "replicated",
                                             tp=tp, quant=False, dtype=dtype, coll=coll)
                # A row-parallel output is all-reduced inside ShardLinear, before the output clamp; scalar clamps
                # commute with a column split. The bounds are buffers in transformers; as parameters they are
                # checkpoint weights to NxD (a buffer would be traced with its init value, as layer_scalar was).
                for bound in ("input_min", "input_max", "output_min", "output_max"):
                    if hasattr(clipped, bound):
                        value = getattr(clipped, bound).detach().clone()
                        delattr(clipped, bound)
                        setattr(clipped, bound, nn.Parameter(value, requires_grad=False))
        tower = self.vision_tower
        for name in ("std_bias", "std_scale"):
            if hasattr(tower, name):
                value = getattr(tower, name).detach().clone()
                delattr(tower, name)
                setattr(tower, name, nn.Parameter(value, requires_grad=False))
        for p in self.parameters():
            p.requires_grad_(False)
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)  # keeps the Parameter object and its TP attributes
        self.dtype = dtype

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        tower, cfg, k = self.vision_tower, self.vision_config, self.k
        padding = (position_ids == -1).all(dim=-1)  # [1, P] True on pad rows
        hidden = tower.patch_embedder(pixel_values, position_ids, padding)  # [1, P, Hv]
        # transformers' bidirectional mask: every query sees every real patch, no pad one
        neg = torch.finfo(torch.float32).min
        mask = torch.where(padding, neg, 0.0).to(torch.float32)[:, None, None, :]  # [1, 1, 1, P]
        rope = tower.encoder.rotary_emb(hidden, position_ids)
        for layer in tower.encoder.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=position_ids)  # [1,P,Hv]
        hidden = hidden.masked_fill(padding[..., None], 0.0)  # [1, P, Hv]
        if k > 1:
            # Gemma4VisionPooler._avg_pool_by_positions with the one-hot as a compare: patch (x, y) averages into
            # soft token x // k + (width // k) * (y // k); pad rows (clamped to (0, 0)) add zeros to token 0.
            length = pixel_values.size(1) // (k * k)
            clamped = position_ids.clamp(min=0)  # [1, P, 2]
            max_x = clamped[..., 0].max(dim=-1, keepdim=True)[0] + 1  # [1, 1]
            kernel = torch.div(clamped, k, rounding_mode="floor")  # [1, P, 2]
            kernel = kernel[..., 0] + (max_x // k) * kernel[..., 1]  # [1, P]
            tokens = torch.arange(length, device=kernel.device, dtype=kernel.dtype)  # [L]
            weights = (kernel[..., None] == tokens).float() / (k * k)  # [1, P, L]
            hidden = (weights.transpose(1, 2) @ hidden.float()).to(hidden.dtype)  # [1, L, Hv]
        hidden = hidden.float() * tower.pooler.root_hidden_size  # [1, L, Hv] f32, as the pooler returns it
        if cfg.standardize:
            hidden = (hidden - tower.std_bias.float()) * tower.std_scale.float()
        hidden = hidden.to(self.dtype)
        return self.embed_vision(hidden).float()  # [1, L, H] f32

    def budget(self, *inputs: torch.Tensor) -> torch.Tensor:
        """What trace_module traces per soft-token budget (one graph each on Neuron; one CPU trace serves all)."""
        return self.forward(*inputs)


def build_vision(vision_config, text_config, plan: Plan, coll: Collectives = LOCAL,
                 device: str | torch.device = "cpu") -> VisionTower:
    if plan.vision_tp not in VISION_TP_MODES:
        raise ValueError(f"vision_tp must be one of {VISION_TP_MODES}, got {plan.vision_tp!r}")
    sharded = vision_sharded(vision_config, plan.tp, plan.dtype) if plan.vision_tp == "auto" else (
        plan.vision_tp == "sharded" and plan.tp > 1)
    if sharded and any(n % plan.tp for n in (vision_config.num_attention_heads, vision_config.num_key_value_heads,
                                             vision_config.intermediate_size)):
        raise ValueError(f"the vision tower's heads / kv heads / intermediate size do not split over tp={plan.tp}")
    with torch.device(device):
        tower = VisionTower(vision_config, text_config, tp=plan.tp, sharded=sharded, dtype=plan.dtype, coll=coll)
    return tower.eval()


def vision_example(vcfg, budget: int, aspect: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """An image's processor-shaped inputs at `budget`: the largest grid of k x k cells of aspect w:h that fits,
    row-major (x fastest, as the image processor emits them), then pad rows at (-1, -1)."""
    k, patch = int(vcfg.pooling_kernel_size), int(vcfg.patch_size)
    rows = budget * k * k
    w, h = aspect
    scale = max(1, int((budget / (w * h)) ** 0.5))
    cw, ch = max(1, w * scale), max(1, h * scale)
    while cw * ch > budget:  # cells of k x k patches
        cw, ch = max(1, cw - (cw >= ch)), max(1, ch - (ch > cw))
    gx, gy = cw * k, ch * k
    ys, xs = torch.meshgrid(torch.arange(gy), torch.arange(gx), indexing="ij")
    real = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)  # [gx * gy, 2] (x, y)
    positions = torch.full((rows, 2), -1, dtype=torch.int64)
    positions[: real.shape[0]] = real
    pixels = torch.rand(rows, 3 * patch * patch)
    pixels[real.shape[0]:] = 0.0  # the processor pads pixels with zeros
    return pixels[None], positions[None]  # [1, P, D], [1, P, 2]


def vision_prefix(reader: CheckpointReader) -> str:
    probe = "vision_tower.patch_embedder.input_proj.weight"
    for prefix in ("model.", ""):
        if prefix + probe in reader._where:
            return prefix
    raise KeyError(f"--vision: no vision tower ({probe}) in {reader.directory}")


def convert_vision(reader: CheckpointReader, tower: VisionTower) -> dict[str, torch.Tensor]:
    """Every weight of the tower as a full-size tensor in the tower's dtype, by the module's own names."""
    prefix = vision_prefix(reader)
    full = {}
    for name, param in tower.named_parameters():
        key = prefix + name
        if key not in reader._where:
            raise KeyError(f"{key} missing from the checkpoint in {reader.directory}")
        tensor = reader._where[key].get_tensor(key)
        if tensor.is_floating_point():
            tensor = tensor.to(param.dtype)
        expected = list(param.shape)
        if is_parallel(param):
            expected[param.partition_dim] *= tower.tp
        if list(tensor.shape) != expected:
            raise ValueError(f"{name}: checkpoint gives {list(tensor.shape)}, the tower expects {expected}")
        full[name] = tensor.contiguous()
    return full


def vision_residency(vision_config, text_config, tp: int, dtype: torch.dtype = torch.bfloat16,
                     budgets: Iterable[int] = VISION_BUDGETS, vision_tp: str = "auto") -> dict[str, int]:
    """Device bytes of the tower per rank, and what one call at the largest budget holds at once on top (an
    estimate: the f32 [heads, P, P] scores of one layer, the [P, Hv] hidden states and MLP activations)."""
    from accelerate import init_empty_weights

    plan = Plan(tp=tp, dtype=dtype, vision_tp=vision_tp)
    with init_empty_weights(include_buffers=True):
        tower = build_vision(vision_config, text_config, plan, device="meta")
    weights = sum(t.numel() * t.element_size() for t in tower.parameters())
    k = int(vision_config.pooling_kernel_size)
    p = max(budgets) * k * k
    heads = vision_config.num_attention_heads // (tp if tower.sharded else 1)
    inter = vision_config.intermediate_size // (tp if tower.sharded else 1)
    width = torch.finfo(dtype).bits // 8
    scratch = 4 * heads * p * p + width * p * (4 * vision_config.hidden_size + 2 * inter)
    return {"vision": weights, "vision_scratch_estimate": scratch, "vision_sharded": int(tower.sharded)}


def trace_vision(tower: VisionTower, vcfg, budgets: Iterable[int]) -> torch.jit.ScriptModule:
    """The tower traced once on CPU: its ops take their sizes from the inputs (as v2's prefill serves every bucket),
    so one trace serves every budget; tests/test_vision_graph.py runs each built budget against transformers."""
    first = min(budgets)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        return torch.jit.trace_module(tower, {"forward": vision_example(vcfg, first)}, check_trace=False)


def vision_record(vcfg, text_config, tower: VisionTower, budgets: list[int], graph_file: str,
                  weight_files: list[str]) -> dict:
    """graph.json's `vision`: what the host sends the tower and what it gets back, per budget."""
    k, patch = int(vcfg.pooling_kernel_size), int(vcfg.patch_size)
    return {
        "budgets": sorted(budgets),
        "patch_rows": {str(b): b * k * k for b in sorted(budgets)},
        "pooling_kernel_size": k,
        "patch_size": patch,
        "patch_dim": 3 * patch * patch,
        "hidden": int(text_config.hidden_size),
        "vision_hidden": int(vcfg.hidden_size),
        "inputs": {"pixel_values": ["float32", [1, "P", 3 * patch * patch]], "position_ids": ["int64", [1, "P", 2]]},
        "outputs": {"soft_tokens": ["float32", [1, "P / pooling_kernel_size**2", int(text_config.hidden_size)]]},
        "real_rows": "the first (rows with position_ids != (-1, -1)) / pooling_kernel_size**2 output rows",
        "tp": tower.tp,
        "sharded": tower.sharded,
        "graph_file": graph_file,
        "files": {str(b): graph_file for b in sorted(budgets)},
        "weights": "separate",
        "weight_files": list(weight_files),
    }


def write_vision_weights(out: Path, tower: VisionTower, full: Mapping[str, torch.Tensor]) -> list[str]:
    """One safetensors file per rank (the tower's rank-local shards), memory-mapped by the server like the LM's."""
    from safetensors.torch import save_file

    files = []
    for rank in range(tower.tp):
        rel = VISION_WEIGHTS.format(rank=rank)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(shard_state_dict(tower, full, rank, tower.tp), str(out / rel))
        files.append(rel)
    return files


def build_vision_cpu(args: argparse.Namespace, raw: Mapping, cfg, reader: CheckpointReader, out: Path) -> dict:
    vcfg = vision_config_from_dict(raw)
    if vcfg is None:
        raise SystemExit("--vision: the checkpoint's config.json has no vision_config")
    plan = Plan(tp=1, dtype=DTYPES[args.dtype or "float32"])
    tower = build_vision(vcfg, cfg, plan)
    full = convert_vision(reader, tower)
    tower.load_state_dict(full, strict=False)
    with torch.no_grad():
        probe = tower(*vision_example(vcfg, min(args.vision_budgets)))
    if not torch.isfinite(probe).all():
        raise RuntimeError("non-finite soft tokens from the CPU tower; refusing to write the artifact")
    traced = trace_vision(tower, vcfg, args.vision_budgets)
    weight_files = write_vision_weights(out, tower, full)
    for name, _ in tower.named_parameters():  # the server attaches the mapped per-rank tensors by name
        owner_path, leaf = name.rsplit(".", 1)
        owner = functools.reduce(getattr, owner_path.split("."), traced)
        setattr(owner, leaf, torch.empty(0, dtype=getattr(owner, leaf).dtype))
    torch.jit.save(traced, str(out / VISION_GRAPH))
    return vision_record(vcfg, cfg, tower, list(args.vision_budgets), VISION_GRAPH, weight_files)


def build_vision_neuron(args: argparse.Namespace, raw: Mapping, cfg, out: Path, reader: CheckpointReader) -> dict:
    """The tower as one ModelBuilder model with a graph (key) per budget over one set of weights, written per rank to
    weights/vision/ (NxD's shard names) and handed to nxd_model.initialize by the server, like the language model's
    --weights separate. Not run here (no Neuron host); the CPU trace and the lowering check cover the module."""
    nxd = import_neuron()
    mappings, nxd_trace = nxd["mappings"], nxd["nxd_trace"]
    BaseModelInstance, ModelBuilder = nxd["BaseModelInstance"], nxd["ModelBuilder"]  # noqa: N806
    vcfg = vision_config_from_dict(raw)
    if vcfg is None:
        raise SystemExit("--vision: the checkpoint's config.json has no vision_config")
    registry = "__SUPPORTED_SHARDED_MODULES"
    known = tuple(getattr(nxd_trace, registry))
    setattr(nxd_trace, registry, known + tuple(c for c in (ShardLinear,) if c not in known))
    coll = Collectives(all_reduce=mappings.reduce_from_tensor_model_parallel_region,
                       gather_last=mappings.gather_from_tensor_model_parallel_region)
    plan = Plan(tp=args.tp, dtype=DTYPES[args.dtype or "bfloat16"], vision_tp=args.vision_tp)

    def device_tower() -> VisionTower:
        tower = build_vision(vcfg, cfg, plan, coll, device="meta")
        tags = {n: (p.partition_dim, p.num_partitions, p.partition_stride)
                for n, p in tower.named_parameters() if is_parallel(p)}
        tower.to_empty(device="cpu")
        for name, p in tower.named_parameters():
            if name in tags and not is_parallel(p):
                mark_parallel(p, *tags[name])
        from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionRotaryEmbedding

        tower.vision_tower.encoder.rotary_emb = Gemma4VisionRotaryEmbedding(tower.vision_config)  # baked constants
        return tower.eval()

    class Instance(BaseModelInstance):
        def __init__(self) -> None:
            super().__init__(module_cls=device_tower, input_output_aliases={})

        def load_module(self) -> None:
            self.module = self.module_cls()
            self.input_output_aliases = [{}]

    template = build_vision(vcfg, cfg, plan, device="meta")
    builder = ModelBuilder(router=None, tp_degree=args.tp, checkpoint_loader=lambda: convert_vision(reader, template),
                           compiler_workdir=str(out / "compiler_workdir_vision"))
    for budget in args.vision_budgets:
        builder.add(key=f"vision_{budget}", model_instance=Instance(), example_inputs=[vision_example(vcfg, budget)],
                    compiler_args=args.compiler_args)
    nxd_model = builder.trace(initialize_model_weights=False)
    (out / VISION_WEIGHTS).parent.mkdir(parents=True, exist_ok=True)
    builder.shard_checkpoint(str((out / VISION_WEIGHTS).parent))
    torch.jit.save(nxd_model, str(out / "vision_neff.pt"))
    check_sharded_checkpoint(template, (out / VISION_WEIGHTS).parent, args.tp)
    if not args.keep_compiler_workdir:
        shutil.rmtree(out / "compiler_workdir_vision")
    return vision_record(vcfg, cfg, template, list(args.vision_budgets), "vision_neff.pt",
                         [VISION_WEIGHTS.format(rank=r) for r in range(args.tp)])


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------


def bucket_list(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("expected at least one bucket")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=NEURON_NOTES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", type=Path, help="transformers checkpoint dir (Gemma4ForCausalLM or gemma4)")
    p.add_argument("--out", type=Path, help="artifact directory to write")
    p.add_argument("--target", choices=("neuron", "cpu"), default="neuron")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--contract", choices=("v1", "v2", "v3", "v4"), default="v1",
                   help="graph contract (see the module doc; v4: docs/contract-v4.md)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="v4: blocks in the global layers' KV pool, block 0 the null block (default: room for every "
                        "slot at the largest context bucket, 1 + S * MAX / block size)")
    p.add_argument("--block-size", type=int, default=POOL_BLOCK, help="v4: positions per KV block (default 128)")
    p.add_argument("--context-buckets", type=bucket_list, default=None,
                   help="v4: contexts (tokens per row's block table) a graph is compiled for, e.g. 4096,16384,65536; "
                        "the largest is --max-total (default: --max-total alone)")
    p.add_argument("--kv-slots", type=int, default=None,
                   help="v3: independent KV caches (conversations) the graph keeps (default 4; v1/v2: 1)")
    p.add_argument("--kv-quant", choices=QUANT_MODES, default="none",
                   help="v3: int8 K/V with one f32 scale per (slot, head, position): about half the KV bytes")
    p.add_argument("--decode-batches", type=bucket_list, default=None,
                   help="v3: compiled decode batch sizes, e.g. 1,2,4 (default: 1,2,4 capped at --kv-slots)")
    p.add_argument("--max-total", type=int, default=512, help="KV slots (MAX): prompt + completion")
    p.add_argument("--prefill-bucket", type=int, default=128, help="prefill chunk length (one bucket)")
    p.add_argument("--prefill-buckets", type=bucket_list, default=None,
                   help="v2: several prefill chunk lengths, e.g. 128,512 (replaces --prefill-bucket)")
    p.add_argument("--quant", choices=QUANT_MODES, default="int8")
    p.add_argument("--experts", choices=EXPERT_MODES, default=None,
                   help="selective: graphs of few tokens (decode) read only the routed experts (see --roofline); "
                        "default: selective for --contract v2, dense for v1 (the published build)")
    p.add_argument("--attn-quant", choices=QUANT_MODES, default="none", help="int8: attention projections too")
    p.add_argument("--prefill-logits", choices=PREFILL_LOGITS, default=None,
                   help="v2/v3/v4: 'last' (default) - prefill graphs return the last real row's logits, a score "
                        "graph at the smallest bucket returns every row (scored prompts; v4: at the largest context); "
                        "'all': every prefill row (v1)")
    p.add_argument("--query-tile", type=int, default=None,
                   help=f"v2/v3/v4: global layers attend a prefill's queries this many rows at a time (default "
                        f"{DEFAULT_QUERY_TILE}, v4 {DEFAULT_QUERY_TILE_V4}; 0: all at once; v1: 0)")
    p.add_argument("--expert-group", type=int, default=None,
                   help=f"v2/v3/v4: the dense experts path (prefill) runs this many local experts a pass and sums "
                        f"(default: v4 {DEFAULT_EXPERT_GROUP_V4}, v2/v3 0 = all in one pass; v1: 0)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="compute dtype (cpu: float32, neuron: bf16)")
    p.add_argument("--weights", choices=("inside", "separate"), default="inside",
                   help="v2: 'separate' traces the graph without weights and writes one safetensors file per rank")
    p.add_argument("--compiler-args", default=None,
                   help="neuronx-cc flags (default: NxD ModelBuilder's, --auto-cast=none --model-type=transformer -O1)")
    p.add_argument("--keep-compiler-workdir", action="store_true",
                   help="--target neuron: keep OUT/compiler_workdir (sharded weights + NEFFs, ~26.7 GB for the 26B)")
    p.add_argument("--vision", action="store_true",
                   help="v2/v3: also build the vision tower + embed_vision as its own graph (one per --vision-budgets), "
                        "and make the language graph's prefill take image-block ids (bidirectional within an image)")
    p.add_argument("--vision-budgets", type=bucket_list, default=list(VISION_BUDGETS),
                   help="with --vision: soft tokens per image the tower is compiled for (of 70,140,280,560,1120; "
                        "280 is needed)")
    p.add_argument("--vision-tp", choices=VISION_TP_MODES, default="auto",
                   help="with --vision: shard the tower over the ranks or replicate it; auto: shard when that frees "
                        "more than 64 MiB per rank (the 26B's tower: 0.55 GB)")
    reports = p.add_argument_group("reports (no artifact is written)")
    reports.add_argument("--residency", action="store_true", help="print per-rank device memory by component")
    reports.add_argument("--check-lowering", action="store_true",
                         help="lower every graph on torch-xla (CPU PJRT) with random weights: aten:: fallbacks and "
                              "compilations per call. Necessary for neuronx-cc, not sufficient")
    reports.add_argument("--slot-table", action="store_true",
                         help="v3: per-rank bytes of 1..8 KV slots at MAX 2k..32k, bf16 and int8 attention, and the "
                              "most slots that fit 15 GB of a core (a projection)")
    reports.add_argument("--roofline", action="store_true",
                         help="per-rank bytes read per decoded token, dense vs selective, and projected tok/s")
    reports.add_argument("--bench-experts", action="store_true",
                         help="measure the CPU-traced decode step, dense vs selective experts, on a 128-expert config")
    reports.add_argument("--bench-batched", action="store_true",
                         help="measure batched decode (B = 1, 2, 4 rows per step) of one CPU-traced v3 graph on the "
                              "128-expert config, and each row's logits against its B = 1 run")
    reports.add_argument("--steps", type=int, default=16,
                         help="with --bench-experts / --bench-batched: timed decode steps per graph")
    reports.add_argument("--threads", type=int, default=1,
                         help="with --bench-experts: torch CPU threads (1: steadiest on a shared machine)")
    reports.add_argument("--config", type=Path, help="config.json for the reports")
    reports.add_argument("--json", action="store_true", help="any report: its last line is one JSON object")
    args = p.parse_args(argv)
    if args.contract == "v4":
        if args.context_buckets is None:
            args.context_buckets = [args.max_total]
        args.max_total = max(args.context_buckets)
        slots = 4 if args.kv_slots is None else args.kv_slots
        if args.kv_blocks is None:
            args.kv_blocks = 1 + slots * -(-args.max_total // max(args.block_size, 1))
    elif args.kv_blocks is not None or args.context_buckets is not None:
        p.error("--kv-blocks and --context-buckets need --contract v4")
    else:
        args.kv_blocks, args.context_buckets = 0, []
    if args.contract in ("v3", "v4"):
        args.kv_slots = 4 if args.kv_slots is None else args.kv_slots
        if args.decode_batches is None:
            args.decode_batches = [b for b in (1, 2, 4) if b <= args.kv_slots]
    elif args.kv_slots not in (None, 1) or args.decode_batches not in (None, [1]):
        p.error("--kv-slots and --decode-batches need --contract v3 or v4")
    else:
        args.kv_slots, args.decode_batches = 1, [1]
    if args.prefill_buckets is None:
        args.prefill_buckets = [args.prefill_bucket]
    else:
        if args.contract == "v1" and len(args.prefill_buckets) > 1:
            p.error("several --prefill-buckets need --contract v2 or v3 (v1 has one prefill graph)")
        args.prefill_bucket = max(args.prefill_buckets)
    if args.weights == "separate" and args.contract == "v1":
        p.error("--weights separate needs --contract v2 or v3")
    if not (min(args.prefill_buckets) > 1 and max(args.prefill_buckets) <= args.max_total):
        p.error("need 1 < every prefill bucket <= --max-total")
    if args.experts is None:
        args.experts = "selective" if args.contract in ("v2", "v3", "v4") else "dense"
    ringed = args.contract in ("v2", "v3", "v4")
    if args.prefill_logits is None:
        args.prefill_logits = "last" if ringed else "all"
    if args.query_tile is None:
        args.query_tile = default_query_tile(args.contract)
    if args.expert_group is None:
        args.expert_group = default_expert_group(args.contract)
    if not ringed and (args.prefill_logits != "all" or args.query_tile or args.expert_group):
        p.error("--prefill-logits last, --query-tile and --expert-group need --contract v2, v3 or v4 (v1 is the "
                "published contract)")
    if args.query_tile < 0:
        p.error("--query-tile must be >= 0")
    if args.expert_group < 0:
        p.error("--expert-group must be >= 0")
    if args.vision:
        if args.contract == "v1":
            p.error("--vision needs --contract v2 or v3 (the block-aware prefill)")
        bad = [b for b in args.vision_budgets if b not in SUPPORTED_BUDGETS]
        if bad:
            p.error(f"--vision-budgets must be of {SUPPORTED_BUDGETS}, got {args.vision_budgets}")
        # An artifact serves the processor's default budget; a report may look at any of them.
        reporting = args.residency or args.check_lowering or args.slot_table
        if 280 not in args.vision_budgets and not reporting:
            p.error(f"--vision-budgets must hold 280 (the image processor's default), got {args.vision_budgets}")
    try:
        check_slots(plan_from_args(args))
    except ValueError as exc:
        p.error(str(exc))
    if args.residency or args.check_lowering or args.roofline or args.slot_table:
        if args.config is None and args.checkpoint is not None:
            args.config = args.checkpoint / "config.json"
        # No --config: the 26B-A4B's own shapes (CONFIG_26B), what the projections are for.
    elif args.bench_experts or args.bench_batched:
        pass  # builds its own config
    elif args.checkpoint is None or args.out is None:
        p.error("--checkpoint and --out are required (or use a report: --residency, --check-lowering, --roofline)")
    return args


def report_config(args: argparse.Namespace) -> dict:
    """The config a report reads: --config (or the checkpoint's), else the built-in 26B-A4B text config."""
    return dict(CONFIG_26B) if args.config is None else json.loads(args.config.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.residency:
        cfg = text_config_from_dict(report_config(args))
        sizes = residency(cfg, args.tp, args.quant, args.max_total, contract=args.contract,
                          buckets=tuple(args.prefill_buckets), attn_quant=args.attn_quant, kv_slots=args.kv_slots,
                          decode_batches=tuple(args.decode_batches), kv_quant=args.kv_quant,
                          kv_blocks=args.kv_blocks, block_size=args.block_size,
                          context_buckets=tuple(args.context_buckets),
                          prefill_logits=args.prefill_logits, query_tile=args.query_tile,
                          expert_group=args.expert_group)
        if args.vision:
            raw = report_config(args)
            vcfg = vision_config_from_dict(raw)
            if vcfg is None:
                from transformers import Gemma4VisionConfig

                vcfg = Gemma4VisionConfig(**VISION_26B)
            sizes.update(vision_residency(vcfg, cfg, args.tp, budgets=args.vision_budgets, vision_tp=args.vision_tp))
            sizes["total"] += sizes["vision"]
        extra = f", attention={args.attn_quant}" + (f", {args.kv_slots} KV slots, kv-quant={args.kv_quant}"
                                                     if args.contract in ("v3", "v4") else "")
        extra += (f", {args.kv_blocks} KV blocks of {args.block_size}, contexts {args.context_buckets}"
                  if args.contract == "v4" else "")
        print_residency(sizes, args.tp, args.quant, args.max_total, args.json, args.contract, extra)
        return 0
    if args.slot_table and args.contract == "v4":
        cfg = text_config_from_dict(report_config(args))
        print_pool_table(pool_table(cfg, args.tp, args.quant, tuple(args.prefill_buckets), kv_quant=args.kv_quant,
                                    block_size=args.block_size), args.json)
        return 0
    if args.roofline and args.contract == "v4":
        cfg = text_config_from_dict(report_config(args))
        print_context_roofline(context_roofline(cfg, args.tp, args.quant, args.attn_quant,
                                                tuple(args.prefill_buckets), args.kv_quant, args.block_size), args.json)
        return 0
    if args.slot_table:
        cfg = text_config_from_dict(report_config(args))
        vision = None
        if args.vision:
            vcfg = vision_config_from_dict(report_config(args))
            if vcfg is None:
                from transformers import Gemma4VisionConfig

                vcfg = Gemma4VisionConfig(**VISION_26B)
            vision = vision_residency(vcfg, cfg, args.tp, budgets=args.vision_budgets, vision_tp=args.vision_tp)
        # the table is of v3 builds: their scratch follows --prefill-logits / --query-tile (v3's defaults unless given)
        v3_flags = args.contract == "v3"
        print_slot_table(slot_table(cfg, args.tp, args.quant, tuple(args.prefill_buckets), kv_quant=args.kv_quant,
                                    vision=vision, prefill_logits=args.prefill_logits if v3_flags else None,
                                    query_tile=args.query_tile if v3_flags else None), args.json)
        return 0
    if args.check_lowering:
        cfg = text_config_from_dict(report_config(args))
        vcfg = None
        if args.vision:
            vcfg = vision_config_from_dict(report_config(args))
            if vcfg is None:
                raise SystemExit("--check-lowering --vision: the config has no vision_config")
        report = check_lowering(cfg, plan_from_args(args, dtype=DTYPES[args.dtype or "float32"]), vcfg,
                                args.vision_budgets)
        print_lowering(report, args.json)
        return 0 if report["pass"] else 1
    if args.roofline:
        cfg = text_config_from_dict(report_config(args))
        report = roofline(cfg, args.tp, args.quant, args.attn_quant, args.max_total, args.prefill_bucket,
                          args.contract, tuple(args.prefill_buckets), args.kv_slots, tuple(args.decode_batches),
                          args.kv_quant)
        print_roofline(report, args.json)
        return 0
    if args.bench_batched:
        torch.set_num_threads(args.threads)
        print_bench_batched(bench_batched(args.quant, args.steps), args.json)
        return 0
    if args.bench_experts:
        torch.set_num_threads(args.threads)
        print_bench_experts(bench_experts(args.quant, args.steps), args.json)
        return 0

    if args.target == "neuron":
        import_neuron()  # fail before writing anything when the Neuron stack is missing
    cfg = load_text_config(args.checkpoint)
    check_supported(cfg, 1 if args.target == "cpu" else args.tp)
    reader = CheckpointReader(args.checkpoint)
    args.out.mkdir(parents=True, exist_ok=True)
    write_host_artifacts(args.checkpoint, reader, args.out)
    build = build_cpu if args.target == "cpu" else build_neuron
    record = build(args, cfg, reader, args.out)
    if args.vision:
        raw = json.loads((args.checkpoint / "config.json").read_text())
        if args.target == "cpu":
            record["vision"] = build_vision_cpu(args, raw, cfg, reader, args.out)
        else:
            record["vision"] = build_vision_neuron(args, raw, cfg, args.out, reader)
        (args.out / "graph.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
