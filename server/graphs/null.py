"""A graph that computes nothing: fixed logits of the configured vocabulary, instantly.

For benchmarks of the host (everything but the device) and for engine tests that need real shapes.
The logits are a fixed random pattern (seeded), so sampling does real work over a realistic distribution,
with a chosen token forced on top (greedy always picks it: the tokenizer's 'a') and a set of ordinary word
tokens lifted just below it, so sampled generations are text too (every token shows up as a chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from server.graphs.base import OneSlot

# What the null graph "says": common words, each one token in Gemma's vocabulary (the first is greedy's choice).
NULL_GRAPH_WORDS = (
    " a the of and to in is that for it with as was on be by at this are from or have an they which one you were"
    " her all she there would their we him been has when who will more no if out so said what up its about into"
    " than them can only other new some could time these two may then do first any my now such like our over"
)


class NullGraph(OneSlot):
    name = "null"

    def __init__(self, vocab_size: int, *, max_total: int = 512, prefill_bucket: int = 128,
                 input_dtype: torch.dtype = torch.float32, host_softcap: float | None = None,
                 favoured_token: int | None = None, text_tokens: Sequence[int] = (), seed: int = 0, step_s: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.max_total = max_total
        self.prefill_bucket = prefill_bucket
        self.prefill_buckets = (prefill_bucket,)
        self.input_dtype = input_dtype
        self.host_softcap = host_softcap
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab_size, generator=generator) * 2.0  # [V]
        top = float(logits.max())
        if text_tokens:
            lift = torch.linspace(1.0, 3.0, len(text_tokens))  # [n] a spread, so top-p has something to cut
            logits[torch.tensor(list(text_tokens), dtype=torch.long)] = top + lift
        if favoured_token is not None:
            logits[favoured_token] = top + 4.0
        self._last = logits.view(1, 1, -1)  # [1, 1, V]: decode's answer, made once (the call is timed as device time)
        self.calls = 0  # graph invocations, for prefill-reuse accounting in benchmarks and tests
        # Simulated device time per call: the worker then waits like it waits on a NeuronCore (GIL released),
        # so a benchmark sees the host's overhead on top of a device step, not a host spinning at 100%.
        self.step_s = step_s

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        assert embeds.dim() == 3 and positions.shape == embeds.shape[:2], "embeds [1,T,H], positions [1,T]"
        assert int(positions[0, -1]) < self.max_total, "position beyond max_total"
        self.calls += 1
        if on_submit is not None:
            on_submit()
        if self.step_s > 0:
            time.sleep(self.step_s)
        t = 1 if last_only else embeds.shape[1]
        return self._last if t == 1 else self._last.expand(1, t, -1)  # [1, T, V] (a view: no per-call allocation)

    def rewind(self, position: int) -> int:
        return position
