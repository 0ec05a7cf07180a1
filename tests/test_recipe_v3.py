"""Contract v3 end to end on CPU: the recipe's `--contract v3` build (KV slots, batched decode) driven through
`JitGraphV3`'s protocol v3 (graphs/base.py `SlotGraph`) as a scheduler will drive it, token for token against
transformers.

The tiny Gemma-4 (tests/support/models.py, vocab 262144, sliding window 12) is built with S = 4 slots, decode batches
1, 2, 4, prefill buckets 8 and 32 and `--weights separate`. A small step loop in the test plays the scheduler:
conversations join (a prefill into a free slot) and leave between decode steps, so the decode batch runs at 1, 2, 3
(rounded up to the compiled 4: spare rows shadow real ones) and 4 rows; every row sits at its own position, several
cross the window and the buckets, one conversation comes back for a second turn and reuses its prefix in its own
slot, and freed slots are refilled by newcomers. Each conversation must produce exactly transformers' greedy tokens.

The artifact's table is bf16: the reference's (tied) embedding is rounded to bf16 first, so both sides see the
same rows and the same lm_head.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from server.app.runtime import Host, build_engine, graph_loader, load_host
from server.engine.buckets import plan_chunks
from server.engine.types import GenerationRequest
from server.graphs.jit import JitGraphV3
from server.model.artifacts import GraphSpec
from server.sampling.params import SamplingParams
from tests.support.models import reference_model, tiny_gemma4_checkpoint
from tests.support.recipe_helpers import SCRIPT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WINDOW, BUCKETS, MAX, SLOTS, BATCHES = 12, (8, 32), 256, 4, (1, 2, 4)
RING = WINDOW + max(BUCKETS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the artifact's table is bf16 (tied: the lm_head too): the reference reads the same rows
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("v3") / "checkpoint", sliding_window=WINDOW,
                                  bf16_table=True)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.nn.Module:
    return reference_model(checkpoint)


def build_args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--out", str(out), "--target", "cpu",
            "--contract", "v3", "--max-total", str(MAX), "--prefill-buckets", ",".join(map(str, BUCKETS)),
            "--kv-slots", str(SLOTS), "--decode-batches", ",".join(map(str, BATCHES)), "--quant", "none", *extra]


@pytest.fixture(scope="module")
def artifacts(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v3-art") / "artifacts"
    done = subprocess.run(build_args(checkpoint, out, "--weights", "separate"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def host(artifacts: Path) -> Host:
    return load_host(artifacts, "jit")


def fresh_graph(host: Host) -> JitGraphV3:
    graph = graph_loader(host)()
    assert isinstance(graph, JitGraphV3)
    return graph


def expected(reference: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, top_k=None,
                                  top_p=None)[0, len(prompt):].tolist()


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [2, *torch.randint(300, 250_000, (length - 1,), generator=generator).tolist()]


# --------------------------------------------------------------------------------------------------------------------
# The scheduler's side, played by the test: prefill into a slot, then decode every running row together
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Conversation:
    prompt: list[int]
    new_tokens: int
    join_step: int
    slot: int = -1
    out: list[int] = field(default_factory=list)
    batches: set[int] = field(default_factory=set)  # the decode batch sizes this conversation ran in

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.out


def prefill(graph: JitGraphV3, host: Host, conv: Conversation, start: int) -> int:
    """Prefill conv.ids[start:] into its slot in bucket-planned chunks; returns the first new token."""
    ids = conv.ids
    logits = None
    begin = start
    for length in plan_chunks(len(ids) - start, graph.prefill_buckets):
        chunk = ids[begin : begin + length]
        logits = graph.prefill(host.embedding.lookup(chunk), torch.arange(begin, begin + length)[None], conv.slot,
                               last_only=True)  # [1, 1, V]
        begin += length
    assert logits is not None
    return int(logits[0, -1].argmax())


def run_together(graph: JitGraphV3, host: Host, conversations: list[Conversation], *,
                 steps_cap: int = 400) -> None:
    """Admit each conversation at its join step into the lowest free slot, decode all running rows per step."""
    free = list(range(graph.slots))
    waiting = sorted(conversations, key=lambda c: c.join_step)
    running: list[Conversation] = []
    for step in range(steps_cap):
        while waiting and waiting[0].join_step <= step and free:
            conv = waiting.pop(0)
            conv.slot = free.pop(0)
            assert graph.rewind_slot(conv.slot, 0) == 0  # a reused slot starts over
            conv.out.append(prefill(graph, host, conv, 0))
            running.append(conv)
        for conv in [c for c in running if len(c.out) >= c.new_tokens]:
            running.remove(conv)
            free.append(conv.slot)
            free.sort()
        if not running:
            if not waiting:
                return
            continue
        embeds = torch.cat([host.embedding.lookup([c.out[-1]]) for c in running])  # [B, 1, H]
        positions = torch.tensor([[len(c.ids) - 1] for c in running])  # [B, 1]: each row at its own position
        logits = graph.decode(embeds, positions, [c.slot for c in running])  # [B, V]
        assert logits.shape == (len(running), host.structure.vocab_size)
        for conv, row in zip(running, logits, strict=True):
            conv.batches.add(len(running))
            conv.out.append(int(row.argmax()))
    raise AssertionError("the conversations did not finish")


def test_artifact_declares_contract_v3(artifacts: Path) -> None:
    record = json.loads((artifacts / "graph.json").read_text())
    assert record["contract"] == "gemma4-optb/v3"
    assert record["kv_slots"] == SLOTS and record["decode_batches"] == list(BATCHES)
    assert record["prefill_buckets"] == list(BUCKETS)
    assert record["ring_slots"] == {"sliding_attention": RING, "full_attention": MAX + max(BUCKETS)}
    # tiny: 2 sliding kv heads of 16, 1 global kv head of 32 (k_eq_v), one ring per slot
    assert record["kv_cache"]["sliding_attention"] == [SLOTS, 2, RING, 16]
    assert record["kv_cache"]["full_attention"] == [SLOTS, 1, MAX + max(BUCKETS), 32]
    assert record["inputs"]["slot_ids"] == ["int64", ["B"]]
    # 8 experts, top-2: gathering is cheaper while B * 2 < 8
    assert record["decode_experts"] == {"1": "selective", "2": "selective", "4": "dense"}
    spec = GraphSpec.from_json(record)
    assert spec.v3 and spec.kv_slots == SLOTS and spec.decode_batches == BATCHES
    assert spec.sliding_slots == RING and spec.sliding_window == WINDOW and spec.buckets == BUCKETS
    assert spec.to_json()["kv_slots"] == SLOTS


def test_four_conversations_decoded_together_match_generate(host: Host, reference: torch.nn.Module) -> None:
    graph = fresh_graph(host)
    assert (graph.slots, graph.decode_batches, graph.prefill_buckets) == (SLOTS, BATCHES, BUCKETS)
    first = [
        Conversation(prompt_of(7, seed=1), 30, join_step=0),  # short prompt: its decode crosses the window
        Conversation(prompt_of(45, seed=2), 14, join_step=0),  # a 32 chunk + an 8-bucket chunk (padded), past W
        Conversation(prompt_of(70, seed=3), 20, join_step=3),  # joins a running batch; 3 rows -> the 4 graph
        Conversation(prompt_of(20, seed=4), 9, join_step=5),
        Conversation(prompt_of(33, seed=5), 12, join_step=6),  # waits for a free slot, refills one another left
    ]
    run_together(graph, host, first)
    for conv in first:
        assert conv.out == expected(reference, conv.prompt, conv.new_tokens), conv.prompt[:3]
    assert set().union(*(c.batches for c in first)) >= {1, 2, 3, 4}
    assert len({c.slot for c in first}) < len(first)  # a slot was rewound and refilled


def test_second_turn_reuses_its_prefix_in_its_own_slot(host: Host, reference: torch.nn.Module) -> None:
    graph = fresh_graph(host)
    talk = Conversation(prompt_of(40, seed=7), 10, join_step=0)
    others = [Conversation(prompt_of(25, seed=8), 16, join_step=0), Conversation(prompt_of(9, seed=9), 16, join_step=1)]
    run_together(graph, host, [talk, *others])
    assert talk.out == expected(reference, talk.prompt, 10)
    # Turn 2 re-sends the conversation and diverges 4 tokens into the answer, in the slot it had.
    keep = len(talk.prompt) + 4
    assert graph.rewind_slot(talk.slot, keep) == keep  # inside the ring's reach: nothing recomputed
    turn2 = Conversation(talk.prompt + talk.out[:4] + prompt_of(30, seed=10)[1:], 12, join_step=0, slot=talk.slot)
    turn2.out.append(prefill(graph, host, turn2, keep))  # only the new tokens are prefilled
    # ... then decodes beside another conversation that carries on in its own slot from its last token (its KV
    # untouched by the second turn's prefill), which leaves after 6 more tokens.
    other = others[0]
    more = Conversation(other.ids, 0, join_step=0, slot=other.slot)  # its next input: other.out[-1]
    more_tokens = 6
    for _ in range(turn2.new_tokens - 1):
        rows = [turn2] + ([more] if len(more.out) < more_tokens else [])
        embeds = torch.cat([host.embedding.lookup([c.ids[-1]]) for c in rows])  # [B, 1, H]
        positions = torch.tensor([[len(c.ids) - 1] for c in rows])  # [B, 1]
        logits = graph.decode(embeds, positions, [c.slot for c in rows])  # [B, V]
        for conv, row in zip(rows, logits, strict=True):
            conv.out.append(int(row.argmax()))
    assert turn2.out == expected(reference, turn2.prompt, turn2.new_tokens)
    assert other.out + more.out == expected(reference, other.prompt, other.new_tokens + more_tokens)


def test_a_poisoned_slot_leaks_into_no_other(host: Host, reference: torch.nn.Module) -> None:
    """Slot 3's K and V are NaN in every layer. Attention adds its mask to the scores, and a masked NaN is still
    NaN: if any row read slot 3 at all, even at a masked position, its logits would not be finite."""
    graph = fresh_graph(host)
    with torch.no_grad():
        poisoned = 0
        for name, buf in graph.module.named_buffers():
            if name.endswith(("k_cache", "v_cache")):
                buf[3] = float("nan")  # [kvh, R, D] of slot 3
                poisoned += 1
        assert poisoned == 2 * len(host.structure.layer_types)
    convs = [Conversation(prompt_of(n, seed=20 + n), 15, join_step=0) for n in (30, 11, 50)]
    run_together_on(graph, host, convs, slots=[0, 1, 2])  # 3 rows: the 4-row graph with one spare row
    for conv in convs:
        assert conv.out == expected(reference, conv.prompt, conv.new_tokens)
    for name, buf in graph.module.named_buffers():
        if name.endswith(("k_cache", "v_cache")):
            assert torch.isfinite(buf[:3]).all(), name  # spare rows wrote into the real rows' slots only
            assert torch.isnan(buf[3]).all(), name  # and never into the poisoned one
    # Slot 3 rewound and refilled over stale garbage (large but finite, as real stale KV is): the new conversation
    # sees only what it wrote, beside slot 0 carrying on.
    with torch.no_grad():
        for name, buf in graph.module.named_buffers():
            if name.endswith(("k_cache", "v_cache")):
                buf[3] = 1e4 * torch.randn(buf[3].shape, generator=torch.Generator().manual_seed(len(name)))
    assert graph.rewind_slot(3, 0) == 0
    fresh = Conversation(prompt_of(41, seed=60), 14, join_step=0, slot=3)
    fresh.out.append(prefill(graph, host, fresh, 0))
    carry = Conversation(convs[0].ids, 0, join_step=0, slot=convs[0].slot)  # its next input: convs[0].out[-1]
    while len(fresh.out) < fresh.new_tokens:
        rows = [fresh, carry]
        embeds = torch.cat([host.embedding.lookup([c.ids[-1]]) for c in rows])  # [2, 1, H]
        positions = torch.tensor([[len(c.ids) - 1] for c in rows])  # [2, 1]
        for conv, row in zip(rows, graph.decode(embeds, positions, [c.slot for c in rows]), strict=True):
            conv.out.append(int(row.argmax()))
    assert fresh.out == expected(reference, fresh.prompt, fresh.new_tokens)
    assert len(carry.out) == fresh.new_tokens - 1
    assert convs[0].out + carry.out == expected(reference, convs[0].prompt, convs[0].new_tokens + len(carry.out))


def run_together_on(graph: JitGraphV3, host: Host, convs: list[Conversation], slots: list[int]) -> None:
    for conv, slot in zip(convs, slots, strict=True):
        conv.slot = slot
        conv.out.append(prefill(graph, host, conv, 0))
    while any(len(c.out) < c.new_tokens for c in convs):
        rows = [c for c in convs if len(c.out) < c.new_tokens]
        embeds = torch.cat([host.embedding.lookup([c.out[-1]]) for c in rows])  # [B, 1, H]
        positions = torch.tensor([[len(c.ids) - 1] for c in rows])  # [B, 1]
        logits = graph.decode(embeds, positions, [c.slot for c in rows])  # [B, V]
        assert torch.isfinite(logits).all()
        for conv, row in zip(rows, logits, strict=True):
            conv.out.append(int(row.argmax()))


def test_batched_rows_equal_single_rows(host: Host) -> None:
    """The same decode step as one B = 4 call and as four B = 1 calls: the same logits per row to round-off."""
    graph = fresh_graph(host)
    prompts = [prompt_of(n, seed=30 + n) for n in (14, 27, 40, 61)]
    for slot, prompt in enumerate(prompts):
        conv = Conversation(prompt, 1, join_step=0, slot=slot)
        prefill(graph, host, conv, 0)
    tokens = [p[-1] for p in prompts]
    embeds = torch.cat([host.embedding.lookup([t]) for t in tokens])  # [4, 1, H]
    positions = torch.tensor([[len(p)] for p in prompts])  # [4, 1]
    batched = graph.decode(embeds, positions, [0, 1, 2, 3])  # [4, V]
    for slot in range(4):  # rewrites the same position with the same token: the same cache
        single = graph.decode(embeds[slot : slot + 1], positions[slot : slot + 1], [slot])  # [1, V]
        torch.testing.assert_close(single[0], batched[slot], atol=1e-4, rtol=1e-4)
    three = graph.decode(embeds[1:], positions[1:], [1, 2, 3])  # [3, V] on the 4-row graph
    torch.testing.assert_close(three, batched[1:], atol=1e-4, rtol=1e-4)


def test_rewind_slot_is_per_slot(host: Host) -> None:
    graph = fresh_graph(host)
    for slot, length in ((0, 96), (1, 20)):
        conv = Conversation(prompt_of(length, seed=40 + slot), 1, join_step=0, slot=slot)
        prefill(graph, host, conv, 0)
    # Slot 0 wrote up to 95: a rewind to p survives iff p - W + 1 > 95 - R; slot 1 (one padded 32-chunk: up to 31,
    # not wrapped) keeps everything.
    edge = 95 - RING + WINDOW
    assert graph.rewind_slot(1, 10) == 10
    assert graph.rewind_slot(0, edge) == edge
    assert graph.rewind_slot(0, edge - 1) == 0
    assert graph.rewind_slot(1, 5) == 5  # slot 0's reset left slot 1 alone
    with pytest.raises(ValueError, match="slots must be distinct"):
        graph.decode(torch.zeros(2, 1, 64), torch.tensor([[3], [4]]), [1, 1])
    with pytest.raises(ValueError, match="slots must be distinct"):
        graph.rewind_slot(SLOTS, 0)
    with pytest.raises(ValueError, match="largest compiled decode batch"):
        graph.decode(torch.zeros(5, 1, 64), torch.zeros(5, 1, dtype=torch.long), [0, 1, 2, 3, 4])


def test_today_engine_serves_a_v3_artifact_on_slot_zero(host: Host, reference: torch.nn.Module) -> None:
    """The engine of today calls forward/rewind: a v3 graph serves it as a one-slot graph (its slot 0)."""
    engine = build_engine(host)
    engine.start()
    try:
        assert engine.wait_ready(120), engine.state_reason
        prompt = prompt_of(50, seed=50)

        async def go():
            request = GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=10,
                                        sampling=SamplingParams(temperature=0.0))
            return await engine.submit(request).result()

        completion = asyncio.run(go())
    finally:
        engine.stop()
    want = expected(reference, prompt, 10)
    eos = set(host.structure.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
    assert list(completion.token_ids) == want[:cut]


@pytest.mark.parametrize(("extra", "message"), [
    (["--contract", "v2", "--kv-slots", "2"], "--kv-slots and --decode-batches need --contract v3"),
    (["--decode-batches", "1,8"], "exceeds the 4 KV slots"),
])
def test_bad_v3_flags_are_refused(checkpoint: Path, tmp_path: Path, extra: list[str], message: str) -> None:
    done = subprocess.run([*build_args(checkpoint, tmp_path / "out"), *extra], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
