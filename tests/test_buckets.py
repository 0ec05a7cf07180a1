"""Prefill planning over several buckets: fewest calls, then least padding, against an exhaustive search."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.buckets import chunk_spans, plan_chunks


def brute_force(count: int, buckets: list[int]) -> tuple[int, int]:
    """(calls, padded capacity) of the best cover, by trying every multiset of buckets."""
    largest = max(buckets)
    for calls in itertools.count(1):
        fits = [sum(c) for c in itertools.combinations_with_replacement(buckets, calls) if sum(c) >= count]
        if fits:
            return calls, min(fits)
        assert calls * largest < count


def covers(chunks: list[int], count: int, buckets: list[int]) -> int:
    """Checks the plan is well formed; returns the capacity it uses (each chunk on the smallest bucket holding it)."""
    assert sum(chunks) == count and all(c > 0 for c in chunks)
    assert all(c == next(b for b in sorted(buckets) if b >= c) for c in chunks[:-1]), "only the last chunk is padded"
    return sum(next(b for b in sorted(buckets) if b >= c) for c in chunks)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.lists(st.integers(1, 64), min_size=1, max_size=3, unique=True))
def test_fewest_calls_then_least_padding(count: int, buckets: list[int]) -> None:
    chunks = plan_chunks(count, buckets)
    calls, capacity = brute_force(count, buckets)
    assert len(chunks) == calls
    assert covers(chunks, count, buckets) == capacity


@pytest.mark.parametrize(("count", "buckets", "chunks"), [
    (600, [128, 512], [512, 88]),  # 2 calls; 88 runs on the 128 bucket
    (600, [300, 512], [300, 300]),  # 2 calls either way; two 300s pad nothing (512 + 300 would pad 212)
    (300, [128], [128, 128, 44]),  # one bucket: today's chunking
    (130, [128, 512], [130]),  # one padded call beats two
    (6000, [128, 512], [512] * 11 + [368]),  # 12 calls, not 47
    (0, [128], []),
])
def test_examples(count: int, buckets: list[int], chunks: list[int]) -> None:
    assert plan_chunks(count, buckets) == chunks


def test_spans() -> None:
    assert chunk_spans(10, 50, [8, 32]) == [(10, 42), (42, 50)]
    with pytest.raises(ValueError):
        plan_chunks(5, [])
