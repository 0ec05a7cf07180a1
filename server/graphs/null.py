"""A graph that computes nothing: fixed logits of the configured vocabulary, instantly.

For benchmarks of the host (everything but the device) and for engine tests that need real shapes. It answers
graphs/base.py's `Graph` with `slots` KV slots (default 1: a one-slot graph) and decode batches up to them; a
simulated step time per call (`step_s`), or per decode batch size (`batch_step_s`, e.g. `ROOFLINE_STEP_S`, the
recipe's projection of the 26B on inf2.xlarge), makes the worker wait as it waits on a NeuronCore.
The logits are a fixed random pattern (seeded), so sampling does real work over a realistic distribution,
with a chosen token forced on top (greedy always picks it: the tokenizer's 'a') and a set of ordinary word
tokens lifted just below it, so sampled generations are text too (every token shows up as a chunk).
It takes image blocks (`block_ids`) as the hf graph does, and ignores them as it ignores the embeddings: with a host
vision encoder (`--vision host`) the tower runs for real and only the language model is simulated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from server.graphs.base import checked_slots, decode_batch_for
from server.graphs.blocks import KVBlocks

# What the null graph "says": common words, each one token in Gemma's vocabulary (the first is greedy's choice).
NULL_GRAPH_WORDS = (
    " a the of and to in is that for it with as was on be by at this are from or have an they which one you were"
    " her all she there would their we him been has when who will more no if out so said what up its about into"
    " than them can only other new some could time these two may then do first any my now such like our over"
)


# One device step of the 26B-A4B on inf2.xlarge, seconds, as the recipe projects it (a roofline of the bytes each call
# reads, at the published build's measured efficiency: 18.6% of 820 GiB/s; PROJECTION, not a measurement):
#   python server/vendor/tp_mb_moe_sqz.py --roofline --config CONFIG_26B.json --contract v3 --kv-slots 8 \
#       --decode-batches 1,2,4,8 --quant int8 --tp 2 --max-total 512
# decode of B rows: 29.1, 22.7, 15.8, 9.8 tok/s per stream at B = 1, 2, 4, 8; a 128-token prefill chunk runs the dense
# experts path: 27.1 GB a call, as the published build's decode step (6.0 tok/s).
ROOFLINE_STEP_S: Mapping[int, float] = {1: 1 / 29.1, 2: 1 / 22.7, 4: 1 / 15.8, 8: 1 / 9.8}
ROOFLINE_PREFILL_S = 1 / 6.0
# What `serve --graph null` simulates without a v3 artifact: a build of 8 slots, decode batches of 1, 2, 4 and 8.
NULL_SLOTS, NULL_DECODE_BATCHES = 8, (1, 2, 4, 8)
# A v4 build's KV read per decode row, per position of its context bucket (docs/contract-v4.md): the 26B's global
# layers hold 20,480 B per position on each of the 2 ranks, read at the published efficiency (18.6% of 820 GiB/s).
ROOFLINE_S_PER_POSITION = 2 * 20480 / (0.1861 * 820 * 2**30)


class NullGraph:
    name = "null"
    image_blocks = True  # block_ids taken and ignored (the module docs)
    copies_slots = True  # it holds no KV: a copy is a check of the slots

    def __init__(self, vocab_size: int, *, max_total: int = 512, prefill_bucket: int = 128,
                 input_dtype: torch.dtype = torch.float32, host_softcap: float | None = None,
                 favoured_token: int | None = None, text_tokens: Sequence[int] = (), seed: int = 0, step_s: float = 0.0,
                 slots: int = 1, decode_batches: Sequence[int] | None = None,
                 batch_step_s: Mapping[int, float] | None = None, kv_pool: KVBlocks | None = None,
                 s_per_position: float = 0.0) -> None:
        self.slots = slots
        # v4 (KV paid by need) modelled: a pool of blocks lent per slot as JitGraphV4 does, and a decode step that
        # waits s_per_position longer per row per position of the call's context bucket (ROOFLINE_S_PER_POSITION).
        self.pool = kv_pool
        self.s_per_position = s_per_position
        # A pool's slot copy would lend the destination blocks unasked: with a pool, a request's choices wait (v4's).
        self.copies_slots = kv_pool is None
        batches = tuple(sorted(set(decode_batches or (batch_step_s or {}).keys() or (1,))))
        self.decode_batches = tuple(b for b in batches if b <= slots) or (1,)
        self._batch_for = decode_batch_for(self.decode_batches)
        self.batch_step_s = dict(batch_step_s or {})  # compiled batch -> simulated seconds a decode step
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

    # The protocol over `slots` slots (with one, what OneSlotGraph's calls over forward / rewind would do).
    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, slot: int, *, last_only: bool = False,
                on_submit: Callable[[], None] | None = None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        checked_slots([slot], self.slots)
        if self.pool is not None:
            self.pool.reserve(slot, int(positions[0, -1]) + 1)
        return self.forward(embeds, positions, last_only=last_only, on_submit=on_submit)  # [1, T, V]

    def decode(self, embeds: torch.Tensor, positions: torch.Tensor, slots: Sequence[int], *,
               on_submit: Callable[[], None] | None = None) -> torch.Tensor:
        rows = embeds.shape[0]  # embeds [B, 1, H], positions [B, 1]
        assert embeds.shape[1] == 1 and positions.shape == (rows, 1) and len(slots) == rows
        assert int(positions.max()) < self.max_total, "position beyond max_total"
        checked_slots(slots, self.slots)
        batch = self._batch_for.get(rows)
        if batch is None:
            raise ValueError(f"{rows} rows: the largest decode batch is {self.decode_batches[-1]}")
        self.calls += 1
        if on_submit is not None:
            on_submit()
        wait = self.batch_step_s.get(batch, self.step_s)
        if self.pool is not None:
            ends = [int(p) + 1 for p in positions[:, 0].tolist()]
            for slot, end in zip(slots, ends, strict=True):
                self.pool.reserve(int(slot), end)
            wait += self.s_per_position * batch * self.pool.context_for(max(ends))
        if wait > 0:
            time.sleep(wait)
        return self._last[0].expand(rows, -1)  # [B, V] (a view)

    def rewind_slot(self, slot: int, position: int) -> int:
        checked_slots([slot], self.slots)
        if self.pool is not None:
            self.pool.truncate(slot, position)
        return position

    def free_tokens(self) -> int | None:
        """Positions a modelled v4 pool could still lend (None: no pool, KV by slot)."""
        return None if self.pool is None else len(self.pool.free) * self.pool.block_size

    def copy_slot(self, src: int, dst: int) -> None:
        checked_slots([src, dst], self.slots)
        if self.pool is not None:  # a modelled v4 pool: dst holds as many blocks as src (its own, lent now)
            self.pool.release(dst)
            self.pool.reserve(dst, len(self.pool.rows.get(src, ())) * self.pool.block_size)
