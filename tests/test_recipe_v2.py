"""Contract v2 end to end on CPU: the recipe's `--contract v2` build served by `--graph jit`, token for token
against transformers.

The tiny Gemma-4 (tests/support/models.py, vocab 262144, sliding window 12) is built with two prefill buckets (8, 32) and
`--weights separate`, so one run proves the ring KV (44 slots for a window of 12), the indexed writes, the masks
built inside the graph, the bucket planning and the memory-mapped per-rank weights. Prompts of a few hundred
tokens cross the window and the buckets many times; a 3-turn chat diverges once inside the ring's reach (its
prefix is reused) and once beyond it (re-prefilled from 0), and the exact edge `rewind` reports is proven on
logits: continuing there matches transformers, one position earlier does not.

The artifact's table is bf16: the reference's (tied) embedding is rounded to bf16 first, so both sides see the
same rows and the same lm_head.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from server.app.runtime import Host, build_engine, graph_loader, load_host
from server.engine.buckets import plan_chunks
from server.engine.engine import Engine
from server.engine.types import Completion, Finish, GenerationRequest
from server.errors import ArtifactError
from server.graphs.jit import JitGraphV2
from server.model.artifacts import GraphSpec, validate
from server.sampling.params import SamplingParams
from tests.support.models import reference_model, tiny_gemma4_checkpoint
from tests.support.recipe_helpers import SCRIPT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WINDOW, BUCKETS, MAX = 12, (8, 32), 512
RING = WINDOW + max(BUCKETS)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the artifact's table is bf16 (tied: the lm_head too): the reference reads the same rows
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("v2") / "checkpoint", sliding_window=WINDOW,
                                  bf16_table=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.nn.Module:
    return reference_model(checkpoint)


def build(checkpoint: Path, out: Path, *extra: str) -> Path:
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
           "--contract", "v2", "--max-total", str(MAX), "--prefill-buckets", ",".join(map(str, BUCKETS)),
           "--quant", "none", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def artifacts(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(checkpoint, tmp_path_factory.mktemp("v2-art") / "artifacts", "--weights", "separate")


def start(host: Host) -> Engine:
    engine = build_engine(host)
    engine.start()
    assert engine.wait_ready(120), engine.state_reason
    return engine


@pytest.fixture(scope="module")
def served(artifacts: Path) -> Iterator[tuple[Host, Engine]]:
    host = load_host(artifacts, "jit")
    engine = start(host)
    yield host, engine
    engine.stop()


def run(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], Finish]:
    async def go() -> Completion:
        return await engine.submit(GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=n, sampling=GREEDY)).result()

    completion = asyncio.run(go())
    return completion.token_ids, completion.finish


def expected(reference: torch.nn.Module, prompt: list[int], n: int, eos: frozenset[int]) -> list[int]:
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, top_k=None,
                                 top_p=None)[0, len(prompt):].tolist()
    for index, token in enumerate(out):  # the engine stops at eos; generate() here does not
        if token in eos:
            return out[: index + 1]
    return out


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(300, 250_000, (length - 1,), generator=generator).tolist()]


def test_artifact_declares_contract_v2(artifacts: Path) -> None:
    record = json.loads((artifacts / "graph.json").read_text())
    assert record["contract"] == "gemma4-optb/v2"
    assert record["prefill_buckets"] == list(BUCKETS) and record["prefill_bucket"] == max(BUCKETS)
    assert record["kv_slots"] == {"sliding_attention": RING, "full_attention": MAX + max(BUCKETS)}
    assert record["weights"] == "separate"
    assert record["weight_files"] == ["weights/tp0_sharded_checkpoint.safetensors"]
    spec = GraphSpec.from_json(record)
    assert spec.v2 and spec.buckets == BUCKETS and spec.sliding_slots == RING and spec.sliding_window == WINDOW
    # The graph file holds no weights: the per-rank file does.
    assert (artifacts / "model.pt").stat().st_size < (artifacts / record["weight_files"][0]).stat().st_size / 10


@pytest.mark.parametrize("length", [300, 260, 7, 33])
def test_long_prompts_match_generate(served: tuple[Host, Engine], reference: torch.nn.Module, length: int) -> None:
    host, engine = served
    prompt = prompt_of(length, seed=length)
    ids, finish = run(engine, prompt, 10)
    assert ids == expected(reference, prompt, 10, frozenset(host.structure.eos_token_ids))
    # Fewest calls over buckets (8, 32): 300 -> 9 x 32 + 12; 260 -> 8 x 32 + 4 (on the 8-bucket); the BOS the
    # previous request left in the cache is reused.
    assert finish.prefill_calls == len(plan_chunks(length - finish.reused_tokens, BUCKETS))
    assert finish.prefill_calls == -(-(length - finish.reused_tokens) // max(BUCKETS))


def test_three_turn_chat_diverging_inside_and_beyond_the_ring(served: tuple[Host, Engine],
                                                              reference: torch.nn.Module) -> None:
    host, engine = served
    eos = frozenset(host.structure.eos_token_ids)
    first = prompt_of(220, seed=1)
    ids1, finish1 = run(engine, first, 12)
    assert ids1 == expected(reference, first, 12, eos)
    # Turn 2 re-sends the conversation and diverges 4 tokens into the answer: well inside the ring's reach.
    second = first + ids1[:4] + prompt_of(40, seed=2)[1:]
    ids2, finish2 = run(engine, second, 12)
    assert finish2.reused_tokens == len(first) + 4
    assert ids2 == expected(reference, second, 12, eos)
    # Turn 3 edits the conversation at position 100: the ring has since overwritten what a query there reads
    # (positions 89..99 are long gone from a 44-slot ring), so the graph sends the engine back to 0.
    third = first[:100] + prompt_of(90, seed=3)[1:]
    ids3, finish3 = run(engine, third, 12)
    assert finish3.reused_tokens == 0
    assert ids3 == expected(reference, third, 12, eos)


def embeds_of(host: Host, ids: list[int]) -> torch.Tensor:
    return host.embedding.lookup(ids)  # [1, T, H]


def test_rewind_edge_is_exact(artifacts: Path, reference: torch.nn.Module) -> None:
    """After writing up to position W_end, rewind(p) keeps p iff p - window + 1 > W_end - ring. At that edge the
    continuation matches transformers; one position earlier, continuing anyway reads an overwritten slot."""
    host = load_host(artifacts, "jit")
    spec = host.spec
    old = prompt_of(80, seed=5)

    def fresh_graph() -> JitGraphV2:
        graph = graph_loader(host)()
        assert isinstance(graph, JitGraphV2)
        for begin in range(0, len(old), 32):  # fills positions 0..95 (the last chunk padded to 32)
            chunk = old[begin : begin + 32]
            # last_only, as the engine prefills an unscored prompt: all rows would run a last-row build's score graph
            # (issue 34), at its smaller bucket, padding the last chunk less
            graph.forward(embeds_of(host, chunk), torch.arange(begin, begin + len(chunk))[None], last_only=True)
        return graph

    written = 95
    edge = written - spec.sliding_slots + spec.sliding_window  # smallest p with p - W + 1 > written - R
    graph = fresh_graph()
    assert graph.rewind(edge) == edge
    assert graph.rewind(edge - 1) == 0

    def continue_at(graph: JitGraphV2, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        new = old[:p] + prompt_of(9, seed=6)[1:]
        with torch.inference_mode():
            want = reference(torch.tensor([new])).logits[0, p:]  # [8, V], soft-capped
        got = graph.forward(embeds_of(host, new[p:]), torch.arange(p, len(new))[None])[0]  # [8, V]
        cap = host.structure.final_softcap
        return cap * torch.tanh(got / cap), want

    got, want = continue_at(fresh_graph(), edge)
    kept = (got - want).abs().max().item()
    got, want = continue_at(fresh_graph(), edge - 1)  # what rewind refused: the first query reads a stale slot
    stale = (got[0] - want[0]).abs().max().item()
    print(f"edge: max |logit diff| {kept:.2e}; one earlier: {stale:.2e}")
    assert kept < 2e-3  # f32 round-off over logits of magnitude ~10
    assert stale > 0.1


def test_unknown_contract_is_refused_at_start_up(artifacts: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(artifacts, copy)
    record = json.loads((copy / "graph.json").read_text())
    (copy / "graph.json").write_text(json.dumps({**record, "contract": "gemma4-optb/v9"}))
    with pytest.raises(ArtifactError, match=r"graph contract 'gemma4-optb/v9' is not one this server drives"):
        validate(copy, "jit")


def test_missing_rank_weights_are_named(artifacts: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(artifacts, copy)
    (copy / "weights" / "tp0_sharded_checkpoint.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"tp0_sharded_checkpoint.safetensors: missing"):
        validate(copy, "jit")


def test_loading_separate_weights_adds_no_anonymous_memory(artifacts: Path, tmp_path: Path) -> None:
    """Peak RssAnon while the graph loads (and takes one step) stays within 10% of the host's own baseline, although
    the weights (~70 MB here, a sixth of that baseline) would push it past that if they were read into memory.
    python -m server bench load measures it the same way on a model whose weights are a few GB (README)."""
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, "-m", "server", "bench", "load", "--artifacts", str(artifacts), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["graph_weight_file_mb"] > 0.1 * result["rss_anon_baseline_mb"]  # a copy would show
    assert result["peak_over_baseline"] <= 1.10, result
