"""Prefill planning: which graph calls cover a prompt, given the graph's prefill buckets.

A compiled graph takes T = one of its buckets (or 1) and a shorter chunk is padded up to the smallest bucket that
holds it. Covering n tokens costs one call per chunk and pads whatever the buckets hold beyond n; a call costs
far more than a padded row, so the plan takes the fewest calls, then the least padding. Only the last chunk is
padded (every other chunk fills its bucket exactly).

Image blocks (issue 27): an image's soft tokens attend to each other both ways, so one image is always inside one
graph call. `chunk_spans(..., blocks=...)` moves any boundary the plan would put inside a block back to the block's
start and plans the rest from there: one call more at most per image crossed, never a block split.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence


@functools.lru_cache(maxsize=4096)
def _plan(count: int, buckets: tuple[int, ...]) -> tuple[int, ...]:
    # Fewest calls: k = ceil(n / L) with L the largest bucket (nothing covers n with fewer). Least padding among
    # k-call covers: start from k x L (padding D = kL - n < L) and swap some L for smaller buckets, each swap
    # giving back L - b; take the largest total give-back <= D reachable with at most k swaps. A knapsack over
    # D < L values, so cheap whatever the prompt length.
    largest = buckets[-1]
    k = -(-count // largest)
    spare = k * largest - count  # D
    gives = [largest - b for b in buckets[:-1]]
    inf = k + 1
    swaps = [0] + [inf] * spare  # swaps[d]: fewest swaps giving back exactly d
    last = [0] * (spare + 1)
    for d in range(1, spare + 1):
        for g in gives:
            if g <= d and swaps[d - g] + 1 < swaps[d]:
                swaps[d], last[d] = swaps[d - g] + 1, g
    best = max(d for d in range(spare + 1) if swaps[d] <= k)
    sizes = []
    d = best
    while d:
        sizes.append(largest - last[d])
        d -= last[d]
    sizes += [largest] * (k - len(sizes))
    sizes.sort(reverse=True)
    sizes[-1] -= spare - best  # the padding goes to the last chunk
    return tuple(sizes)


def plan_chunks(count: int, buckets: Sequence[int]) -> list[int]:
    """Chunk lengths (real tokens, in order) covering `count` tokens: fewest calls, then least padding."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not buckets or min(buckets) < 1:
        raise ValueError(f"buckets must be positive, got {buckets!r}")
    if count == 0:
        return []
    return list(_plan(count, tuple(sorted(set(buckets)))))


def chunk_spans(start: int, stop: int, buckets: Sequence[int],
                blocks: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """[begin, end) spans covering positions start..stop-1, planned by `plan_chunks`, none splitting a `blocks` span
    ([begin, end) positions that must be in one call; ValueError for one longer than the largest bucket)."""
    spans: list[tuple[int, int]] = []
    begin = start
    while begin < stop:
        bounds = list(itertools.accumulate(plan_chunks(stop - begin, buckets), initial=begin))
        planned = list(itertools.pairwise(bounds))
        for index, (_, end) in enumerate(planned):
            cut = next((a for a, b in blocks if a < end < b), None)
            if cut is None:
                continue
            chunk_begin = planned[index][0]
            if cut <= chunk_begin and index == 0:  # the plan's first chunk is its largest: the block holds more
                raise ValueError(f"an image block [{cut}, {next(b for a, b in blocks if a == cut)}) is longer than the "
                                 f"largest prefill chunk ({max(buckets)})")
            spans += planned[:index] if cut <= chunk_begin else [*planned[:index], (chunk_begin, cut)]
            begin = max(cut, chunk_begin)
            break
        else:
            spans += planned
            begin = stop
    return spans
