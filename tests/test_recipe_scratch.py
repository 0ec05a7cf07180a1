"""Prefill scratch that does not grow with the context (issue 34), on the recipe's own module and reports.

- Global layers in query tiles (`query_tiled_attention`) compute what transformers' eager attention computes, row for
  row: the tiled module's logits equal the untiled one's at positions before and past a ring wrap, and decode is
  untouched.
- A last-row prefill graph returns exactly the chosen row of the full logits, through the CPU trace too (one trace
  serves every bucket, tiles included), and the score graph exists at the smallest bucket only.
- `--residency` counts those graphs: the 26B's prefill scratch at 32k (tp 2, int8 attention, buckets 128,512) is at
  most 0.35 GB per rank, where every-row logits and untiled scores needed 1.6 GB.
- graph.json: a record without `prefill_logits` (every older build) is served as every-row prefill.
- The dense experts path in groups (`--expert-group`, v4's default 16) sums what one pass sums: the same logits for
  dense and selective layouts, f32 and int8 weights, and a group that does not divide the experts.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch

from server.model.artifacts import GraphSpec
from tests.support.configs import GEMMA4_26B_A4B
from tests.support.recipe_helpers import load_recipe

recipe = load_recipe()
# CI's lowering config: both layer kinds, k_eq_v globals, MoE beside the shared MLP, tied lm_head
TINY = json.loads((Path(__file__).resolve().parents[1] / ".ci" / "tiny-gemma4-config.json").read_text())
MAX = 64


@pytest.fixture(scope="module")
def models():
    cfg = recipe.text_config_from_dict(TINY)
    plan = recipe.Plan(contract="v3", buckets=(8, 32), kv_slots=2, decode_batches=(1, 2), max_total=MAX)
    untiled = recipe.build_model(cfg, plan)
    recipe.randomize(untiled)
    tiled = recipe.build_model(cfg, dataclasses.replace(plan, query_tile=5, prefill_logits="last"))
    tiled.load_state_dict(untiled.state_dict())
    return cfg, untiled, tiled


def test_query_tiles_equal_eager_attention_and_last_rows_equal_the_full_logits(models) -> None:
    cfg, untiled, tiled = models
    scorer = recipe.build_model(cfg, tiled.plan)  # the tiled module's score graph, in lockstep with the others
    scorer.load_state_dict(untiled.state_dict())
    assert [getattr(layer.self_attn, "query_tile", 0) for layer in tiled.layers] == [0, 5, 0, 5]  # globals only
    with torch.no_grad():
        for t, start, last in ((32, 0, 31), (8, 32, 3), (32, 40, 17)):  # the last call wraps the sliding ring
            inputs = recipe.example_inputs(cfg, t, start, MAX, "v3")
            full = untiled(*inputs)[0]  # [1, T, V]
            assert torch.allclose(scorer.score(*inputs)[0], full, atol=1e-5, rtol=0)
            row = tiled.prefill(*inputs, torch.tensor([last]))[0]
            assert row.shape == (1, 1, cfg.vocab_size)
            assert torch.allclose(row, full[:, last : last + 1], atol=1e-5, rtol=0)
        step = recipe.example_inputs(cfg, 1, 60, MAX, "v3", batch=2)
        assert torch.allclose(tiled(*step)[0], untiled(*step)[0], atol=1e-5, rtol=0)  # decode: eager, as before
    untiled.reset_states()
    tiled.reset_states()


def test_the_cpu_trace_serves_every_bucket_and_the_score_graph_at_the_smallest(models) -> None:
    cfg, untiled, tiled = models
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = recipe.trace_cpu(tiled, cfg, 32)
    with torch.no_grad():
        for t, start, last in ((32, 0, 31), (8, 32, 0), (32, 30, 20)):  # tiles past a shorter call's rows: empty
            inputs = recipe.example_inputs(cfg, t, start, MAX, "v3")
            want = untiled(*inputs)[0][:, last : last + 1]
            assert torch.allclose(traced(*inputs, torch.tensor([last]))[0], want, atol=1e-5, rtol=0)
        inputs = recipe.example_inputs(cfg, 8, 40, MAX, "v3")
        assert torch.allclose(traced(*inputs)[0], untiled(*inputs)[0], atol=1e-5, rtol=0)  # the score graph
        with pytest.raises((RuntimeError, torch.jit.Error), match="no graph for this input shape"):
            traced(*recipe.example_inputs(cfg, 32, 48, MAX, "v3"))  # no score graph at 32


def test_prefill_scratch_of_the_26b_at_32k_fits_the_target() -> None:
    cfg = recipe.text_config_from_dict(GEMMA4_26B_A4B)
    common = dict(contract="v3", buckets=(128, 512), attn_quant="int8", kv_slots=1, decode_batches=(1,))
    sizes = recipe.residency(cfg, 2, "int8", 32768, **common)
    assert sizes["prefill_scratch_estimate"] <= 0.35e9
    parts = [sizes[f"prefill_scratch_{p}"] for p in ("logits", "attention", "activations")]
    assert sum(parts) == sizes["prefill_scratch_estimate"]
    assert sizes["prefill_scratch_logits"] == 4 * 262_144  # one row of f32 logits
    assert sizes["prefill_scratch_attention"] == 4 * 64 * (32768 + 512) * 17  # 16 heads + the mask, one tile of 64
    before = recipe.residency(cfg, 2, "int8", 32768, prefill_logits="all", query_tile=0, **common)
    assert before["prefill_scratch_estimate"] > 1.6e9  # every row's logits and [16, 512, ring] scores
    assert {65536, 131072} <= set(recipe.SLOT_TABLE_MAX_TOTAL)


def test_graph_json_without_the_record_is_every_row_prefill() -> None:
    old = {"contract": "gemma4-optb/v3", "max_total": 64, "prefill_buckets": [8, 16], "kv_slots": 2,
           "decode_batches": [1, 2], "sliding_window": 12, "ring_slots": {"sliding_attention": 28}}
    assert not GraphSpec.from_json(old).last_logits
    new = GraphSpec.from_json({**old, "prefill_logits": "last", "score_buckets": [8]})
    assert new.last_logits and new.score_buckets == (8,)
    assert GraphSpec.from_json(new.to_json()) == new
    with pytest.raises(ValueError, match="score graph at the smallest prefill bucket"):
        GraphSpec.from_json({**old, "prefill_logits": "last", "score_buckets": [16]})


@pytest.mark.parametrize("experts", ["dense", "selective"])
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_experts_in_groups_equal_one_pass(experts: str, quant: str) -> None:
    """8 experts 3 a pass (3, 3, 2) against all 8 at once, the same weights: every prefill row's logits agree to f32
    round-off, in a graph above the selective path's token limit (its dense path groups too); the passes ran."""
    cfg = recipe.text_config_from_dict(TINY)
    plan = recipe.Plan(contract="v4", buckets=(8, 16), kv_slots=2, decode_batches=(1, 2), max_total=128,
                       kv_blocks=24, block_size=16, context_buckets=(64, 128), experts=experts, quant=quant)
    whole = recipe.build_model(cfg, plan)
    recipe.randomize(whole)
    grouped = recipe.build_model(cfg, dataclasses.replace(plan, expert_group=3))
    grouped.load_state_dict(whole.state_dict())
    assert {layer.experts.group for layer in grouped.layers} == {3}
    inputs = recipe.example_inputs(cfg, 16, 20, 128, "v4", blocks_of=(24, 16))
    passes: list[slice | None] = []
    original = recipe.DenseExperts.expert_sum

    def record(self, hidden, weights, chosen):
        passes.append(chosen)
        return original(self, hidden, weights, chosen)

    with torch.no_grad(), mock.patch.object(recipe.DenseExperts, "expert_sum", record):
        expected = whole(*inputs)[0]  # [1, T, V]
        assert passes == [None] * TINY["num_hidden_layers"]  # one pass per layer, the weights unsliced
        passes.clear()
        got = grouped(*inputs)[0]
    assert passes == [slice(0, 3), slice(3, 6), slice(6, 9)] * TINY["num_hidden_layers"]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
