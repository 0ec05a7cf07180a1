"""A v4 graph's pool of global-layer KV blocks (docs/contract-v4.md): which blocks each KV slot holds, lent by need.

It lives with the graph (graphs/jit.py `JitGraphV4` owns one), not in the engine: the graph protocol stays v3's
(slots and positions), the block tables are the v4 graph's own layout, as the rings are v2's and v3's. The engine's
`KVSlots` keeps deciding which slot a prompt takes; a newcomer's rewind of its slot gives the evicted conversation's
blocks back here. Admission by free KV asks the pool (graphs/base.py `KVPool`): the engine's scheduler admits a
prompt only when its blocks fit, and evicts idle slots' blocks (or preempts a row) before a call would run short.
`decode_calls` is the choice between one decode call at the longest row's context bucket and one call per bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


class KVBlocks:
    """A v4 graph's pool of global-layer KV blocks (docs/contract-v4.md), lent to rows by need.

    Block 0 is the null block: no row owns it, and a table's entries past a row's own blocks name it (pads and
    spare rows write there; the causal mask hides it). A row holds ceil(tokens / block_size) blocks, taken when
    its positions reach them (`reserve`) and all given back when it ends (`release`): KV paid for the context a
    conversation has, not the largest one the build allows. Admission asks `can_hold` (free blocks, not free
    slots). Which blocks a row gets is immaterial to the graph (it reads them through the table), so the free list
    is a stack: the most recently freed block is lent first.
    """

    def __init__(self, blocks: int, block_size: int, contexts: Sequence[int]) -> None:
        if blocks < 2 or block_size < 1:
            raise ValueError(f"need >= 2 blocks (block 0 is the null block) of >= 1 position, got {blocks}, {block_size}")
        self.block_size = block_size
        self.contexts = tuple(sorted(contexts))  # the graphs' context buckets, in tokens
        self.free: list[int] = list(range(blocks - 1, 0, -1))
        self.rows: dict[int, list[int]] = {}  # row (the sequence's sliding slot) -> its blocks, in position order

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def held(self, row: int) -> int:
        """Blocks `row` holds now."""
        return len(self.rows.get(row, ()))

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    @property
    def reach(self) -> int:
        """The most positions one row can ever hold: every lendable block, within the largest context bucket."""
        return min((len(self.free) + self.in_use) * self.block_size, self.contexts[-1])

    def shortfall(self, needs: Mapping[int, int]) -> int:
        """Blocks missing for each row of `needs` (row -> positions it must hold) to grow there with the free ones."""
        want = sum(max(0, self.blocks_for(tokens) - self.held(row)) for row, tokens in needs.items())
        return max(0, want - len(self.free))

    def can_hold(self, tokens: int, row: int | None = None) -> bool:
        """Whether `row` (or a newcomer) could grow to `tokens` positions with the blocks free now."""
        held = len(self.rows.get(row, ())) if row is not None else 0
        return self.blocks_for(tokens) - held <= len(self.free) and tokens <= self.contexts[-1]

    def reserve(self, row: int, tokens: int) -> None:
        """Lend `row` enough blocks for positions [0, tokens); refuses (MemoryError) when the pool is short."""
        if not self.can_hold(tokens, row):
            raise MemoryError(f"KV pool: {tokens} tokens need {self.blocks_for(tokens)} blocks, "
                              f"{len(self.free)} free (row {row} holds {len(self.rows.get(row, ()))})")
        own = self.rows.setdefault(row, [])
        while len(own) < self.blocks_for(tokens):
            own.append(self.free.pop())

    def truncate(self, row: int, tokens: int) -> None:
        """Keep only the blocks of positions [0, tokens) (a rewind): the rest go back to the pool."""
        own = self.rows.get(row, [])
        keep = self.blocks_for(tokens)
        self.free.extend(reversed(own[keep:]))
        del own[keep:]

    def release(self, row: int) -> None:
        """`row`'s conversation ended: all its blocks back to the pool."""
        self.truncate(row, 0)
        self.rows.pop(row, None)

    def context_for(self, tokens: int) -> int:
        """The smallest context bucket holding `tokens` positions (the graph a call over them runs)."""
        for context in self.contexts:
            if tokens <= context:
                return context
        raise ValueError(f"{tokens} positions exceed the largest context bucket {self.contexts[-1]}")

    def table(self, rows: Sequence[int], context: int) -> torch.Tensor:
        """int32 [len(rows), context / block_size]: each row's blocks, then the null block."""
        width = context // self.block_size
        out = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, row in enumerate(rows):
            own = self.rows.get(row, [])[:width]
            out[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        return out

    @property
    def in_use(self) -> int:
        return sum(len(b) for b in self.rows.values())


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """Bytes one decode call reads, per rank, as the recipe's roofline counts them (`context_roofline`): the weights
    once per call (`weights[n - 1]` for n rows: the experts the rows route to), each row's sliding rings, and each
    row's global-layer blocks up to the call's context bucket."""

    weights: tuple[float, ...]  # bytes besides KV of a call of 1, 2, ... rows (the last repeats past the end)
    sliding_per_row: float
    global_per_position: float

    def call(self, rows: int, context: int) -> float:
        weights = self.weights[min(rows, len(self.weights)) - 1]
        return weights + rows * (self.sliding_per_row + context * self.global_per_position)


# The 26B-A4B, tp 2, int8 attention, bf16 KV (PROJECTION: docs/contract-v4.md "Decode rate by context", from
#   python server/vendor/tp_mb_moe_sqz.py --roofline --contract v4 --tp 2 --attn-quant int8 --prefill-buckets 128,512
# its scenarios' bytes less their KV give the weights of a call of 1, 3 and 4 rows; 2 rows interpolated between 1 and 3;
# a row's sliding rings 157,286,400 B, 20,480 B per global position).
DECODE_COST_26B = DecodeCost(weights=(2_056_518_204, 2_773_584_444, 3_490_650_684, 4_207_716_924),
                             sliding_per_row=157_286_400, global_per_position=20480)


def decode_calls(contexts: Sequence[int], cost: DecodeCost) -> list[list[int]]:
    """The decode calls for rows whose context buckets are `contexts` (row i needs contexts[i]): the indices of each
    call's rows, in row order within a call. One call at the longest row's bucket (the short rows read null blocks
    up to it), or one call per bucket when that reads fewer bytes (the weights once per call): the recipe's choice."""
    one = [list(range(len(contexts)))]
    groups: dict[int, list[int]] = {}
    for i, context in enumerate(contexts):
        groups.setdefault(context, []).append(i)
    if len(groups) < 2:
        return one
    by_bucket = sum(cost.call(len(rows), context) for context, rows in groups.items())
    if by_bucket < cost.call(len(contexts), max(contexts)):
        return [groups[c] for c in sorted(groups, reverse=True)]
    return one
