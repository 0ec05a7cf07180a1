"""`python -m server bench` runs end to end and reports every figure (the numbers themselves are not asserted:
speed is proven by running the benchmark, not by timed unit tests). Structural facts are asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server.sampling.params import SamplingParams
from server.tools.bench.host import CONFIG_26B, full_sort_top_p
from tests.support.configs import GEMMA4_26B_A4B
from tests.support.gemma4_tokenizer import gemma4_cfg_dir
from tests.support.models import cache_root
from tests.support.sampling_reference import GEMMA4_SOFTCAP, chi_square_ok, reference_probs
from tests.support.vision import tiny_vision_checkpoint, vision_export

KEYS = {
    "host_overhead_ms_per_token_p50", "host_overhead_ms_per_token_p99",
    "host_overhead_ms_per_token_p50_greedy", "host_overhead_ms_per_token_p99_greedy",
    "ttft_host_overhead_ms_p50", "sampling_ms_default", "sampling_ms_full_sort_top_p", "sampling_ms_greedy",
    "ready_s_without_graph", "rss_mb_ready", "prefill_calls_turn3", "prefill_calls_turn3_no_reuse",
    "host_cpu_ms_per_token", "ready_s_without_graph_first_start", "device_step_ms_measured",
    "floor_ms_call_and_logits_pass_hot", "floor_ms_call_and_logits_pass_after_idle",
    # The grammar vocabulary (issue 22): built with the server, from its cached token table on a later start.
    "constraint_vocab_build_s", "constraint_vocab_build_s_cached", "first_constrained_ms_after_ready",
    "rss_mb_grammar_built",
    # A step's sampled rows together vs row by row (issue 35): 4 rows at V = 262,144, default and top-p alone.
    "sampling_ms_4_rows_batched", "sampling_ms_4_rows_by_row", "sampling_ms_4_rows_top_p_batched",
    "sampling_ms_4_rows_top_p_by_row",
}


@pytest.mark.slow
def test_bench_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "server", "bench", "--tokens", "24", "--json", str(out), "--cache-dir", str(cache_root())],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results  # the last line printed is the JSON
    missing = KEYS - set(results)
    assert not missing, missing
    assert all(math.isfinite(v) for v in results.values() if isinstance(v, float))
    # Prefix reuse: turn 3 prefills only its new tokens, ceil(new / BUCKET) calls, fewer than without reuse.
    assert results["prefill_calls_turn3"] == results["turn3_expected_calls"]
    assert results["prefill_calls_turn3"] < results["prefill_calls_turn3_no_reuse"]
    assert results["turn3_reused_tokens"] > 0
    # The per-token overhead subtracts the step the server measured (its /metrics), which a sleep only overshoots.
    assert results["device_step_ms_measured"] >= results["device_step_ms_simulated"]
    # The real-size table is memory-mapped, not read: resident memory stays below the table's 1.48 GB.
    assert results["rss_mb_ready"] < 1400


def test_bench_measures_at_the_published_26b_shapes() -> None:
    """The bench's stand-in config is the published build's, as the tests record it (not taken from the bench)."""
    assert {**CONFIG_26B, "_name_or_path": None} == {**GEMMA4_26B_A4B, "_name_or_path": None}


@pytest.mark.slow
def test_bench_constraints_runs_alone_on_a_tokenizer_dir(tmp_path: Path) -> None:
    """`python -m server bench constraints CFG_DIR`: the mask's cost on that tokenizer, the tool-call case included on
    a Gemma-4-format one; the same report (a table, then the JSON line, also written to --json)."""
    out = tmp_path / "constraints.json"
    done = subprocess.run([sys.executable, "-m", "server", "bench", "constraints", str(gemma4_cfg_dir()), "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results
    for case in ("json_schema", "json_object", "tool_call"):
        assert results[f"constraint_mask_ms_p50_{case}"] > 0, (case, sorted(results))


CONCURRENCY_KEYS = {"aggregate_tok_s", "itl_ms_p50", "itl_ms_p99", "late_ttft_ms", "late_ttft_steps", "device_step_ms",
                    "host_ms_per_step", "host_ms_per_step_per_row", "host_share_of_step"}


@pytest.mark.slow
def test_bench_concurrency_reports_by_stream_count(tmp_path: Path) -> None:
    """`bench --concurrency 1,2`: the null graph with roofline step times, every figure per stream count and sampling
    (keyed by the count, as the JSON says), and the late arrival's first token within its prefill and two steps."""
    out = tmp_path / "concurrency.json"
    done = subprocess.run([sys.executable, "-m", "server", "bench", "--concurrency", "1,2", "--tokens", "8", "--json",
                           str(out), "--cache-dir", str(cache_root())], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results
    assert "roofline" in results["graph"]
    for count in ("1", "2"):
        for sampling in ("greedy", "default"):
            row = results[count][sampling]
            assert set(row) >= CONCURRENCY_KEYS, (count, sampling, sorted(row))
            assert all(math.isfinite(v) for v in row.values())
            assert 1 <= row["late_ttft_steps"] <= 3  # its prefill, after at most the step running and one more
    assert results["1"]["greedy"]["aggregate_vs_one_stream"] == 1.0
    # The roofline's batch of 2 takes longer than a batch of 1 (a device step, slept by the null graph).
    assert results["2"]["greedy"]["device_step_ms"] > results["1"]["greedy"]["device_step_ms"]


def test_the_benchs_full_sort_baseline_samples_the_reference_distribution() -> None:
    """`sampling_ms_full_sort_top_p` times a real sampler: the bench's naive baseline draws from the tests' own
    reference distribution (tests/support/sampling_reference.py), and greedy with a bias picks the biased token."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    params = SamplingParams(top_k=3, top_p=0.9)
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([full_sort_top_p(logits, params, g, GEMMA4_SOFTCAP) for _ in range(4000)])
    assert chi_square_ok(torch.bincount(tokens, minlength=5), reference_probs(logits, params, GEMMA4_SOFTCAP))
    greedy = SamplingParams(temperature=0.0, logit_bias=((4, 10.0),))
    assert full_sort_top_p(logits, greedy, g, GEMMA4_SOFTCAP) == 4


@pytest.mark.slow
def test_bench_prefill_times_one_long_prompt_in_chunks(tmp_path: Path) -> None:
    """`bench prefill --artifacts DIR`: one prompt of --tokens ids prefilled in the export's chunks, --repeat times;
    the same report (a table, then the JSON line, also written to --json)."""
    from server.tools.export import export
    from tests.support.models import tiny_gemma4_checkpoint

    artifacts = export(tiny_gemma4_checkpoint(tmp_path / "checkpoint"), tmp_path / "artifacts", prefill_bucket=128,
                       max_total=512, dtype="float32")
    # A prompt the context cannot hold (with room for one generated token) is refused by name, before any loading.
    refused = subprocess.run([sys.executable, "-m", "server", "bench", "prefill", "--artifacts", str(artifacts),
                              "--tokens", "512"], capture_output=True, text=True, timeout=900)
    assert refused.returncode != 0 and "at most 511 prompt tokens" in refused.stderr
    out = tmp_path / "prefill.json"
    done = subprocess.run([sys.executable, "-m", "server", "bench", "prefill", "--artifacts", str(artifacts), "--tokens",
                           "400", "--repeat", "1", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results
    assert (results["prompt_tokens"], results["prefill_bucket"], results["chunks"]) == (400, 128, 4)
    assert len(results["seconds"]) == 1 and results["median_s"] > 0 and results["prompt_tok_per_s"] > 0


@pytest.mark.slow
def test_bench_fairness_reports_each_scenario(tmp_path: Path) -> None:
    """`bench fairness` with small prompts (the newcomers 256/128/16, a 128-token scored prompt), as built only: every
    scenario's gaps, and the smallest newcomer first, within its own prefill plus two steps."""
    out = tmp_path / "fairness.json"
    done = subprocess.run([sys.executable, "-m", "server", "bench", "fairness", "--scenarios", "newcomers,scored",
                           "--newcomers", "256,128,16", "--scored", "128", "--no-compare", "--json", str(out),
                           "--cache-dir", str(cache_root())], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results
    assert "roofline" in results["graph"] and "before" not in results
    for name in ("newcomers", "scored"):
        row = results["now"][name]
        assert row["gaps"] > 0 and 0 < row["gap_ms_p50"] <= row["gap_ms_p99"] <= row["gap_ms_max"], (name, row)
    newcomers = results["now"]["newcomers"]
    assert newcomers["order"][0] == 16
    assert newcomers["ttft_ms_16"] <= newcomers["ttft_bound_ms_16"]


def test_bench_soak_runs_a_mixed_load_and_frees_every_slot(tmp_path: Path) -> None:
    """`python -m server bench soak --seconds S`: the mixed HTTP load on the null graph (here for seconds, on a tiny
    vision Gemma-4's `export --vision host`: the Gemma-4 tokenizer and template, tool calls included, and a vision
    tower the host runs for the images); every kind of request ran, all answered 200, the streams were timed, the
    cancelled requests' slots were freed, the RSS and its two parts were sampled, and the report is the usual table
    then JSON line."""
    artifacts = vision_export(tiny_vision_checkpoint(), tmp_path / "artifacts", prefill_bucket=128, max_total=1024)
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "server", "bench", "--cache-dir", str(cache_root()), "soak", "--seconds", "8",
         "--clients", "4", "--sample-s", "1", "--artifacts", str(artifacts), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == results
    kinds = json.loads(results["soak_requests_by_kind"])
    assert set(kinds) == {"chat", "tools", "json", "responses", "messages", "image", "cancel", "probe", "routes"}, kinds
    assert results["soak_left_out"] == "none"
    statuses = json.loads(results["soak_responses_by_status"])
    assert results["soak_5xx"] == 0 and set(statuses) == {"200"}, results["soak_first_refusals"]
    assert results["soak_cancelled"] == kinds["cancel"] > 0
    assert results["soak_requests_running_after"] == 0 and results["soak_kv_slots_in_use_after"] == 0
    assert 0 < results["soak_ttft_ms_p50"] <= results["soak_ttft_ms_p99"]
    assert 0 < results["soak_itl_ms_p50"] <= results["soak_itl_ms_p99"]
    assert "soak rss_mb t=" in done.stdout and results["soak_rss_mb_last"] > 0
    # VmRSS is its heap and its mapped files: each part sampled, each within the whole
    assert 0 < results["soak_rss_anon_mb_last"] < results["soak_rss_mb_last"]
    assert 0 < results["soak_rss_file_mb_last"] < results["soak_rss_mb_last"]
    assert {"soak_rss_anon_slope_mb_per_min_last_two_thirds", "soak_rss_file_slope_mb_per_min_last_two_thirds"} <= set(
        results)
