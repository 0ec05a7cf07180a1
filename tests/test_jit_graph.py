"""The compiled-graph contract, driven through the production path: torch.jit.save -> JitGraph (torch.jit.load).

The TorchScript modules here are written in the test: one asserts every contract input (shapes, dtypes,
one-hot slots, both masks, the sliding-window edge) and keeps a real KV cache written through the one-hot
matrix, so padding and prefix reuse are proven against a plain-Python reference; one exposes
`nxd_model.initialize_with_saved_weights` like a Neuron SPMD model and records that it was called.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.graphs.jit import ContractInputs, JitGraph
from server.model.artifacts import GraphSpec

MAX, BUCKET, WINDOW, HIDDEN, VOCAB = 64, 8, 5, 16, 50
NEG = torch.finfo(torch.float32).min


class ContractChecker(torch.nn.Module):
    """Checks the inputs, writes KV through `onehot`, attends with both masks (uniform weights)."""

    def __init__(self, max_total: int, window: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.max_total = max_total
        self.window = window
        self.neg = float(torch.finfo(torch.float32).min)  # TorchScript has no torch.finfo
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("kv", torch.zeros(max_total, hidden))  # [MAX, H], slot = absolute position
        self.register_buffer("proj", torch.randn(hidden, vocab, generator=generator))  # [H, V]
        self.register_buffer("shapes_seen", torch.zeros(2, dtype=torch.long))  # calls with T=1, T=BUCKET

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, onehot: torch.Tensor,
                full_mask: torch.Tensor, sliding_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = embeds.shape[1]
        torch._assert(t == 1 or t == 8, "T must be 1 (decode) or the bucket (prefill)")
        torch._assert(embeds.dtype == torch.float32, "inputs_embeds f32")
        torch._assert(position_ids.dtype == torch.int64, "position_ids int64")
        torch._assert(onehot.dtype == torch.float32 and full_mask.dtype == torch.float32, "f32 masks")
        torch._assert(sliding_mask.dtype == torch.float32, "f32 sliding mask")
        torch._assert(embeds.shape[0] == 1 and embeds.shape[2] == self.kv.shape[1], "embeds [1,T,H]")
        torch._assert(position_ids.shape == (1, t), "position_ids [1,T]")
        torch._assert(onehot.shape == (1, 1, self.max_total, t), "onehot [1,1,MAX,T]")
        torch._assert(full_mask.shape == (1, 1, t, self.max_total), "full_mask [1,1,T,MAX]")
        torch._assert(sliding_mask.shape == (1, 1, t, self.max_total), "sliding_mask [1,1,T,MAX]")
        pos = position_ids[0]  # [T]
        slots = torch.arange(self.max_total)  # [MAX]
        neg = self.neg
        want_onehot = (slots[:, None] == pos[None, :]).float()  # [MAX, T]
        torch._assert(torch.equal(onehot[0, 0], want_onehot), "onehot[s,t] = 1 iff s == position_ids[t]")
        seen = slots[None, :] <= pos[:, None]  # [T, MAX]
        want_full = torch.where(seen, 0.0, neg)
        torch._assert(torch.equal(full_mask[0, 0], want_full), "full_mask: 0 where s <= p, else finfo.min")
        want_sliding = torch.where(seen & (slots[None, :] > pos[:, None] - self.window), 0.0, neg)
        torch._assert(torch.equal(sliding_mask[0, 0], want_sliding), "sliding_mask: 0 where p-W < s <= p")
        if t == 1:
            self.shapes_seen[0] += 1
        else:
            self.shapes_seen[1] += 1

        written = onehot[0, 0].sum(1, keepdim=True)  # [MAX, 1]
        self.kv.copy_(self.kv * (1.0 - written) + onehot[0, 0] @ embeds[0])  # [MAX, H], in place like the device
        attend_full = torch.softmax(full_mask[0, 0], dim=-1)  # [T, MAX] uniform over s <= p
        attend_sliding = torch.softmax(sliding_mask[0, 0], dim=-1)  # [T, MAX] uniform over the window
        hidden = attend_full @ self.kv + 2.0 * (attend_sliding @ self.kv)  # [T, H]
        logits = (hidden @ self.proj)[None]  # [1, T, V]
        return logits, self.kv


def reference_logits(embeds_by_position: list[torch.Tensor], proj: torch.Tensor) -> torch.Tensor:
    """Plain Python: what the checker must return for the last position, with no cache and no padding."""
    kv = torch.stack(embeds_by_position)  # [P, H]
    p = len(embeds_by_position) - 1
    window = kv[max(0, p - WINDOW + 1) : p + 1]
    hidden = kv.mean(0) + 2.0 * window.mean(0)  # [H]
    return hidden @ proj  # [V]


@pytest.fixture
def checker_graph(tmp_path: Path) -> JitGraph:
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(ContractChecker(MAX, WINDOW, HIDDEN, VOCAB)), str(path))
    spec = GraphSpec(max_total=MAX, prefill_bucket=BUCKET, graph_file="model.pt", tp=1)
    return JitGraph(path, spec, vocab_size=VOCAB, sliding_window=WINDOW, final_softcap=30.0)


def test_contract_inputs_and_padding_match_an_unpadded_reference(checker_graph: JitGraph) -> None:
    torch.manual_seed(0)
    n = 3 * BUCKET + 5  # three full buckets, then a padded chunk of 5
    embeds = torch.randn(1, n + 4, HIDDEN)
    proj = checker_graph.module.proj
    for begin in range(0, n, BUCKET):  # chunked prefill, the last chunk padded inside JitGraph
        end = min(begin + BUCKET, n)
        logits = checker_graph.forward(embeds[:, begin:end], torch.arange(begin, end)[None])
        assert logits.shape == (1, end - begin, VOCAB)
    expected = reference_logits(list(embeds[0, :n]), proj)
    assert torch.allclose(logits[0, -1], expected, atol=1e-5)
    for p in range(n, n + 4):  # decode steps overwrite the pad slots before any query sees them
        logits = checker_graph.forward(embeds[:, p : p + 1], torch.tensor([[p]]), last_only=True)
        assert logits.shape == (1, 1, VOCAB)
        assert torch.allclose(logits[0, -1], reference_logits(list(embeds[0, : p + 1]), proj), atol=1e-5)
    assert checker_graph.module.shapes_seen.tolist() == [4, 4]
    assert checker_graph.host_softcap == 30.0  # the published graph leaves the soft-cap to the host


def test_rewind_reuses_a_prefix_without_recomputing_it(checker_graph: JitGraph) -> None:
    torch.manual_seed(1)
    first, second = torch.randn(1, 20, HIDDEN), torch.randn(1, 20, HIDDEN)
    proj = checker_graph.module.proj
    checker_graph.forward(first[:, :8], torch.arange(8)[None])
    checker_graph.forward(first[:, 8:16], torch.arange(8, 16)[None])
    # A second conversation shares the first 12 positions: rewind there and compute only the rest.
    assert checker_graph.rewind(12) == 12
    mixed = torch.cat([first[:, :12], second[:, 12:19]], dim=1)  # [1, 19, H]
    logits = checker_graph.forward(mixed[:, 12:19], torch.arange(12, 19)[None], last_only=True)
    assert torch.allclose(logits[0, -1], reference_logits(list(mixed[0]), proj), atol=1e-5)


def test_sliding_window_edge() -> None:
    inputs = ContractInputs(max_total=16, sliding_window=4, dtype=torch.float32)
    onehot, full, sliding = inputs.build(torch.tensor([[9, 10]]))
    assert onehot.shape == (1, 1, 16, 2) and onehot[0, 0, 9, 0] == 1 and onehot[0, 0, 10, 1] == 1
    assert onehot.sum() == 2
    visible = (sliding[0, 0, 0] == 0).nonzero().flatten().tolist()
    assert visible == [6, 7, 8, 9]  # p - W < s <= p
    assert (full[0, 0, 1] == 0).nonzero().flatten().tolist() == list(range(11))
    assert full.dtype == torch.float32 and full.min() == NEG


def test_pad_positions_past_max_write_nowhere() -> None:
    onehot, _, _ = ContractInputs(max_total=8, sliding_window=None, dtype=torch.float32).build(torch.tensor([[6, 7, 8, 9]]))
    assert onehot[0, 0].sum(0).tolist() == [1.0, 1.0, 0.0, 0.0]


class RecordingNxdModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.zeros(1, dtype=torch.int32))
        self.register_buffer("start_rank", torch.full((1,), -1, dtype=torch.int32))

    @torch.jit.export
    def initialize_with_saved_weights(self, start_rank: torch.Tensor) -> None:
        self.initialized += 1
        self.start_rank.copy_(start_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class SpmdLike(torch.nn.Module):
    """Like a Neuron ModelBuilder model: an `nxd_model` whose weights must be pushed before the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.nxd_model = RecordingNxdModel()
        self.vocab = VOCAB

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, onehot: torch.Tensor,
                full_mask: torch.Tensor, sliding_mask: torch.Tensor) -> list[torch.Tensor]:
        torch._assert(self.nxd_model.initialized[0] == 1, "weights not initialized before the first call")
        logits = embeds.sum(-1, keepdim=True).expand(1, embeds.shape[1], self.vocab)  # [1, T, V]
        return [logits, full_mask]


def test_nxd_model_weights_are_initialized_once_with_rank_zero(tmp_path: Path) -> None:
    path = tmp_path / "sqz_neff.pt"
    torch.jit.save(torch.jit.script(SpmdLike()), str(path))
    graph = JitGraph(path, GraphSpec(max_total=MAX, prefill_bucket=BUCKET), vocab_size=VOCAB,
                     sliding_window=WINDOW, final_softcap=None)
    assert int(graph.module.nxd_model.initialized) == 1
    assert int(graph.module.nxd_model.start_rank) == 0
    logits = graph.forward(torch.ones(1, 1, HIDDEN), torch.tensor([[0]]))  # a list output: take the first
    assert logits.shape == (1, 1, VOCAB) and float(logits[0, 0, 0]) == HIDDEN
    assert int(graph.module.nxd_model.initialized) == 1
