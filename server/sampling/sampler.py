"""Choosing the next token from one row of logits, cheaply, on the host CPU.

The graph hands back raw logits over Gemma's 262,144-token vocabulary; the host has two cores, so each
token's sampling cost matters. Order of operations (each step sees the previous step's output):

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
    9. draw                            inverse CDF: one uniform from the request's own torch.Generator
                                       (seeded => reproducible), searched in the kept prefix sums

A request's constraint (server/constraints.py) is applied between 2 and 3: disallowed tokens become -inf
(server/constraint_mask.py), and the soft-cap is applied to the allowed ones in the same pass, so -inf stays -inf
(cap(-inf) would be -30: a masked token would keep a tiny probability). Steps 3-9 then see an already capped row.
min_tokens masks the stop ids the same way until enough tokens were generated.

logprobs are vLLM's default "raw" ones: log-softmax over the whole vocabulary of the logits after steps 1,
2 and 5 (bias, penalties, soft-cap), before temperature and truncation.

Deliberate choices (measured on a 2-core host at V=262144; do not "fix" these without measuring):
- No full-vocabulary sort on the usual path. `torch.topk(x, 64)` costs ~1 ms and `torch.argmax` ~0.5 ms,
  while a streaming max over 64-wide blocks costs ~0.04 ms; `topk`/`argmax` below use the block maxima.
- The caller's logits are never modified (a graph may hand back the same buffer every step). Bias and
  penalties write into a per-request scratch row, so no call allocates more than one vocabulary-sized tensor.
- Penalties touch only the seen token ids (index ops over distinct ids kept as tensors).
- top-k off with top-p/min-p: probe the best 64, 512, ... tokens until the kept set provably fits; only a
  near-flat distribution falls back to the full sort.
- Torch's intra-op threads: with 2 threads these ops stall for milliseconds whenever the other core is busy
  (thread-pool hand-off); single-threaded they are steady. That is process-wide policy, left to the caller.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from server.sampling.params import SamplingParams, TokenConstraint

# Block width of the two-stage argmax: the fastest on this host at V=262144 (`_topk_block` for top-k).
_ARGMAX_BLOCK = 256
# First candidate count when top-k is off but top-p/min-p still truncate; grows 8x until the kept set fits.
_FIRST_PROBE = 64
_LAST_PROBE = 32_768  # beyond this a full sort is about as cheap as another probe
# Up to this top-k, steps 5-9 run on the k candidates as Python floats (`_FLOATS`): a handful of torch calls
# instead of ~25. What that buys is measured between device steps, where caches have gone cold and every torch
# call costs ~25 us more (default sampling then: ~0.6 ms with tensors vs ~0.4 ms with Python floats here).
_PYTHON_TOP_K = 256


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float | None  # when params.logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first, len = params.top_logprobs


# ----------------------------------------------------------------------------------------------------------
# Pure primitives on a 1-D logits row


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


def _block_topk(x: torch.Tensor, k: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`topk`'s two stages: (values best first, their positions among the gathered blocks, the blocks), or None
    where blocks do not apply."""
    n = x.numel()
    if not block or n % block or n // block < 2 * k or not x.is_contiguous():
        return None
    blocks = x.view(-1, block)  # (V/B, B)
    top_blocks = torch.topk(blocks.amax(1), k, sorted=False).indices  # (k,)
    values, pos = torch.topk(blocks.index_select(0, top_blocks).view(-1), k)  # (k,), (k,) into (k*B,)
    return values, pos, top_blocks


def topk(x: torch.Tensor, k: int, block: int | None = None, *, as_lists: bool = False) -> tuple[Any, Any]:
    """Exact top-k of a 1-D tensor: (values best first, indices), without torch.topk over all of it.

    The k blocks with the largest maxima hold the k largest values: an element outside them is <= its block's
    maximum <= the k-th largest block maximum, and those k blocks already hold k elements at least that large.
    So: one streaming pass for block maxima, a top-k over V/block maxima, a top-k over k*block gathered values.
    Values equal torch.topk's exactly; among equal values the indices may differ.
    as_lists: Python lists, the ids computed in Python (five fewer torch calls for a small k).
    """
    block = _topk_block(k) if block is None else block
    staged = _block_topk(x, k, block)
    if staged is None:
        values, ids = torch.topk(x, k)  # small, odd-sized or huge-k cases: the direct route
        return (values.tolist(), ids.tolist()) if as_lists else (values, ids)
    values, pos, top_blocks = staged
    if as_lists:
        starts = top_blocks.tolist()
        return values.tolist(), [starts[p // block] * block + p % block for p in pos.tolist()]
    return values, top_blocks[pos // block] * block + pos % block  # (k,), (k,)


def argmax(x: torch.Tensor, block: int = _ARGMAX_BLOCK) -> int:
    """torch.argmax(x) (first index of the maximum) via block maxima: ~8x faster than torch.argmax here."""
    n = x.numel()
    if n % block or n < 4 * block or not x.is_contiguous():
        return int(x.argmax())
    blocks = x.view(-1, block)  # (V/B, B)
    b = int(blocks.amax(1).argmax())  # first block holding the maximum
    return b * block + int(blocks[b].argmax())


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


class _Ops(NamedTuple):
    """The five operations steps 5-9 need, on one kind of candidate list."""

    scale: Callable[[Any, float | None, float], Any]  # soft-cap, then temperature; a new sequence
    weights: Callable[[Any, float], Any]  # exp(scaled - peak)
    cumsum: Callable[[Any], Any]
    count_at_least: Callable[[Any, float], int]
    below: Callable[..., int]  # (cum, target, n, right=False): how many of cum[:n] are < target (<= with right)


def _float_scale(values: list[float], softcap: float | None, inv_t: float) -> list[float]:
    if softcap is not None:
        values = [softcap * math.tanh(v / softcap) for v in values]
    return [v * inv_t for v in values]


def _tensor_scale(values: torch.Tensor, softcap: float | None, inv_t: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's final-logit soft-cap), then times inv_t, on a few values; a new tensor either way."""
    scaled = values.clone() if softcap is None else values.div(softcap).tanh_().mul_(softcap)
    return scaled if inv_t == 1.0 else scaled.mul_(inv_t)


# Python floats: a handful of torch calls instead of ~25 for a small top-k (see _PYTHON_TOP_K).
_FLOATS = _Ops(
    _float_scale, lambda scaled, peak: [math.exp(v - peak) for v in scaled], lambda w: list(itertools.accumulate(w)),
    lambda w, threshold: sum(1 for x in w if x >= threshold),
    lambda cum, target, n, right=False: (bisect.bisect_right if right else bisect.bisect_left)(cum, target, 0, n))
# Tensors: any number of candidates.
_TENSORS = _Ops(
    _tensor_scale, lambda scaled, peak: scaled.sub_(peak).exp_(), lambda w: w.cumsum(0),
    lambda w, threshold: int((w >= threshold).sum()),
    lambda cum, target, n, right=False: int(torch.searchsorted(cum[:n], target, right=right)))


class Candidates(NamedTuple):
    """The tokens one sampling step draws from: the first `n` of `ids`, in proportion to `weights`."""

    ids: Any  # (m,) token ids best first (a list on the Python-floats route); None: the whole vocabulary in id order
    weights: Any  # (m,) unnormalised probabilities exp(scaled logit - shift)
    cum: Any  # (m,) cumulative sums of weights
    n: int  # the survivors of min-p and top-p: a prefix
    ops: _Ops = _TENSORS


def _truncate(values: Any, params: SamplingParams, softcap: float | None, ops: _Ops,
              total: float | None = None) -> tuple[Any, Any, int]:
    """Steps 5-8, the one definition, on candidate logits best first: soft-cap, temperature, min-p, top-p.

    Returns (weights relative to the best, their cumulative sums, how many survive: a prefix). `total`: the weight
    of the whole vocabulary on the same scale, when the candidates are not all of what top-p is measured against.
    """
    scaled = ops.scale(values, softcap, 1.0 / params.temperature)
    weights = ops.weights(scaled, float(scaled[0]))  # the best one is 1.0
    cum = ops.cumsum(weights)
    n, mass = len(weights), float(cum[-1]) if total is None else total
    if params.min_p > 0.0:
        n = ops.count_at_least(weights, params.min_p)  # p >= min_p * p_max
        mass = float(cum[n - 1])  # top-p renormalises over the min-p survivors
    if params.top_p < 1.0:
        # Keep a token while the mass strictly before it is below top_p: always the best one, and the one that
        # crosses the threshold (HF's TopPLogitsWarper, vLLM).
        n = min(ops.below(cum, params.top_p * mass, n) + 1, n)
    return weights, cum, n


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
        ops: _Ops = _FLOATS if (params.top_k <= _PYTHON_TOP_K if floats is None else floats) else _TENSORS
        values, ids = topk(x, params.top_k, as_lists=ops is _FLOATS)  # (k,) best first
        return Candidates(ids, *_truncate(values, params, softcap, ops), ops)

    buf = scratch if scratch is not None else torch.empty_like(x)  # (V,)
    inv_t = 1.0 / params.temperature
    if params.min_p <= 0.0 and params.top_p >= 1.0:
        # Nothing truncates: the whole vocabulary, in id order (no sort needed to draw by inverse CDF).
        peak = float(_tensor_scale(x.amax().view(1), softcap, inv_t))
        _sum_exp(x, softcap, inv_t, peak, buf)
        return Candidates(None, buf, buf.cumsum(0), vocab)  # (V,), (V,)

    # top-k off, yet min-p/top-p truncate: probe the best 64, 512, ... until the kept set provably fits inside,
    # so a peaked distribution (the usual case) costs a small top-k, not a sort of 262k values.
    total: float | None = None  # sum of all weights over the vocabulary: what top-p alone is measured against
    probe = _FIRST_PROBE
    while probe < vocab:
        values, ids = topk(x, probe)  # (probe,) best first
        if params.min_p > 0.0:
            # min-p is a ratio to the best token: the probe holds every survivor once its last (smallest) weight
            # already fails, as every token outside is <= it.
            weights, cum, n = _truncate(values, params, softcap, _TENSORS)
            if float(weights[-1]) < params.min_p:
                return Candidates(ids, weights, cum, n)
        else:
            if total is None:
                total = _sum_exp(x, softcap, inv_t, float(_tensor_scale(values[:1], softcap, inv_t)), buf)
            weights, cum, n = _truncate(values, params, softcap, _TENSORS, total)
            missing = params.top_p * total - float(cum[-1])
            if missing <= 0.0:
                return Candidates(ids, weights, cum, n)
            # Every token outside weighs <= the last one: at least missing / weights[-1] more are needed.
            if probe + missing / max(float(weights[-1]), 1e-30) > _LAST_PROBE:
                break
        probe *= 8
    # A flat distribution: sort everything, still exact.
    values, ids = torch.sort(x, descending=True)  # (V,)
    return Candidates(ids, *_truncate(values, params, softcap, _TENSORS))


def draw(c: Candidates, rng: random.Random) -> int:
    """Step 9: one token in proportion to the weights of the first c.n candidates (inverse CDF: one uniform)."""
    target = rng.random() * float(c.cum[c.n - 1])
    i = min(c.ops.below(c.cum, target, c.n, right=True), c.n - 1)
    return i if c.ids is None else int(c.ids[i])


def raw_logprobs(
    x: torch.Tensor,
    ids: torch.Tensor,
    softcap: float | None,
    scratch: torch.Tensor | None = None,
    max_id: int | None = None,
) -> torch.Tensor:
    """log_softmax(cap(x))[ids] without materialising the log-softmax: one pass for the normaliser.

    x: [V] logits after bias and penalties; ids: (n,); max_id: argmax of x when the caller knows it.
    Returns (n,) float32.
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


# ----------------------------------------------------------------------------------------------------------
# Per-request state


class _SeenTokens:
    """Distinct token ids in first-seen order and how often each was seen, as tensors ready for index ops."""

    __slots__ = ("_pos", "_ids", "_counts", "_n")

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        seen = Counter(tokens)
        self._n = len(seen)
        self._pos = {token: i for i, token in enumerate(seen)}
        capacity = max(64, 2 * self._n)
        self._ids = torch.zeros(capacity, dtype=torch.long)  # (capacity,), first _n valid
        self._counts = torch.zeros(capacity)  # (capacity,) float32, to combine with logits directly
        if self._n:
            self._ids[: self._n] = torch.tensor(list(seen), dtype=torch.long)
            self._counts[: self._n] = torch.tensor(list(seen.values()), dtype=torch.float32)

    def add(self, token: int) -> None:
        pos = self._pos.get(token)
        if pos is not None:
            self._counts[pos] += 1
            return
        if self._n == self._ids.numel():  # grow by doubling: amortised O(1) per new token
            self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
            self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
        self._pos[token] = self._n
        self._ids[self._n] = token
        self._counts[self._n] = 1
        self._n += 1

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: self._n]  # (n,)

    @property
    def counts(self) -> torch.Tensor:
        return self._counts[: self._n]  # (n,)


class Sampler:
    """Per-request state: the seeded random generator and the token counts the penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: Sequence[int], softcap: float | None,
                 *, constraint: TokenConstraint | None = None, stop_ids: Sequence[int] = (), min_tokens: int = 0):
        assert params.temperature >= 0.0 and 0.0 < params.top_p <= 1.0 and 0.0 <= params.min_p <= 1.0
        assert params.repetition_penalty > 0.0 and 0 <= params.top_logprobs <= 20
        assert softcap is None or softcap > 0.0
        self.params = params
        self.vocab_size = vocab_size
        self.softcap = softcap
        # One uniform per token is all a draw needs; Python's generator gives it without a torch call. Unseeded
        # requests get fresh state from the OS.
        self.rng = random.Random(params.seed)
        self._bias_ids: torch.Tensor | None = None
        self._bias_values: torch.Tensor | None = None
        if params.logit_bias:
            self._bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)  # (b,)
            self._bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)  # (b,)
        # Only the history a penalty needs is kept: prompt + output for repetition, output for the OpenAI pair.
        self._seen = _SeenTokens(prompt_ids) if params.repetition_penalty != 1.0 else None
        wants_counts = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._output = _SeenTokens() if wants_counts else None
        self._adjusts = self._bias_ids is not None or self._seen is not None or self._output is not None
        # Scratch rows, one allocation per request and reused every step, so the caller's logits stay untouched
        # and no step allocates more than one vocabulary-sized tensor: the adjusted logits, and a row for the
        # full-vocabulary passes (the logprob normaliser; top-k off).
        top_k_off = not params.greedy and not 0 < params.top_k < vocab_size
        self._adjusted = torch.empty(vocab_size) if self._adjusts else None  # (V,)
        self._scratch = torch.empty(vocab_size) if params.logprobs or top_k_off else None  # (V,)
        # The constraint and min_tokens mask a copy of the adjusted row (the caller's logits stay untouched).
        self.constraint = constraint
        self._min_tokens = min_tokens
        self._generated = 0
        self._stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)  # (s,)
        self._masks = constraint is not None or (min_tokens > 0 and len(stop_ids) > 0)
        self._masked = torch.empty(vocab_size) if self._masks and self._adjusted is None else None  # (V,)
        self._token_mask: Any = None
        if constraint is not None:
            from server.sampling.mask import TokenMask  # numpy/llguidance-side: only constrained requests load it

            self._token_mask = TokenMask(vocab_size)

    def accept(self, token_id: int) -> None:
        """Record a generated token (for the penalties and min_tokens). The constraint is advanced by the engine."""
        assert 0 <= token_id < self.vocab_size
        self._generated += 1
        if self._seen is not None:
            self._seen.add(token_id)
        if self._output is not None:
            self._output.add(token_id)

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Steps 1-2 (logit_bias, penalties). Returns `logits` itself when nothing applies, else a scratch row
        that the next call overwrites."""
        if self._adjusted is None:
            return logits
        x = self._adjusted.copy_(logits)  # (V,)
        if self._bias_ids is not None:
            x.index_add_(0, self._bias_ids, self._bias_values)
        if self._seen is not None and self._seen.ids.numel():
            ids = self._seen.ids  # (n,)
            vals = x.index_select(0, ids)  # (n,)
            penalty = self.params.repetition_penalty
            x.index_copy_(0, ids, torch.where(vals > 0, vals / penalty, vals * penalty))
        if self._output is not None and self._output.ids.numel():
            counts = self._output.counts  # (m,) every one >= 1, so presence applies to all
            x.index_add_(0, self._output.ids, counts * -self.params.frequency_penalty - self.params.presence_penalty)
        return x

    def mask(self, x: torch.Tensor) -> tuple[torch.Tensor, float | None]:
        """The constraint's mask (with the soft-cap on the allowed tokens) and min_tokens' ban on stop ids, on a row
        of our own: (the row, the soft-cap still to apply to it). `x` itself when neither applies."""
        banning = self._generated < self._min_tokens and self._stop_ids.numel() > 0
        if self.constraint is None and not banning:
            return x, self.softcap
        if x is not self._adjusted:  # still the caller's buffer: never modified
            assert self._masked is not None
            x = self._masked.copy_(x)  # (V,)
        if self.constraint is not None:
            self._token_mask.apply_(self.constraint, x, self.softcap)  # -inf where disallowed; capped elsewhere
        elif self.softcap is not None:
            x.div_(self.softcap).tanh_().mul_(self.softcap)  # cap first, so the banned ids stay -inf
        if banning:
            x.index_fill_(0, self._stop_ids, float("-inf"))
        return x, None

    def sample(self, logits: torch.Tensor) -> SampleResult:
        """logits: [V] float32, raw (the soft-cap is applied here). Not modified."""
        assert logits.shape == (self.vocab_size,) and logits.dtype == torch.float32, "expect a raw [V] f32 row"
        params = self.params
        x, softcap = self.mask(self.adjust(logits))  # (V,)
        best: torch.Tensor | list[int] | None = None  # candidate ids best first, when known: reusable for top_logprobs
        if params.greedy:
            token = argmax(x)  # soft-cap and temperature are monotonic: argmax of the adjusted raw logits
        else:
            c = candidates(x, params, softcap, self._scratch)
            token = draw(c, self.rng)
            best = c.ids
        if not params.logprobs:
            return SampleResult(token, None)

        n = min(params.top_logprobs, self.vocab_size)
        if n == 0:
            top_ids = torch.empty(0, dtype=torch.long)
        elif best is not None and len(best) >= n:
            top_ids = torch.as_tensor(best[:n])  # (N,) already the best N of x
        else:
            top_ids = topk(x, n)[1]  # (N,)
        wanted = torch.cat([torch.tensor([token]), top_ids])  # (1 + N,) the chosen token, then the best N
        max_id = token if params.greedy else (int(best[0]) if best is not None else None)  # saves a pass
        logprobs = raw_logprobs(x, wanted, softcap, self._scratch, max_id).tolist()
        top = tuple(zip(top_ids.tolist(), logprobs[1:], strict=True))
        if self._masks:
            top = tuple(entry for entry in top if entry[1] > -math.inf)  # masked tokens are not alternatives
        return SampleResult(token, logprobs[0], top)
