"""The graph protocol on the one-slot graphs (graphs/base.py `OneSlotGraph`): slot 0 is their one KV cache, a decode batch is one
row, and each call is exactly the `forward` / `rewind` the engine makes today (which stay as they are).

The compiled v3 graph's own protocol is proven end to end in tests/test_recipe_v3.py.
"""

from __future__ import annotations

import pytest
import torch

from server.graphs.base import OneSlotGraph
from server.graphs.jit import JitGraph
from server.graphs.null import NullGraph
from tests import test_jit_graph
from tests.test_jit_graph import BUCKET, HIDDEN, VOCAB, reference_logits

checker_graph = test_jit_graph.checker_graph  # the contract checker's JitGraph (pytest finds the fixture by name)


def test_v1_graph_answers_protocol_v3_on_slot_zero(checker_graph: JitGraph) -> None:
    """Prefill (padded chunks) and decode through the adapters give the logits of an unpadded reference."""
    graph = checker_graph
    assert isinstance(graph, OneSlotGraph)
    assert (graph.slots, graph.decode_batches, graph.prefill_buckets) == (1, (1,), (BUCKET,))
    torch.manual_seed(0)
    n = 2 * BUCKET + 3
    embeds = torch.randn(1, n + 3, HIDDEN)
    proj = graph.module.proj
    for begin in range(0, n, BUCKET):
        end = min(begin + BUCKET, n)
        logits = graph.prefill(embeds[:, begin:end], torch.arange(begin, end)[None], 0, last_only=True)
        assert logits.shape == (1, 1, VOCAB)
    assert torch.allclose(logits[0, -1], reference_logits(list(embeds[0, :n]), proj), atol=1e-5)
    for p in range(n, n + 3):
        row = graph.decode(embeds[:, p : p + 1], torch.tensor([[p]]), [0])
        assert row.shape == (1, VOCAB)
        assert torch.allclose(row[0], reference_logits(list(embeds[0, : p + 1]), proj), atol=1e-5)
    assert graph.module.shapes_seen.tolist() == [3, 3]  # the same graph calls forward would have made
    assert graph.rewind_slot(0, 7) == graph.rewind(7) == 7


def test_null_graph_adapters_are_its_forward_and_rewind() -> None:
    graph = NullGraph(vocab_size=32, max_total=64, prefill_bucket=8, favoured_token=5)
    assert (graph.slots, graph.decode_batches, graph.prefill_buckets) == (1, (1,), (8,))
    embeds, positions = torch.zeros(1, 6, 4), torch.arange(6)[None]
    assert torch.equal(graph.prefill(embeds, positions, 0), graph.forward(embeds, positions))
    row = graph.decode(torch.zeros(1, 1, 4), torch.tensor([[6]]), torch.tensor([0]))
    assert row.shape == (1, 32) and int(row.argmax()) == 5
    assert graph.calls == 3
    assert graph.rewind_slot(0, 3) == 3


@pytest.mark.parametrize("call", [
    lambda g: g.prefill(torch.zeros(1, 2, 4), torch.arange(2)[None], 1),
    lambda g: g.decode(torch.zeros(2, 1, 4), torch.tensor([[0], [1]]), [0, 1]),
    lambda g: g.decode(torch.zeros(1, 1, 4), torch.tensor([[0]]), [1]),
    lambda g: g.rewind_slot(2, 0),
], ids=["prefill-slot-1", "decode-two-rows", "decode-slot-1", "rewind-slot-2"])
def test_one_slot_graphs_refuse_other_slots(call) -> None:
    graph = NullGraph(vocab_size=32)
    with pytest.raises(ValueError, match="one-slot graph"):
        call(graph)
    assert graph.calls == 0  # refused before any device work
