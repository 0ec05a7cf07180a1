"""The v4 projections (issue 34's Done-when) from the recipe's built-in 26B-A4B config, on the meta device."""

from __future__ import annotations

import pytest

from server.tools.bench.host import CONFIG_26B
from tests.support.recipe_helpers import load_recipe

DONE_WHEN = ((65536,), (32768, 4096, 4096, 4096))


@pytest.fixture(scope="module")
def recipe():
    return load_recipe()


@pytest.fixture(scope="module")
def cfg(recipe):
    return recipe.text_config_from_dict(recipe.CONFIG_26B)


def test_the_built_in_config_is_the_26b(recipe) -> None:
    drop = ("architectures", "_name_or_path")
    assert {k: v for k, v in CONFIG_26B.items() if k not in drop} == recipe.CONFIG_26B


def test_kv_by_need_fits_the_issue_mixes_with_int8_attention(recipe, cfg) -> None:
    table = recipe.pool_table(cfg, 2, "int8", (128, 512), mixes=DONE_WHEN)
    rows = {(r["attn_quant"], tuple(r["conversations"])): r for r in table["rows"]}
    sliding = 25 * 2 * 4 * (1024 + 512) * 256 * 2  # a row's rings per rank: 25 layers, K and V, 4 heads per rank
    per_position = 5 * 2 * 2 * 512 * 2  # global layers (replicated): 5 layers, K and V, 2 heads of 512
    for mix in DONE_WHEN:
        row = rows[("int8", mix)]
        blocks = 1 + sum(-(-n // 128) for n in mix)
        assert row["kv_blocks"] == blocks
        assert row["kv_cache"] == len(mix) * sliding + blocks * 128 * per_position  # exactly by need
        # what a v4 build's defaults hold (last-row prefill, query tiles) fits; every row untiled does not
        assert row["fits"] and row["bytes"] <= table["budget_bytes"]
        assert not row["unbounded_fits"] and row["unbounded_bytes"] > table["budget_bytes"]
    mixed = rows[("int8", DONE_WHEN[1])]
    assert mixed["kv_cache"] < 0.5 * mixed["v3_kv_cache"] and not mixed["v3_fits"]  # v3: four 32k slots
    assert not rows[("none", DONE_WHEN[0])]["fits"]  # bf16 attention: no


def test_v4_prefill_scratch_counts_its_graphs(recipe, cfg) -> None:
    """The 26B's v4 prefill scratch at 64k (tp 2, int8 attention, buckets 128,512, bf16 KV), term by term from the
    shapes: one row of f32 logits, one tile of 32 queries' f32 scores (16 heads) and mask over the 64k gathered
    keys, the 512 bucket's activations, and one global layer's gathered K and V (2 heads of 512, bf16)."""
    common = dict(contract="v4", buckets=(128, 512), attn_quant="int8", kv_slots=1, decode_batches=(1,),
                  kv_blocks=513, block_size=128, context_buckets=(4096, 8192, 16384, 32768, 65536))
    sizes = recipe.residency(cfg, 2, "int8", 65536, **common)
    assert recipe.default_query_tile("v4") == 32
    assert sizes["prefill_scratch_logits"] == 4 * 262_144
    assert sizes["prefill_scratch_attention"] == 4 * 32 * 65536 * 17
    assert sizes["prefill_scratch_activations"] == 4 * 512 * (3 * 2816 + 64 * 2 * 704)  # the routed experts' gate+up
    assert sizes["prefill_scratch_gathered"] == 65536 * 2 * 2 * 512 * 2
    assert sizes["prefill_scratch_estimate"] == sum(
        sizes[f"prefill_scratch_{p}"] for p in ("logits", "attention", "activations", "gathered"))
    untiled = recipe.residency(cfg, 2, "int8", 65536, prefill_logits="all", query_tile=0, **common)
    assert untiled["prefill_scratch_estimate"] > 5 * sizes["prefill_scratch_estimate"]


def test_decode_cost_follows_the_context(recipe, cfg) -> None:
    scenarios = (("8k", (8192,)), ("64k", (65536,)), ("mixed", (32768, 4096, 4096, 4096)))
    report = recipe.context_roofline(cfg, 2, "int8", "int8", (128, 512), scenarios=scenarios)
    by = {s["name"]: s for s in report["scenarios"]}
    short, long, mixed = (by[n][by[n]["best"]]["bytes_per_rank"] for n in ("8k", "64k", "mixed"))
    assert long - short == (65536 - 8192) * 20480  # only the global positions a row holds
    assert by["8k"]["v3"]["bytes_per_rank"] == by["64k"]["v3"]["bytes_per_rank"]  # v3 reads its whole slot
    assert mixed < by["mixed"]["one_call"]["bytes_per_rank"] or by["mixed"]["best"] == "one_call"
    assert mixed < by["mixed"]["v3"]["bytes_per_rank"]
