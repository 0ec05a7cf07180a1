"""Admission by free KV (issue 34): the engine core over the null graph with a v4 pool of blocks (graphs/blocks.py
`KVBlocks`), stepped by hand. A prompt waits until its blocks fit, whatever slots are free; a prompt one slot of the
pool could never hold is refused before any graph call, in the API's words; a row that would run the pool short
preempts the youngest, which resumes its stream after; every block a finished or cancelled row held is lent only to
idle slots' prefixes. `decode_calls` (one decode call or one per context bucket) against the recipe's roofline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from server.engine.sequence import State
from server.errors import ContextOverflow
from server.graphs.blocks import DECODE_COST_26B, DecodeCost, KVBlocks, decode_calls
from tests.support.core import Walk, prompt_of

BLOCK = 16


def pool_walk(blocks: int, capacity: int = 4) -> Walk:
    return Walk(bucket=8, max_total=256, slots=capacity, kv_pool=KVBlocks(blocks, BLOCK, (64, 256)), capacity=capacity)


@pytest.fixture
def walk() -> Iterator[Walk]:
    walk = pool_walk(9)  # 8 lendable blocks: 128 positions, for 4 slots of 256
    yield walk
    walk.close()


def idle_holdings(walk: Walk) -> int:
    pool = walk.graph.pool
    assert pool is not None
    return sum(pool.held(slot.index) for slot in walk.core.scheduler.slots.free)


def run_all(walk: Walk, limit: int = 2000) -> list[list[State]]:
    seen = []
    for _ in range(limit):
        if walk.core.step() is None:
            return seen
        seen.append([seq.state for seq in walk.core.records.values()])
    raise AssertionError("the engine never went idle")


def test_a_prompt_waits_for_blocks_not_slots(walk: Walk) -> None:
    """Two 60-token prompts hold 4 blocks each (their first token's position included): the third waits with two
    slots free, and starts once a finished row's blocks go back (its slot's prefix evicted for it)."""
    a, b = walk.submit(prompt_of(60), 3), walk.submit(prompt_of(60, start=2000), 3)
    c = walk.submit(prompt_of(60, start=5000), 3)
    seq_c = walk.core.records[c]
    walk.core.step()
    assert [s.state for s in walk.core.records.values()][:2] != [State.WAITING, State.WAITING]
    assert seq_c.state is State.WAITING and len(walk.core.scheduler.slots.free) == 2  # slots free, blocks not
    waited_while_both_ran = False
    while walk.core.step() is not None:
        running = {walk.core.records[h].state for h in (a, b)}
        if seq_c.state is State.WAITING and State.DECODING in running:
            waited_while_both_ran = True
    assert waited_while_both_ran
    for handle in (a, b, c):
        finish = walk.finish(handle)
        assert finish is not None and finish.reason == "length" and finish.completion_tokens == 3
    assert walk.graph.pool is not None and walk.graph.pool.in_use == idle_holdings(walk) <= 8


def test_a_prompt_no_slot_of_the_pool_could_hold_is_refused_before_any_work(walk: Walk) -> None:
    """The pool lends 8 blocks of 16: one conversation reaches 128 positions, though the build's context is 256."""
    assert walk.core.context == 128
    handle = walk.submit(prompt_of(130), 4)
    finish = walk.finish(handle)
    assert finish is not None and finish.reason == "error" and finish.completion_tokens == 0
    assert finish.error == ContextOverflow(130, 128, None).message  # the API's own wording (context_length_exceeded)
    assert finish.error.startswith("This model's maximum context length is 128 tokens")
    assert walk.core.step() is None and walk.graph.log == []
    ok = walk.submit(prompt_of(100), 40)  # its budget is cut to what the pool reaches: 28 tokens
    run_all(walk)
    done = walk.finish(ok)
    assert done is not None and done.reason == "length" and done.completion_tokens == 28


def test_a_row_that_would_run_the_pool_short_preempts_the_youngest_which_resumes(walk: Walk) -> None:
    """Two rows growing to 100 positions (7 blocks each) in a pool of 8: the younger gives its blocks back and waits,
    then prefills its prompt and generated tokens again and goes on: every token once, in order, no error."""
    a, b = walk.submit(prompt_of(40), 60), walk.submit(prompt_of(40, start=3000), 60)
    seq_a, seq_b = walk.core.records[a], walk.core.records[b]
    pool = walk.graph.pool
    assert pool is not None
    seen_b: list[int] = []
    resumed_at = None
    while walk.core.step() is not None:
        assert pool.in_use <= 8
        if seq_b.preemptions and resumed_at is None and seq_b.state is State.WAITING:
            resumed_at = len(walk.tokens(b))  # the tokens it streamed before it left: all of them out already
            seen_b = walk.tokens(b)
            assert seq_a.state is State.DECODING
    assert seq_b.preemptions >= 1 and seq_a.preemptions == 0 and resumed_at is not None and resumed_at > 0
    for handle, seq in ((a, seq_a), (b, seq_b)):
        finish = walk.finish(handle)
        assert finish is not None and finish.reason == "length" and finish.error is None
        assert finish.completion_tokens == 60 == len(walk.tokens(handle)) == seq.generated
        assert finish.prompt_tokens == 40
    assert walk.tokens(b)[: len(seen_b)] == seen_b
    # its resume prefilled positions past its prompt: the generated tokens, recomputed
    assert any(max(call.positions) >= 40 for call in walk.graph.log if call.kind == "prefill")
    assert pool.in_use == idle_holdings(walk) and walk.core.scheduler.active == []


def test_cancelled_and_finished_rows_leave_only_idle_prefixes_in_the_pool(walk: Walk) -> None:
    a, b = walk.submit(prompt_of(30), 50), walk.submit(prompt_of(20, start=4000), 5)
    for _ in range(12):
        walk.core.step()
    a.cancel()
    run_all(walk)
    assert walk.finish(a) is not None and walk.finish(b) is not None
    pool = walk.graph.pool
    assert pool is not None and pool.in_use == idle_holdings(walk) > 0
    usage = walk.core.scheduler.slots.usage(walk.graph.max_total, pool)
    assert (usage.blocks, usage.blocks_in_use, usage.tokens_capacity) == (8, pool.in_use, 128)
    assert usage.slots_in_use == 0 and usage.tokens_in_use == 0
    # a newcomer that needs the whole pool evicts those prefixes, cheapest first, and fits
    c = walk.submit(prompt_of(120, start=7000), 5)
    run_all(walk)
    done = walk.finish(c)
    assert done is not None and done.reason == "length" and pool.in_use == idle_holdings(walk)


def test_decode_calls_follow_the_recipes_roofline() -> None:
    """The 26B's mixed four (one row at 32k, three at 4k): one call per bucket (the recipe's `best`, by_bucket:
    7.099 GB against 7.521 GB); four rows at 8k, or one long row beside one short: one call."""
    cost = DECODE_COST_26B
    assert decode_calls([32768, 4096, 4096, 4096], cost) == [[0], [1, 2, 3]]
    assert cost.call(4, 32768) == pytest.approx(7_521_217_084, rel=1e-9)  # the recipe's one_call bytes
    assert cost.call(1, 32768) + cost.call(3, 4096) == pytest.approx(7_099_061_368, rel=1e-9)  # its by_bucket
    assert decode_calls([8192] * 4, cost) == [[0, 1, 2, 3]]
    assert decode_calls([8192, 4096], cost) == [[0, 1]]  # 67 MB of null blocks beside a second weights read
    assert decode_calls([4096, 65536, 4096], cost) == [[1], [0, 2]]  # the longest bucket first, rows in order
    free_weights = DecodeCost(weights=(0,), sliding_per_row=0, global_per_position=1)
    assert decode_calls([64, 256, 64], free_weights) == [[1], [0, 2]]
    assert decode_calls([64], free_weights) == [[0]]
