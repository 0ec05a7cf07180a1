"""Contract v4 end to end on CPU: KV paid by need (issue 34). The recipe's `--contract v4` build keeps the global
layers' KV in one pool of blocks read through a block table per row, and the sliding layers in per-row rings; the
host lends blocks by need (server/graphs/blocks.py `KVBlocks`). Token for token against transformers.

The tiny Gemma-4 (tests/support/models.py, vocab 262144, window 12) is built with blocks of 16 positions, context
buckets 64 and 256 (tables 4 and 16 blocks wide), 4 sliding rows and a pool of 24 blocks: a v3 build of the same
rows would reserve 4 x 256 positions (64 blocks); this one holds a 130-token conversation beside two short ones.
A small step loop plays the scheduler: rows take blocks as their positions reach them, decode together in one call
at the longest row's context bucket (a short row's table ends in the null block), run alone in the small bucket, and
give their blocks back when they end; a newcomer decodes in blocks another conversation wrote.

The build has v4's bounded prefill scratch (the defaults): prefill graphs return the last real row's logits
(`last_index`), a score graph at the smallest bucket and the largest context returns every row for scored prompts, and
the global layers attend in query tiles (`--query-tile 4`: 2 and 8 tiles a call, the CPU trace serving both buckets),
and the prefill's dense experts run a group at a time (`--expert-group 3`: 3 passes over the 8 experts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from server.engine.buckets import plan_chunks
from server.graphs.blocks import KVBlocks
from server.model.embedding import HostEmbedding
from tests.support.models import reference_model, tiny_gemma4_checkpoint
from tests.support.recipe_helpers import SCRIPT, load_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WINDOW, BUCKETS, SLOTS, BATCHES = 12, (8, 32), 4, (1, 2, 4)
BLOCK, CONTEXTS, POOL = 16, (64, 256), 24
TILE = 4  # query rows a tile: several tiles per prefill call of either bucket
GROUP = 3  # experts a pass of the prefill's dense experts: 3, 3 and 2 of the tiny model's 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("v4") / "checkpoint", sliding_window=WINDOW,
                                  bf16_table=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.nn.Module:
    return reference_model(checkpoint)


def build_args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
            "--contract", "v4", "--context-buckets", ",".join(map(str, CONTEXTS)), "--block-size", str(BLOCK),
            "--kv-blocks", str(POOL), "--prefill-buckets", ",".join(map(str, BUCKETS)), "--kv-slots", str(SLOTS),
            "--decode-batches", ",".join(map(str, BATCHES)), "--quant", "none", "--query-tile", str(TILE),
            "--expert-group", str(GROUP), *extra]


@pytest.fixture(scope="module")
def artifacts(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v4-art") / "artifacts"
    done = subprocess.run(build_args(checkpoint, out), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return out


@dataclass
class Runner:
    """The host's side of v4, as a scheduler will drive it: embeds, positions, slot ids and block tables."""

    model: torch.jit.ScriptModule
    embedding: HostEmbedding
    pool: KVBlocks

    def call(self, embeds: torch.Tensor, positions: torch.Tensor, slots: list[int], table: torch.Tensor,
             *last: torch.Tensor) -> torch.Tensor:
        out = self.model(embeds, positions, torch.tensor(slots, dtype=torch.int64), table, *last)
        return out[0] if isinstance(out, tuple | list) else out

    def prefill(self, slot: int, ids: list[int], start: int) -> int:
        """ids[start:] into row `slot` in bucket-planned chunks, each padded to its bucket (the graph returns the
        chunk's last real row, `last_index`); the next token."""
        begin, logits = start, None
        for length in plan_chunks(len(ids) - start, BUCKETS):
            bucket = min(b for b in BUCKETS if b >= length)
            self.pool.reserve(slot, begin + length)  # blocks for the real positions; pads past them hit null
            embeds = torch.zeros(1, bucket, self.embedding.table.shape[1])
            embeds[:, :length] = self.embedding.lookup(ids[begin : begin + length])
            context = self.pool.context_for(begin + length)
            logits = self.call(embeds, torch.arange(begin, begin + bucket)[None], [slot],
                               self.pool.table([slot], context), torch.tensor([length - 1]))[0, -1]  # [V]
            begin += length
        assert logits is not None
        return int(logits.argmax())

    def decode(self, rows: list[Conversation], context: int | None = None) -> list[int]:
        """One step over `rows`, rounded up to a compiled batch (spare rows shadow real ones one position ahead, in
        their own slot and blocks), at the longest row's context bucket unless given."""
        for conv in rows:
            self.pool.reserve(conv.slot, len(conv.ids))
        n = len(rows)
        batch = min(b for b in BATCHES if b >= n)
        of = [j % n for j in range(batch)]
        positions = torch.tensor([[len(rows[r].ids) - 1 + j // n] for j, r in enumerate(of)])  # [batch, 1]
        embeds = torch.zeros(batch, 1, self.embedding.table.shape[1])
        for i, conv in enumerate(rows):
            embeds[i] = self.embedding.lookup([conv.out[-1]])[0]
        context = context or self.pool.context_for(max(len(c.ids) for c in rows))
        slots = [rows[r].slot for r in of]
        logits = self.call(embeds, positions, slots, self.pool.table(slots, context))  # [batch, 1, V]
        return [int(logits[i, 0].argmax()) for i in range(n)]


@pytest.fixture(scope="module")
def model(artifacts: Path) -> torch.jit.ScriptModule:
    return torch.jit.load(str(artifacts / "model.pt"))


def runner_for(model: torch.jit.ScriptModule, artifacts: Path) -> Runner:
    config = json.loads((artifacts / "cfg" / "config.json").read_text())
    width = config.get("text_config", config)["hidden_size"]
    embedding = HostEmbedding.open(artifacts / "embed_tokens.pt", math.sqrt(width), torch.float32)
    return Runner(model, embedding, KVBlocks(POOL, BLOCK, CONTEXTS))


@dataclass
class Conversation:
    prompt: list[int]
    new_tokens: int
    slot: int = -1
    out: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.out


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(300, 250_000, (length - 1,), generator=generator).tolist()]


def expected(reference: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, top_k=None,
                                  top_p=None)[0, len(prompt):].tolist()


def test_artifact_declares_contract_v4(artifacts: Path) -> None:
    record = json.loads((artifacts / "graph.json").read_text())
    assert record["contract"] == "gemma4-optb/v4"
    assert (record["kv_blocks"], record["block_size"], record["context_buckets"]) == (POOL, BLOCK, list(CONTEXTS))
    assert record["max_total"] == max(CONTEXTS) and record["null_block"] == 0
    assert record["inputs"]["block_table"] == ["int32", ["B", "NBc"]]
    assert record["graphs"]["decode"]["NBc"] == [c // BLOCK for c in CONTEXTS]
    # global layers: the pool; sliding layers: one ring per row
    assert record["kv_cache"]["full_attention"][0] == POOL and record["kv_cache"]["full_attention"][2] == BLOCK
    assert record["kv_cache"]["sliding_attention"][0] == SLOTS
    # bounded prefill scratch: last-row prefill graphs, one score graph (smallest bucket, largest context), tiles
    assert (record["prefill_logits"], record["score_buckets"], record["query_tile"]) == ("last", [min(BUCKETS)], TILE)
    assert record["expert_group"] == GROUP
    assert record["inputs"]["last_index"] == ["int64", [1]]
    assert record["graphs"]["score"] == {"B": [1], "T": [min(BUCKETS)], "NBc": [max(CONTEXTS) // BLOCK]}


def test_query_tiles_over_the_gathered_blocks_equal_untiled_attention() -> None:
    """The recipe's v4 module with query tiles and last-row logits against the untiled every-row one (the same
    weights): each prefill's chosen row equals the full logits' row, in both context buckets, and the score graph's
    every row equals them too."""
    recipe = load_recipe()
    tiny = json.loads((SCRIPT.parents[2] / ".ci" / "tiny-gemma4-config.json").read_text())
    cfg = recipe.text_config_from_dict(tiny)
    plan = recipe.Plan(contract="v4", buckets=(8, 16), kv_slots=2, decode_batches=(1, 2), max_total=128,
                       kv_blocks=24, block_size=16, context_buckets=(64, 128))
    untiled = recipe.build_model(cfg, plan)
    recipe.randomize(untiled)
    tiled = recipe.build_model(cfg, dataclasses.replace(plan, query_tile=TILE, prefill_logits="last"))
    tiled.load_state_dict(untiled.state_dict())
    assert [getattr(layer.self_attn, "query_tile", 0) for layer in tiled.layers] == [0, TILE, 0, TILE]
    with torch.no_grad():
        for t, start, context, last in ((16, 0, 64, 15), (8, 16, 64, 3), (16, 100, 128, 9)):
            inputs = recipe.example_inputs(cfg, t, start, context, "v4", blocks_of=(24, 16))
            full = untiled(*inputs)[0]  # [1, T, V]
            torch.testing.assert_close(tiled.prefill(*inputs, torch.tensor([last]))[0], full[:, last : last + 1],
                                       rtol=0, atol=1e-5)
        inputs = recipe.example_inputs(cfg, 8, 40, 128, "v4", blocks_of=(24, 16))
        torch.testing.assert_close(tiled.score(*inputs)[0], untiled(*inputs)[0], rtol=0, atol=1e-5)


def test_short_and_long_rows_decoded_together_match_generate(model: torch.jit.ScriptModule, artifacts: Path,
                                                             reference: torch.nn.Module) -> None:
    """A 130-token conversation (9 blocks, 2 wraps of the sliding layers' 44-slot ring) beside a 40-token one and one
    that grows from the 64 bucket into the 256 one, in one decode batch (3 rows: a spare row too); then, its
    blocks freed, a newcomer decodes in them. 24 blocks hold it all: v3 would reserve 64."""
    runner = runner_for(model, artifacts)
    long, short, grows = Conversation(prompt_of(100, 1), 30), Conversation(prompt_of(10, 2), 30), \
        Conversation(prompt_of(45, 3), 25)
    running = [long, short, grows]
    for slot, conv in enumerate(running):
        conv.slot = slot
        conv.out.append(runner.prefill(slot, conv.prompt, 0))
    mixed_contexts = set()
    while running:
        mixed_contexts.add(tuple(sorted(runner.pool.context_for(len(c.ids)) for c in running)))
        for conv, token in zip(running, runner.decode(running), strict=True):
            conv.out.append(token)
        for conv in [c for c in running if len(c.out) >= c.new_tokens]:
            running.remove(conv)
            runner.pool.release(conv.slot)
    assert (64, 256, 256) in mixed_contexts and (64, 64, 256) in mixed_contexts  # short rows beside a long one
    assert runner.pool.in_use == 0 and len(runner.pool.free) == POOL - 1
    for conv in (long, short, grows):
        assert conv.out == expected(reference, conv.prompt, conv.new_tokens)

    # A newcomer in freed blocks (written by the conversations above): its own positions only, alone in bucket 64
    # while it fits, then 256.
    newcomer = Conversation(prompt_of(50, 4), 30, slot=3)
    newcomer.out.append(runner.prefill(3, newcomer.prompt, 0))
    while len(newcomer.out) < newcomer.new_tokens:
        newcomer.out += runner.decode([newcomer])
    assert newcomer.out == expected(reference, newcomer.prompt, newcomer.new_tokens)


def test_a_short_row_reads_the_same_in_any_context_bucket(model: torch.jit.ScriptModule, artifacts: Path) -> None:
    """The short row's logits at the 256 bucket (a table ending in 12 null blocks) equal those at its own 64 bucket:
    the context bucket costs reads, never changes what a row sees."""
    runner = runner_for(model, artifacts)
    conv = Conversation(prompt_of(20, 5), 3, slot=1)
    conv.out.append(runner.prefill(1, conv.prompt, 0))
    runner.pool.reserve(1, len(conv.ids))
    embeds = runner.embedding.lookup([conv.out[-1]])
    positions = torch.tensor([[len(conv.ids) - 1]])
    small = runner.call(embeds, positions, [1], runner.pool.table([1], 64))
    large = runner.call(embeds, positions, [1], runner.pool.table([1], 256))
    torch.testing.assert_close(small, large, rtol=1e-5, atol=1e-5)


def test_a_table_of_no_context_bucket_is_refused(model: torch.jit.ScriptModule, artifacts: Path) -> None:
    runner = runner_for(model, artifacts)
    embeds = torch.zeros(1, 1, runner.embedding.table.shape[1])
    with pytest.raises(Exception, match="block table"):
        runner.call(embeds, torch.tensor([[0]]), [0], torch.zeros(1, 5, dtype=torch.int32))


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-blocks", "1"], "kv_blocks must be >= 2"),
    (["--block-size", "24"], "multiple of the block size"),
    (["--expert-group", "-1"], "--expert-group must be >= 0"),
    (["--contract", "v3", "--kv-blocks", "8"], "--kv-blocks and --context-buckets need --contract v4"),
])
def test_bad_v4_flags_are_refused(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        load_recipe().parse_args(build_args(checkpoint, tmp_path / "out", *extra)[2:])
    assert message in capsys.readouterr().err


def test_the_engine_serves_a_v4_artifact(artifacts: Path, reference: torch.nn.Module) -> None:
    """Served: `load_host` reads v4's graph.json, `graph_loader` gives `JitGraphV4` (it lends the blocks), and the
    engine's scheduler runs a long and a short request at once; each gets transformers' greedy tokens, and the
    blocks of a finished conversation stay with its slot (its prefix, for a next turn) until a rewind frees them."""
    import asyncio

    from server.app.runtime import build_engine, graph_loader, load_host
    from server.engine.types import GenerationRequest
    from server.graphs.jit import JitGraphV4
    from server.sampling.params import SamplingParams

    host = load_host(artifacts, "jit")
    assert host.spec.v4 and host.spec.kv_blocks == POOL and host.spec.context_buckets == CONTEXTS
    graph = graph_loader(host)()
    assert isinstance(graph, JitGraphV4) and graph.slots == SLOTS
    assert graph.free_tokens() == (POOL - 1) * BLOCK
    del graph
    engine = build_engine(host)
    engine.start()
    prompts = {"long": prompt_of(90, 6), "short": prompt_of(12, 7)}
    scored = prompt_of(20, 8)  # echo + logprobs: the score graph, in pieces of the smallest bucket
    try:
        assert engine.wait_ready(120), engine.state_reason

        async def go():
            requests = [GenerationRequest(prompt_ids=tuple(p), max_new_tokens=12,
                                          sampling=SamplingParams(temperature=0.0)) for p in prompts.values()]
            requests.append(GenerationRequest(prompt_ids=tuple(scored), max_new_tokens=1, prompt_logprobs=1,
                                              sampling=SamplingParams(temperature=0.0)))
            return await asyncio.gather(*(engine.submit(r).result() for r in requests))

        *completions, scoring = asyncio.run(go())
    finally:
        engine.stop()
    with torch.inference_mode():  # transformers' own logprobs of each prompt token (its soft-cap included)
        want_logprobs = torch.log_softmax(reference(torch.tensor([scored])).logits[0].float(), dim=-1)  # [T, V]
    assert scoring.prompt_logprobs is not None and scoring.prompt_logprobs.first_token == scored[0]
    got = [entry.logprob for entry in scoring.prompt_logprobs.entries]
    want = [float(want_logprobs[i, token]) for i, token in enumerate(scored[1:])]
    assert [entry.token_id for entry in scoring.prompt_logprobs.entries] == scored[1:]
    assert got == pytest.approx(want, abs=2e-3)
    eos = set(host.structure.eos_token_ids)
    for prompt, completion in zip(prompts.values(), completions, strict=True):
        want = expected(reference, prompt, 12)
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert list(completion.token_ids) == want[:cut]


def test_a_pool_too_small_for_everyone_preempts_and_keeps_transformers_tokens(artifacts: Path,
                                                                             reference: torch.nn.Module) -> None:
    """The engine over the v4 build lending 8 of its blocks (128 positions) to 4 slots: three conversations that
    grow to 60-90 positions cannot all hold their KV, so the third prompt waits for blocks and the youngest running
    row is preempted and re-prefilled; each still gets transformers' greedy tokens. Decode is split by context
    bucket (a cost model whose weights are free: the 256-bucket row alone, the 64-bucket rows together). After,
    the pool lends only to idle slots' prefixes, and the engine's KV usage says so."""
    import asyncio

    from server.app.runtime import build_engine, graph_loader, load_host
    from server.engine.types import GenerationRequest
    from server.graphs.blocks import DecodeCost
    from server.graphs.jit import JitGraphV4
    from server.sampling.params import SamplingParams

    host = load_host(artifacts, "jit")
    calls: list[list[int]] = []

    def load() -> JitGraphV4:
        graph = graph_loader(host)()
        assert isinstance(graph, JitGraphV4)
        graph.pool = KVBlocks(9, BLOCK, CONTEXTS)  # the build holds 24; lend 8 of them
        graph.decode_cost = DecodeCost(weights=(0.0,), sliding_per_row=0.0, global_per_position=1.0)
        decode = graph.decode

        def counted(embeds: torch.Tensor, positions: torch.Tensor, slots: list[int], **kw: object) -> torch.Tensor:
            calls.append([graph.pool.context_for(int(p) + 1) for p in positions[:, 0].tolist()])
            return decode(embeds, positions, slots, **kw)  # type: ignore[arg-type]

        graph.decode = counted  # type: ignore[method-assign]
        return graph

    engine = build_engine(host, load=load)
    engine.start()
    prompts = {"long": (prompt_of(70, 8), 20), "short": (prompt_of(20, 9), 40), "third": (prompt_of(30, 10), 30)}
    try:
        assert engine.wait_ready(120), engine.state_reason

        async def go():
            requests = [GenerationRequest(prompt_ids=tuple(p), max_new_tokens=n, ignore_eos=True,
                                          sampling=SamplingParams(temperature=0.0)) for p, n in prompts.values()]
            handles = [engine.submit(r) for r in requests]
            return await asyncio.gather(*(h.result() for h in handles))

        completions = asyncio.run(go())
        records = list(engine.core.records.values())
        pool = engine.core.scheduler.pool
        assert pool is not None
        idle = sum(pool.held(slot.index) for slot in engine.core.scheduler.slots.free)
        usage = engine.kv_usage
    finally:
        engine.stop()
    assert sum(seq.preemptions for seq in records) >= 1  # the pool ran short: somebody gave its blocks back
    assert any(len(set(contexts)) > 1 for contexts in calls)  # rows of both buckets decoded in one step
    for (prompt, n), completion in zip(prompts.values(), completions, strict=True):
        assert completion.finish.error is None and completion.finish.completion_tokens == n
        want = expected(reference, prompt, n)
        eos = next((i for i, t in enumerate(want) if t in set(host.structure.eos_token_ids)), None)
        # transformers' generate stops at eos; past it, ignore_eos's tokens have no reference
        assert list(completion.token_ids)[: eos if eos is not None else n] == want[: eos if eos is not None else n]
    assert pool.in_use == idle and (usage.blocks, usage.blocks_in_use) == (8, idle) and usage.slots_in_use == 0
