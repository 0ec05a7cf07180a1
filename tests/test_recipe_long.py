"""Long positions through the recipe's CPU v3 and v4 builds (issue 34): a conversation longer than 32k tokens, token
for token against transformers.

A tiny Gemma-4 (tests/support/recipe_helpers.py's TINY: k_eq_v global layers with proportional partial RoPE, MoE
beside the shared MLP, tied lm_head; here two layers, one sliding (window 8) and one global, two query heads on one
KV head (so the tiles' folded heads are exercised) and 40,960 positions)
is built by the recipe at MAX 33,280 with two KV slots, decode batches 1 and 2, prefill buckets 64 and 512, and the
defaults of a v3 build: prefill graphs that return the last row's logits and global attention in query tiles of 64.
A 32,800-token prompt is prefilled in bucket-planned chunks into slot 0 (the sliding layer's ring of 520 slots wraps
63 times; the global layer reads its whole 33,792-slot ring every call, its RoPE at positions past 32k) and a short
one into slot 1; then both decode in one batch of 2. Each must produce exactly transformers' greedy tokens: the
reference is `Gemma4ForCausalLM` itself, prefilled in chunks through its own cache (one pass over 32k positions would
need [heads, 32k, 32k] scores). Both known porting bugs of Gemma-4 long positions (a global layer's RoPE taken as the
sliding one's, or as full rather than proportional rotation) change these tokens long before 32k.

The v4 build (KV by need) runs the same conversations with the global layer's KV in a pool of 256-position blocks
read through each row's block table (contexts 4,096 and 33,280: the short row's table is 16 blocks wide, the long
one's 130), its defaults' query tiles of 16 over the gathered blocks; the pool holds 131 + 1 blocks, fewer than two
v3 slots' 2 x 130.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from server.engine.buckets import plan_chunks
from server.graphs.jit import JitGraphV3, JitGraphV4
from server.model.artifacts import GraphSpec
from tests.support.recipe_helpers import SCRIPT, host_embeds, make_tiny_hf, save_tiny_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

POSITIONS = 40_960
LAYERS = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_attention_heads=2,
              num_key_value_heads=1, global_head_dim=16,
              max_position_embeddings=POSITIONS)
BUCKETS, MAX, SLOTS, BATCHES = (64, 512), 33_280, 2, (1, 2)
LONG, SHORT, NEW = 32_800, 45, 6
REFERENCE_CHUNK = 1024  # the reference's prefill chunks: [heads, 1024, 32k] scores at most
BLOCK, CONTEXTS, POOL = 256, (4096, MAX), 133  # v4: 129 blocks for the long row, 1 for the short one, the null block
# what each contract's build adds to the command, and the tile its defaults record
V4_ARGS = ["--block-size", str(BLOCK), "--context-buckets", ",".join(map(str, CONTEXTS)), "--kv-blocks", str(POOL)]
CONTRACTS = {"v3": ([], 64, JitGraphV3), "v4": (V4_ARGS, 16, JitGraphV4)}


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return make_tiny_hf(seed=3, **LAYERS)


@pytest.fixture(scope="module", params=sorted(CONTRACTS))
def graph(request: pytest.FixtureRequest, hf_model: torch.nn.Module,
          tmp_path_factory: pytest.TempPathFactory) -> JitGraphV3:
    contract = request.param
    extra, tile, graph_class = CONTRACTS[contract]
    root = tmp_path_factory.mktemp(f"long-{contract}")
    checkpoint = save_tiny_checkpoint(root / "checkpoint", hf_model)
    out = root / "artifacts"
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
           "--contract", contract, "--max-total", str(MAX), "--prefill-buckets", ",".join(map(str, BUCKETS)),
           "--kv-slots", str(SLOTS), "--decode-batches", ",".join(map(str, BATCHES)), "--quant", "none", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "graph.json").read_text())
    assert record["prefill_logits"] == "last" and record["score_buckets"] == [64] and record["query_tile"] == tile
    spec = GraphSpec.from_json(record)
    return graph_class(out / "model.pt", spec, vocab_size=hf_model.config.vocab_size,
                       final_softcap=hf_model.config.final_logit_softcapping)


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(3, 256, (length - 1,), generator=generator).tolist()]


def reference_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy tokens, its prefill in chunks through its own cache (sliding layers: its sliding cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.inference_mode():
        for begin in range(0, len(prompt), REFERENCE_CHUNK):
            logits = model(input_ids=ids[:, begin : begin + REFERENCE_CHUNK], past_key_values=cache,
                           use_cache=True, logits_to_keep=1).logits  # [1, 1, V]
        for _ in range(new):
            out.append(int(logits[0, -1].argmax()))
            logits = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits
    return out


def test_a_32k_conversation_beside_a_short_one_matches_transformers(graph: JitGraphV3,
                                                                   hf_model: torch.nn.Module) -> None:
    table = hf_model.model.embed_tokens.weight.detach()  # bf16-exact (make_tiny_hf): the artifact's table
    hidden = hf_model.config.hidden_size
    prompts = {0: prompt_of(LONG, seed=1), 1: prompt_of(SHORT, seed=2)}  # slot -> prompt
    tokens: dict[int, list[int]] = {}
    margins: list[float] = []

    def take(slot: int, row: torch.Tensor) -> None:  # row [V]: greedy (the host's soft-cap keeps the argmax)
        top = row.topk(2).values
        margins.append(float(top[0] - top[1]))
        tokens.setdefault(slot, []).append(int(row.argmax()))

    for slot, prompt in prompts.items():
        begin = 0
        chunks = plan_chunks(len(prompt), graph.prefill_buckets)
        for length in chunks:
            logits = graph.prefill(host_embeds(table, prompt[begin : begin + length], hidden),
                                   torch.arange(begin, begin + length)[None], slot, last_only=True)
            assert logits.shape == (1, 1, hf_model.config.vocab_size)  # the last row only, from the graph
            begin += length
        take(slot, logits[0, 0])
    assert len(plan_chunks(LONG, graph.prefill_buckets)) > LONG // max(BUCKETS)  # chunked, the last one padded
    assert graph.ring is not None
    assert LONG > 32_768 and graph.ring * 60 < LONG  # past 32k, many wraps of the sliding ring

    for step in range(NEW - 1):  # both conversations in one decode batch of 2, each at its own position
        slots = [0, 1]
        last = [tokens[s][-1] for s in slots]
        positions = torch.tensor([[len(prompts[s]) + step] for s in slots])  # [2, 1]
        embeds = torch.cat([host_embeds(table, [t], hidden) for t in last])  # [2, 1, H]
        rows = graph.decode(embeds, positions, slots)  # [2, V]
        for b, s in enumerate(slots):
            take(s, rows[b])

    if isinstance(graph, JitGraphV4):  # each row holds the blocks its positions reached, no more
        assert {s: graph.pool.held(s) for s in slots} == {0: -(-(LONG + NEW - 1) // BLOCK), 1: 1}
    for slot, prompt in prompts.items():
        assert tokens[slot] == reference_greedy(hf_model, prompt, NEW), f"slot {slot} ({len(prompt)} tokens)"
    assert min(margins) > 1e-4  # no step was a near-tie at float noise level: the comparison means something
