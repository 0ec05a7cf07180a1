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
    """The 26B's v4 prefill scratch (tp 2, int8 attention, buckets 128,512, bf16 KV), term by term from the shapes.
    The largest graph is the score graph at the 128 bucket: every row's f32 logits, one tile of 16 queries' f32 scores
    (16 heads) and mask over the gathered keys, its rows' activations with the dense experts 16 a pass, and one global
    layer's gathered K and V (2 heads of 512, bf16). 32k is within issue 34's 0.35 GB."""
    contexts = (4096, 8192, 16384, 32768, 65536)
    assert (recipe.default_query_tile("v4"), recipe.default_expert_group("v4")) == (16, 16)
    assert (recipe.default_expert_group("v3"), recipe.default_expert_group("v1")) == (0, 0)
    for context in (32768, 65536):
        common = dict(contract="v4", buckets=(128, 512), attn_quant="int8", kv_slots=1, decode_batches=(1,),
                      kv_blocks=513, block_size=128, context_buckets=contexts[: contexts.index(context) + 1])
        sizes = recipe.residency(cfg, 2, "int8", context, **common)
        assert sizes["prefill_scratch_logits"] == 4 * 128 * 262_144
        assert sizes["prefill_scratch_attention"] == 4 * 16 * context * 17
        assert sizes["prefill_scratch_activations"] == 4 * 128 * (3 * 2816 + 16 * 2 * 704)  # 16 experts' gate+up
        assert sizes["prefill_scratch_gathered"] == context * 2 * 2 * 512 * 2
        assert sizes["prefill_scratch_estimate"] == sum(
            sizes[f"prefill_scratch_{p}"] for p in ("logits", "attention", "activations", "gathered"))
        assert sizes["prefill_experts_partials"] == 4 * 512 * 16 * 2816  # one pass's [T, 16, H] before the sum
        # one pass of all 64 local experts: the 512 bucket's [512, 64, 1408] gate+up is the largest term
        whole = recipe.residency(cfg, 2, "int8", context, expert_group=0, **common)
        assert whole["prefill_scratch_activations"] == 4 * 512 * (3 * 2816 + 64 * 2 * 704)
        assert whole["prefill_scratch_estimate"] > sizes["prefill_scratch_estimate"]
        if context == 32768:
            assert sizes["prefill_scratch_estimate"] <= 0.35e9 < whole["prefill_scratch_estimate"]
        untiled = recipe.residency(cfg, 2, "int8", context, prefill_logits="all", query_tile=0, expert_group=0,
                                   **common)
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
