"""server/graphs/blocks.py `KVBlocks`: a v4 graph's global-layer KV blocks lent by need (docs/contract-v4.md)."""

from __future__ import annotations

import pytest
import torch

from server.graphs.blocks import KVBlocks


def test_blocks_are_lent_by_need_and_given_back() -> None:
    pool = KVBlocks(blocks=9, block_size=16, contexts=(64, 128))  # 8 lendable: block 0 is the null block
    pool.reserve(0, 17)  # positions 0..16: two blocks
    pool.reserve(1, 16)
    assert len(pool.rows[0]) == 2 and len(pool.rows[1]) == 1 and pool.in_use == 3
    assert 0 not in pool.rows[0] + pool.rows[1]  # nobody owns the null block
    assert not set(pool.rows[0]) & set(pool.rows[1])  # a block has one owner
    pool.reserve(0, 20)  # still inside its second block: nothing new
    assert len(pool.rows[0]) == 2
    assert pool.can_hold(16 * 5) and not pool.can_hold(16 * 5 + 1)  # admission by free blocks, 5 free
    assert pool.can_hold(16 * 7, row=0)  # a row that grows counts what it holds
    with pytest.raises(MemoryError, match="5 free"):
        pool.reserve(2, 16 * 6)
    assert 2 not in pool.rows or pool.rows[2] == []  # a refused reserve takes nothing
    pool.release(0)
    assert pool.in_use == 1 and len(pool.free) == 7


def test_truncate_is_the_rewind() -> None:
    pool = KVBlocks(blocks=5, block_size=4, contexts=(16,))
    pool.reserve(3, 13)
    kept = list(pool.rows[3])
    pool.truncate(3, 5)  # positions 0..4 kept: two blocks
    assert pool.rows[3] == kept[:2] and len(pool.free) == 2


def test_tables_end_in_the_null_block_and_follow_the_context_bucket() -> None:
    pool = KVBlocks(blocks=12, block_size=16, contexts=(64, 128))
    pool.reserve(0, 100)  # 7 blocks
    pool.reserve(1, 10)  # 1 block
    assert pool.context_for(10) == 64 and pool.context_for(100) == 128
    with pytest.raises(ValueError, match="largest context bucket"):
        pool.context_for(129)
    assert not pool.can_hold(129)
    table = pool.table([0, 1], 128)
    assert table.dtype == torch.int32 and table.shape == (2, 8)
    assert table[0, :7].tolist() == pool.rows[0] and table[0, 7] == 0
    assert table[1, 0] == pool.rows[1][0] and table[1, 1:].eq(0).all()
    assert pool.table([1], 64).shape == (1, 4)


def test_the_null_graph_models_a_pool() -> None:
    """graphs/null.py with a pool: blocks lent by need per slot, given back on rewind, and a decode step that costs
    its context bucket (the benches' model of a v4 build)."""
    from server.graphs.null import ROOFLINE_S_PER_POSITION, NullGraph

    graph = NullGraph(32, max_total=256, slots=2, decode_batches=(1, 2), kv_pool=KVBlocks(9, 16, (64, 128)))
    assert graph.free_tokens() == 8 * 16
    graph.prefill(torch.zeros(1, 40, 4), torch.arange(40)[None], 0)
    graph.decode(torch.zeros(2, 1, 4), torch.tensor([[40], [0]]), [0, 1])
    assert len(graph.pool.rows[0]) == 3 and len(graph.pool.rows[1]) == 1
    assert graph.free_tokens() == 4 * 16
    assert graph.rewind_slot(0, 0) == 0 and graph.free_tokens() == 7 * 16
    assert 2e-7 < ROOFLINE_S_PER_POSITION < 3e-7  # 64k positions: ~16 ms a step, the roofline's 8k -> 64k gap
    assert NullGraph(32).free_tokens() is None
