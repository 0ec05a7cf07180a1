"""The pure functions the sampler is made of, on one row of logits: exact top-k and argmax without a full sort, the
truncation chain (soft-cap, temperature, min-p, top-p), the inverse-CDF draw, raw logprobs.

Order of operations (each step sees the previous step's output; steps 1-2 and the constraint's mask are the
`Sampler`'s, in server.sampling.sampler):

    1. logit_bias                      added to the raw logits of the named tokens
    2. repetition penalty              HF/vLLM: divide positive / multiply negative logits of tokens seen in
                                       prompt + output (once per distinct token)
       presence/frequency penalties    OpenAI: subtract presence + frequency * count, output tokens only
    3. greedy (temperature 0)          argmax here; the soft-cap is monotonic, so it cannot change the answer
    4. top-k                           exact, before any sort (see `topk`)
    5. soft-cap                        cap * tanh(x / cap), applied to the candidates only (monotonic)
    6. temperature                     divide
    7. min-p                           keep p >= min_p * p_max
    8. top-p                           keep the smallest best-first prefix whose mass reaches top_p
                                       (renormalised over the survivors of 4 and 7, as HF and vLLM do)
    9. draw                            inverse CDF: one uniform from the request's own random generator
                                       (seeded => reproducible), searched in the kept prefix sums

Steps 5-9 run on a candidate list of one of two kinds, behind one small interface (`CandidateMath`): Python floats
(`FLOATS`, a small top-k: see `_PYTHON_TOP_K`) or tensors (`TENSORS`, any size). `_truncate` defines them for both.

Deliberate choices (measured on a 2-core host at V=262144; do not "fix" these without measuring):
- No full-vocabulary sort on the usual path. `torch.topk(x, 64)` costs ~1 ms and `torch.argmax` ~0.5 ms,
  while a streaming max over 64-wide blocks costs ~0.04 ms; `topk`/`argmax` below use the block maxima.
- top-k off with top-p/min-p: probe the best 64, 512, ... tokens until the kept set provably fits; only a
  near-flat distribution falls back to the full sort. top-p alone also needs the whole vocabulary's weight
  (`row_totals`: through sigmoid and exp2, ~5x cheaper here than tanh and exp).
- No function here modifies its input row; full-vocabulary passes write into a caller's scratch row when given one.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from server.sampling.params import SamplingParams

# Block width of the two-stage argmax: the fastest on this host at V=262144 (`_topk_block` for top-k).
_ARGMAX_BLOCK = 256
_FIRST_PROBE = 64  # top-k off, min-p/top-p on: the first candidate count, grown 8x until the kept set fits
_LAST_PROBE = 32_768
# Up to this k, `topk_rows` starts from contiguous blocks of _ROW_BLOCK values (`_topk_rows_by_blocks`).
_ROW_BLOCK, _ROW_BLOCK_TOP_K = 256, 64  # beyond this a full sort is about as cheap as another probe
_ROW_CANDIDATES = 1024  # a row with more values at or above the threshold takes the column route
# Up to this top-k, steps 5-9 run on the k candidates as Python floats (`FLOATS`): a handful of torch calls
# instead of ~25. What that buys is measured between device steps, where caches have gone cold and every torch
# call costs ~25 us more (default sampling then: ~0.6 ms with tensors vs ~0.4 ms with Python floats here).
_PYTHON_TOP_K = 256


def _topk_block(k: int) -> int:
    """Block width for `topk`, measured at V=262144 on this host (0: use torch.topk). Wider blocks make the
    block-max pass cheaper (short rows reduce slowly) but the final top-k over k * block values dearer."""
    if k <= 64:
        return 64
    if k <= 512:
        return 32
    if k <= 4096:
        return 8
    return 0


def topk(x: torch.Tensor, k: int, block: int | None = None, *, as_lists: bool = False) -> tuple[Any, Any]:
    """Exact top-k of a 1-D tensor: (values best first, indices), without torch.topk over all of it.

    The k blocks with the largest maxima hold the k largest values: an element outside them is <= its block's
    maximum <= the k-th largest block maximum, and those k blocks already hold k elements at least that large.
    So: one streaming pass for block maxima, a top-k over V/block maxima, a top-k over k*block gathered values.
    Values equal torch.topk's exactly; among equal values the indices may differ.
    as_lists: Python lists, the ids computed in Python (five fewer torch calls for a small k).
    """
    block = _topk_block(k) if block is None else block
    n = x.numel()
    if not block or n % block or n // block < 2 * k or not x.is_contiguous():
        values, ids = torch.topk(x, k)  # small, odd-sized or huge-k cases: the direct route
        return (values.tolist(), ids.tolist()) if as_lists else (values, ids)
    blocks = x.view(-1, block)  # (V/B, B)
    top_blocks = torch.topk(blocks.amax(1), k, sorted=False).indices  # (k,)
    values, pos = torch.topk(blocks.index_select(0, top_blocks).view(-1), k)  # (k,), (k,) into (k*B,)
    if as_lists:
        starts = top_blocks.tolist()
        return values.tolist(), [starts[p // block] * block + p % block for p in pos.tolist()]
    return values, top_blocks[pos // block] * block + pos % block  # (k,), (k,)


def topk_rows(x: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Exact top-k of each row of x [R, V] as Python lists (values best first, their ids), every row in the same
    few torch calls: the small-top-k route of `candidates` (one row) and of `sample_rows` (a step's rows) alike, so a
    row gets the same list, ties included, whether it is sampled alone or beside others.

    Up to k = 64 from contiguous blocks of 256 (`_topk_rows_by_blocks`); a row they cannot bound takes the column
    route alone (`_topk_rows_by_columns`), as it would alone, so one such row leaves the others' lists as they are."""
    rows, n = x.shape
    if not (k <= _ROW_BLOCK_TOP_K and n % _ROW_BLOCK == 0 and n // _ROW_BLOCK >= 2 * k and x.is_contiguous()
            and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad):  # numpy views of x
        return _topk_rows_by_columns(x, k)
    values, ids = [], []
    for r, found in enumerate(_topk_rows_by_blocks(x, k)):
        if found is None:
            by_columns = _topk_rows_by_columns(x[r : r + 1], k)  # of [1, V], a view
            found = by_columns[0][0], by_columns[1][0]
        values.append(found[0])
        ids.append(found[1])
    return values, ids


def _topk_rows_by_columns(x: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """`topk_rows` for any k: `topk`'s argument with *strided* groups: row r's V values as a [G, W] grid, group j =
    column j (every W-th value). The k columns with the largest maxima hold the k largest values (as `topk`'s
    blocks). A column maximum is an elementwise max down G contiguous rows of W: one vectorised pass (~2x cheaper here
    than a block's amax over its own short contiguous run of G <= 32 values), then a top-k over W column maxima and one
    over the k columns' G * k values. Per row too: a row's list is the same alone or beside others."""
    rows, n = x.shape
    group = _topk_block(k)  # G: values per column
    if not group or n % group or n // group < 2 * k or not x.is_contiguous():
        values, ids = torch.topk(x, k)  # [R, k] each: small, odd-sized or huge-k cases, the direct route
        return values.tolist(), ids.tolist()
    width = n // group  # W: columns
    grid = x.view(rows, group, width)  # [R, G, W]
    columns = torch.topk(grid.amax(1), k, sorted=False).indices  # [R, k] the k columns of the largest maxima
    gathered = torch.gather(grid, 2, columns[:, None, :].expand(rows, group, k))  # [R, G, k]: (i, j) = x[i*W + col j]
    values, pos = torch.topk(gathered.view(rows, group * k), k)  # [R, k], [R, k] into each row's (G*k,)
    ids = [[p // k * width + cols[p % k] for p in row_pos]
           for cols, row_pos in zip(columns.tolist(), pos.tolist(), strict=True)]
    return values.tolist(), ids


def _topk_rows_by_blocks(x: torch.Tensor, k: int) -> list[tuple[list[float], list[int]] | None]:
    """`topk_rows` for a small k, from contiguous blocks of B: the block maxima in one torch pass (it streams the
    rows ~3x faster here than numpy's max), then `topk`'s argument with a threshold, in numpy on the few values left
    (a numpy call costs a few us where a torch call here costs 10-40): the k blocks of the largest maxima hold the k
    largest values, and t, the least of those k maxima, bounds everything outside them (<= t) while they hold k values
    >= t. So a row's candidates are the values >= t inside its k blocks (about k of them on a language model's row),
    sorted best first (equal values in block, then column order: stable), the first k kept. Measured at V = 262144:
    4 rows ~2x less than the same argument in torch calls. Every step is per row (its blocks, threshold and order
    depend on its own values only), so a row's list is the same alone or beside others.
    None for a row the threshold cannot bound (NaN, a masked row with fewer than k blocks allowing a token, a
    near-flat row): `topk_rows` takes the column route for it."""
    rows, n = x.shape
    block, count = _ROW_BLOCK, n // _ROW_BLOCK
    maxima = x.view(rows, count, block).amax(2).numpy()  # (R, V/B) each block's maximum (NaN where one is)
    top = np.argpartition(maxima, count - k, axis=1)[:, count - k:]  # (R, k) the k blocks of the largest maxima
    blocks = x.numpy().reshape(rows, count, block)  # (R, V/B, B) a view of x
    out: list[tuple[list[float], list[int]] | None] = []  # per row: (values best first, their ids)
    for row_blocks, row_maxima, row_top in zip(blocks, maxima, top, strict=True):
        # The least of the k maxima; NaN if one is (argpartition ranks NaN above every number, so a NaN block is
        # always among the k, and min propagates it).
        threshold = row_maxima[row_top].min()
        cells = row_blocks[row_top] if threshold > -np.inf else None  # (k, B) a copy
        flat = None if cells is None else np.flatnonzero(cells >= threshold)  # (m,) m >= k, ascending
        if cells is None or flat is None or flat.size > _ROW_CANDIDATES:
            # NaN (no threshold orders it), -inf (every cell of its -inf blocks would pass) or equal values by the
            # thousand (sorting them would cost more than the columns)
            out.append(None)
            continue
        values = cells.ravel()[flat]  # (m,)
        best = np.argsort(-values, kind="stable")[:k]  # (k,) best first, equal values in place
        flat = flat[best]
        out.append((values[best].tolist(), (row_top[flat // block] * block + flat % block).tolist()))
    return out


def argmax(x: torch.Tensor, block: int = _ARGMAX_BLOCK) -> int:
    """torch.argmax(x) (first index of the maximum) via block maxima: ~8x faster than torch.argmax here."""
    n = x.numel()
    if n % block or n < 4 * block or not x.is_contiguous():
        return int(x.argmax())
    blocks = x.view(-1, block)  # (V/B, B)
    b = int(blocks.amax(1).argmax())  # first block holding the maximum
    return b * block + int(blocks[b].argmax())


def argmax_rows(x: torch.Tensor, block: int = _ARGMAX_BLOCK) -> list[int]:
    """`argmax` of each row of x [B, V] (first index of each row's maximum), the same block maxima in one pass."""
    rows, n = x.shape
    if n % block or n < 4 * block or not x.is_contiguous():
        return x.argmax(1).tolist()
    blocks = x.view(rows, -1, block)  # (B, V/blk, blk)
    b = blocks.amax(2).argmax(1)  # (B,) first block holding each row's maximum
    inner = blocks[torch.arange(rows), b].argmax(1)  # (B,) within it
    return (b * block + inner).tolist()


def _sum_exp(x: torch.Tensor, softcap: float | None, inv_t: float, shift: float, out: torch.Tensor) -> float:
    """sum(exp(cap(x) * inv_t - shift)) over the whole row, leaving the terms in `out` (no allocation).

    The same float operations as `_tensor_scale`, so a token's term here equals its term computed on candidates."""
    if softcap is None:
        out.copy_(x)  # (V,)
    else:
        torch.div(x, softcap, out=out).tanh_().mul_(softcap)  # (V,)
    if inv_t != 1.0:
        out.mul_(inv_t)
    return float(out.sub_(shift).exp_().sum())


def _tensor_scale(values: torch.Tensor, softcap: float | None, inv_t: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's final-logit soft-cap), then times inv_t, on a few values; a new tensor either way."""
    scaled = values.clone() if softcap is None else values.div(softcap).tanh_().mul_(softcap)
    return scaled if inv_t == 1.0 else scaled.mul_(inv_t)


class CandidateMath(Protocol):
    """The five operations steps 5-9 need, on one kind of candidate list (`FLOATS` or `TENSORS`). Both kinds do the same
    operations in the same order (Python floats in double precision, tensors in float32), so the route changes a
    token's weight by rounding only (tests/test_sampling.py compares the two).

    scale: steps 5-6, cap * tanh(x / cap) (when a soft-cap applies), then times inv_t; a new sequence.
    weights: steps 5-6 and then exp(scaled - peak), peak being the first (best) value's scaled logit: unnormalised
        probabilities, the best one 1.0. One pass on floats (~35% less than scale's list and then a second one).
    cumsum: running sums of the weights, best first: what min-p/top-p cut and the draw searches.
    count_at_least: how many weights are >= threshold (min-p: they are best first, so these are a prefix).
    count_below: how many of cum[:n] are < target (<= with or_equal): a binary search, cum being ascending.
    """

    def scale(self, values: Any, softcap: float | None, inv_t: float) -> Any: ...
    def weights(self, values: Any, softcap: float | None, inv_t: float) -> Any: ...
    def cumsum(self, weights: Any) -> Any: ...
    def count_at_least(self, weights: Any, threshold: float) -> int: ...
    def count_below(self, cum: Any, target: float, n: int, *, or_equal: bool = False) -> int: ...


class _FloatMath:
    """Candidates as Python lists of floats: for a small top-k, far fewer calls than torch on a handful of values."""

    def scale(self, values: list[float], softcap: float | None, inv_t: float) -> list[float]:
        if softcap is not None:
            values = [softcap * math.tanh(v / softcap) for v in values]
        return [v * inv_t for v in values]

    def weights(self, values: list[float], softcap: float | None, inv_t: float) -> list[float]:
        # scale()'s operations, in its order, inside the one comprehension: the same doubles
        exp, tanh = math.exp, math.tanh
        if softcap is None:
            peak = values[0] * inv_t
            return [exp(v * inv_t - peak) for v in values]
        peak = softcap * tanh(values[0] / softcap) * inv_t
        return [exp(softcap * tanh(v / softcap) * inv_t - peak) for v in values]

    def cumsum(self, weights: list[float]) -> list[float]:
        return list(itertools.accumulate(weights))

    def count_at_least(self, weights: list[float], threshold: float) -> int:
        return sum(1 for w in weights if w >= threshold)

    def count_below(self, cum: list[float], target: float, n: int, *, or_equal: bool = False) -> int:
        return (bisect.bisect_right if or_equal else bisect.bisect_left)(cum, target, 0, n)


class _TensorMath:
    """Candidates as 1-D float32 tensors (m,): any number of them, up to the whole vocabulary."""

    def scale(self, values: torch.Tensor, softcap: float | None, inv_t: float) -> torch.Tensor:
        return _tensor_scale(values, softcap, inv_t)  # (m,) a new tensor

    def weights(self, values: torch.Tensor, softcap: float | None, inv_t: float) -> torch.Tensor:
        scaled = _tensor_scale(values, softcap, inv_t)  # (m,) a new tensor
        return scaled.sub_(float(scaled[0])).exp_()  # (m,) in place

    def cumsum(self, weights: torch.Tensor) -> torch.Tensor:
        return weights.cumsum(0)  # (m,)

    def count_at_least(self, weights: torch.Tensor, threshold: float) -> int:
        return int((weights >= threshold).sum())

    def count_below(self, cum: torch.Tensor, target: float, n: int, *, or_equal: bool = False) -> int:
        return int(torch.searchsorted(cum[:n], target, right=or_equal))


FLOATS: CandidateMath = _FloatMath()
TENSORS: CandidateMath = _TensorMath()


class Candidates(NamedTuple):
    """The tokens one sampling step draws from: the first `n` of `ids`, in proportion to `weights`."""

    ids: Any  # (m,) token ids best first (a list on the Python-floats route); None: the whole vocabulary in id order
    weights: Any  # (m,) unnormalised probabilities exp(scaled logit - shift)
    cum: Any  # (m,) cumulative sums of weights
    n: int  # the survivors of min-p and top-p: a prefix
    ops: CandidateMath = TENSORS  # how steps 5-9 compute on them


def _truncate(values: Any, params: SamplingParams, softcap: float | None, ops: CandidateMath,
              total: float | None = None) -> tuple[Any, Any, int]:
    """Steps 5-8, the one definition, on candidate logits best first: soft-cap, temperature, min-p, top-p.

    Returns (weights relative to the best, their cumulative sums, how many survive: a prefix). `total`: the weight
    of the whole vocabulary on the same scale, when the candidates are not all of what top-p is measured against.
    """
    weights = ops.weights(values, softcap, 1.0 / params.temperature)  # the best one is 1.0
    cum = ops.cumsum(weights)
    n, mass = len(weights), float(cum[-1]) if total is None else total
    if params.min_p > 0.0:
        n = ops.count_at_least(weights, params.min_p)  # p >= min_p * p_max
        mass = float(cum[n - 1])  # top-p renormalises over the min-p survivors
    if params.top_p < 1.0:
        # Keep a token while the mass strictly before it is below top_p: always the best one, and the one that
        # crosses the threshold (HF's TopPLogitsWarper, vLLM).
        n = min(ops.count_below(cum, params.top_p * mass, n) + 1, n)
    return weights, cum, n


def small_top_k(params: SamplingParams, vocab: int) -> bool:
    """Whether `candidates` takes a top-k on Python floats for these parameters (by default): the route
    `topk_rows` serves many rows of at once."""
    return not params.greedy and 0 < params.top_k < vocab and params.top_k <= _PYTHON_TOP_K


def top_k_candidates(values: Any, ids: Any, params: SamplingParams, softcap: float | None,
                     ops: CandidateMath = FLOATS) -> Candidates:
    """Steps 5-8 on a row's top-k (values best first, their ids), from `topk` or one row of `topk_rows`."""
    return Candidates(ids, *_truncate(values, params, softcap, ops), ops)


def candidates(x: torch.Tensor, params: SamplingParams, softcap: float | None, scratch: torch.Tensor | None = None,
               *, floats: bool | None = None) -> Candidates:
    """Steps 4-8 of the module docs, without the draw.

    x: [V] logits after bias and penalties (steps 1-2), raw (not soft-capped).
    scratch: a [V] float32 buffer for the full-vocabulary passes that only top-k off needs (else allocated).
    floats: run a top-k's steps 5-8 on Python floats (default: when k <= _PYTHON_TOP_K).
    """
    assert not params.greedy and x.dim() == 1, "sampling path needs temperature > 0 and a [V] row"
    vocab = x.numel()
    if 0 < params.top_k < vocab:
        ops = FLOATS if (params.top_k <= _PYTHON_TOP_K if floats is None else floats) else TENSORS
        if ops is FLOATS:  # one row of `topk_rows`: what the same row gets beside others in `sample_rows`
            row_values, row_ids = topk_rows(x.view(1, -1), params.top_k)
            return top_k_candidates(row_values[0], row_ids[0], params, softcap, ops)
        values, ids = topk(x, params.top_k)  # (k,) best first
        return top_k_candidates(values, ids, params, softcap, ops)

    buf = scratch if scratch is not None else torch.empty_like(x)  # (V,)
    inv_t = 1.0 / params.temperature
    if params.min_p <= 0.0 and params.top_p >= 1.0:
        # Nothing truncates: the whole vocabulary, in id order (no sort needed to draw by inverse CDF).
        peak = float(_tensor_scale(x.amax().view(1), softcap, inv_t))
        _sum_exp(x, softcap, inv_t, peak, buf)
        return Candidates(None, buf, buf.cumsum(0), vocab)  # (V,), (V,)

    if params.min_p <= 0.0:  # top-p alone: one row of `nucleus_rows`, what the same row gets beside others
        return nucleus_rows(x.view(1, -1), [params], softcap, [buf])[0]

    # top-k off, min-p truncates: probe (see the module's choices), so a peaked distribution costs a small top-k.
    return _probe(x, params, softcap, None, _FIRST_PROBE)


def _probe(x: torch.Tensor, params: SamplingParams, softcap: float | None, total: float | None,
           probe: int) -> Candidates:
    """Steps 7-8 with top-k off on one row x [V], from a top-`probe`, grown 8x until the kept set provably fits.
    total: the whole row's weight (`row_totals`), which top-p alone is measured against; None with min-p."""
    vocab = x.numel()
    while probe < vocab:
        values, ids = topk(x, probe)  # (probe,) best first
        if params.min_p > 0.0:
            # min-p is a ratio to the best token: the probe holds every survivor once its last (smallest) weight
            # already fails, as every token outside is <= it.
            weights, cum, n = _truncate(values, params, softcap, TENSORS)
            if float(weights[-1]) < params.min_p:
                return Candidates(ids, weights, cum, n)
        else:
            assert total is not None
            weights, cum, n = _truncate(values, params, softcap, TENSORS, total)
            missing = params.top_p * total - float(cum[-1])
            if missing <= 0.0:
                return Candidates(ids, weights, cum, n)
            # Every token outside weighs <= the last one: at least missing / weights[-1] more are needed.
            if probe + missing / max(float(weights[-1]), 1e-30) > _LAST_PROBE:
                break
        probe *= 8
    # A flat distribution: sort everything, still exact.
    values, ids = torch.sort(x, descending=True)  # (V,)
    return Candidates(ids, *_truncate(values, params, softcap, TENSORS))


def row_totals(x: torch.Tensor, softcap: float | None, inv_t: float, peaks: list[float],
               scratch: Sequence[torch.Tensor]) -> list[float]:
    """sum(exp(cap(x) * inv_t - peak)) of each row of x [R, V] (not modified), row r through its own scratch[r] [V]:
    the weight of the whole vocabulary on the scale of `_truncate`'s weights (peaks: each row's best scaled logit).

    Row by row on purpose: one row and its scratch stay in L2 across the chain of passes, where [R, V] at once streams
    from L3 every pass (measured ~2x dearer at R = 4), and a row's total is the same alone or beside others.
    With a soft-cap, cap(x) * inv_t = 2 cap inv_t * sigmoid(2x / cap) - cap inv_t: torch's tanh costs ~10x its sigmoid
    here (the total was ~0.6 of a top-p row's 1.1 ms) and its exp ~4x its exp2 (0.18 vs 0.04 ms a row); while
    2 cap inv_t + log V stays well inside float32's range, the shift is a scalar applied after the sum (one pass fewer).
    The terms differ from the candidates' tanh-capped ones by rounding (~3e-6 relative): the top-p threshold moves
    by about as much as a float32 sum over the vocabulary moves it."""
    totals = []
    for row, peak, buf in zip(x, peaks, scratch, strict=True):
        if softcap is not None and 2.0 * softcap * inv_t + math.log(row.numel()) < 80.0:
            # exp(2 cap inv_t s) as 2 ** (2 cap inv_t log2(e) s), s = sigmoid(2x / cap)
            torch.mul(row, 2.0 / softcap, out=buf).sigmoid_().mul_(2.0 * softcap * inv_t / math.log(2.0)).exp2_()  # (V,)
            totals.append(float(buf.sum()) * math.exp(-softcap * inv_t - peak))
        else:
            totals.append(_sum_exp(row, softcap, inv_t, peak, buf))
    return totals


def top_p_alone(params: SamplingParams, vocab: int) -> bool:
    """top-k off, no min-p, top-p truncating: the rows `nucleus_rows` serves (one row of them in `candidates`)."""
    return (not params.greedy and not 0 < params.top_k < vocab and params.min_p <= 0.0
            and params.top_p < 1.0)


def nucleus_rows(x: torch.Tensor, params: list[SamplingParams], softcap: float | None,
                 scratch: Sequence[torch.Tensor]) -> list[Candidates]:
    """Steps 5-8 of each row of x [R, V] on top-p alone (`top_p_alone`), all rows with one temperature: one
    `topk_rows` of the first probe for every row and each row's `row_totals`, then steps 5-8 per row on Python floats;
    a row whose probe holds less than top_p of its total grows its probe alone (`_probe`), as it would alone.
    The nucleus is a best-first prefix, so a probe that already holds top_p of the whole mass holds all of it
    (ties at the edge: the probe's own order, torch.topk's, as the sorted reference would have them)."""
    rows, vocab = x.shape
    inv_t = 1.0 / params[0].temperature
    assert all(1.0 / p.temperature == inv_t and top_p_alone(p, vocab) for p in params)
    k = min(_FIRST_PROBE, vocab)
    values, ids = topk_rows(x, k)  # R lists of k, best first
    peaks = [FLOATS.scale(row[:1], softcap, inv_t)[0] for row in values]
    totals = row_totals(x, softcap, inv_t, peaks, scratch)  # scratch: R rows [V]
    out = []
    for r, (p, row_values, row_ids, total) in enumerate(zip(params, values, ids, totals, strict=True)):
        weights, cum, n = _truncate(row_values, p, softcap, FLOATS, total)
        missing = p.top_p * total - cum[-1]
        if missing <= 0.0 or k == vocab:
            out.append(Candidates(row_ids, weights, cum, n, FLOATS))
        else:  # as `_probe` grows: straight to the sort when at least missing / weights[-1] more are needed
            hopeless = k + missing / max(weights[-1], 1e-30) > _LAST_PROBE
            out.append(_probe(x[r], p, softcap, total, vocab if hopeless else k * 8))
    return out


def draw(c: Candidates, rng: random.Random) -> int:
    """Step 9: one token in proportion to the weights of the first c.n candidates (inverse CDF: one uniform)."""
    target = rng.random() * float(c.cum[c.n - 1])
    i = min(c.ops.count_below(c.cum, target, c.n, or_equal=True), c.n - 1)
    return i if c.ids is None else int(c.ids[i])


def raw_logprobs(x: torch.Tensor, ids: torch.Tensor, softcap: float | None, scratch: torch.Tensor | None = None,
                 max_id: int | None = None) -> torch.Tensor:
    """log_softmax(cap(x))[ids] without materialising the log-softmax: one pass for the normaliser.

    x: [V] logits after bias and penalties; ids: (n,); max_id: argmax of x when the caller knows it. Returns (n,) float32.
    """
    buf = scratch if scratch is not None else torch.empty_like(x)  # (V,)
    if softcap is not None and softcap + math.log(x.numel()) < 80.0:
        # |cap(x)| < cap, so even summed over the vocabulary exp cannot overflow float32 (~e^88) nor underflow:
        # no max, no shift, one pass fewer (~15% of this function).
        torch.mul(x, 1.0 / softcap, out=buf).tanh_().mul_(softcap)  # (V,)
        log_total = math.log(float(buf.exp_().sum()))
    else:
        top = x[max_id].view(1) if max_id is not None else x.amax().view(1)  # (1,)
        peak = float(_tensor_scale(top, softcap, 1.0))  # the soft-cap is monotonic: the max of cap(x) is cap(max x)
        log_total = peak + math.log(_sum_exp(x, softcap, 1.0, peak, buf))
    return _tensor_scale(x.index_select(0, ids), softcap, 1.0).sub_(log_total)  # (n,)


# Rows of prompt logits normalised at once: a [32, V] f32 scratch is 33 MB at V = 262144, where a whole 512-token
# prompt's would be 0.5 GB more of host memory beside the graph's own output.
_PROMPT_ROWS = 32


def _log_normalisers(rows: torch.Tensor, softcap: float | None, buf: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(cap(row)))) of each row of rows [R, V] (not modified), through the scratch `buf` [R, V]: [R, 1].

    With a soft-cap the full pass uses cap * tanh(x / cap) = 2 cap * sigmoid(2x / cap) - cap: torch's tanh costs ~10x
    its sigmoid on this host (1.1 vs 0.11 ms a 262144-wide row), which made the cap most of a scored prompt's cost.
    The two differ by rounding (~1e-6 of the cap); the values at the tokens shown are capped with tanh itself, as
    the sampler caps them. |cap(x)| < cap, so exp needs no shift while cap + log V stays well inside float32's range."""
    if softcap is not None and softcap + math.log(rows.shape[1]) < 80.0:
        torch.mul(rows, 2.0 / softcap, out=buf).sigmoid_().mul_(2.0 * softcap).sub_(softcap).exp_()  # [R, V]
        return buf.sum(1, keepdim=True).log_()  # [R, 1]
    x = rows if softcap is None else torch.div(rows, softcap, out=buf).tanh_().mul_(softcap)  # [R, V]
    peak = x.amax(1, keepdim=True)  # [R, 1]
    torch.sub(x, peak, out=buf).exp_()  # [R, V]
    return buf.sum(1, keepdim=True).log_().add_(peak)  # [R, 1]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int, softcap: float | None
                    ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each row's log_softmax(cap(row)) at its target token, and at its `top` best tokens (best first): what the
    prompt's token logprobs are (vLLM's `prompt_logprobs`: raw, as the sampler's logprobs are, with no bias, penalty
    or temperature, since no sampling happened there). logits: [T, V] f32, not modified; targets: T ids.

    The soft-cap is monotonic, so the best tokens are those of the raw row. A target that is its row's best gets
    exactly the best's value (the same operations on the same number): an evaluation harness's "is greedy" compares
    the two for equality."""
    out: list[tuple[float, list[tuple[int, float]]]] = []
    wanted = torch.tensor(targets, dtype=torch.long)[:, None]  # [T, 1]
    k = min(top, logits.shape[1])
    buf = torch.empty(min(_PROMPT_ROWS, len(targets)), logits.shape[1])  # [R, V] scratch, once per call
    for start in range(0, len(targets), _PROMPT_ROWS):
        rows = logits[start : start + _PROMPT_ROWS]  # [R, V]
        r = rows.shape[0]
        norm = _log_normalisers(rows, softcap, buf[:r])  # [R, 1]
        ids = torch.cat([wanted[start : start + r], torch.topk(rows, k, dim=1).indices], dim=1)  # [R, 1 + k]
        values = _tensor_scale(rows.gather(1, ids), softcap, 1.0).sub_(norm)  # [R, 1 + k]
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True):
            out.append((row_values[0], list(zip(row_ids[1:], row_values[1:], strict=True))))
    return out
