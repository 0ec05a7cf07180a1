"""`Sampler`: one request's sampling state, choosing the next token from one row of logits on the host CPU (the steps
and their order: server.sampling.primitives). It owns what needs per-request state: steps 1-2 (logit_bias, penalties:
the token counts seen so far), the constraint's mask, min_tokens, the seeded random generator, and logprobs.

The constraint's mask (server.sampling.mask) goes between steps 2 and 3, with the soft-cap applied to the allowed
tokens in the same pass, so -inf stays -inf (cap(-inf) would be -30: a masked token would keep a tiny probability);
steps 3-9 then see an already capped row. min_tokens bans the stop ids the same way until enough tokens were
generated. logprobs are vLLM's default "raw" ones: log-softmax over the whole vocabulary of the logits after steps
1, 2 and 5 (bias, penalties, soft-cap), before temperature and truncation.

Deliberate choices (measured on a 2-core host at V=262144; do not "fix" these without measuring):
- The caller's logits are never modified (a graph may hand back the same buffer every step). Bias and
  penalties write into a per-request scratch row, so no call allocates more than one vocabulary-sized tensor.
- Penalties touch only the seen token ids (index ops over distinct ids kept as tensors).
- One uniform per draw from Python's `random.Random` (seeded per request): no torch call for it.
- Torch's intra-op threads are process-wide policy, left to the caller (server.app.process: single-threaded).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from server.sampling.params import SamplingParams, TokenConstraint
from server.sampling.primitives import (
    argmax,
    argmax_rows,
    candidates,
    draw,
    nucleus_rows,
    raw_logprobs,
    small_top_k,
    top_k_candidates,
    top_p_alone,
    topk,
    topk_rows,
)


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: float | None  # when params.logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first, len = params.top_logprobs


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
        self.rng = random.Random(params.seed)  # unseeded: fresh state from the OS
        bias = params.logit_bias
        self._bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long) if bias else None  # (b,)
        self._bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32) if bias else None  # (b,)
        # Only the history a penalty needs is kept: prompt + output for repetition, output for the OpenAI pair.
        self._seen = _SeenTokens(prompt_ids) if params.repetition_penalty != 1.0 else None
        wants_counts = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self._output = _SeenTokens() if wants_counts else None
        self._adjusts = self._bias_ids is not None or self._seen is not None or self._output is not None
        # Scratch rows, allocated once per request and reused every step (the caller's logits stay untouched): the
        # adjusted logits, a row for the full-vocabulary passes (the logprob normaliser; top-k off), and a row for
        # the masks when there is no adjusted row to mask in place.
        top_k_off = not params.greedy and not 0 < params.top_k < vocab_size
        self._adjusted = torch.empty(vocab_size) if self._adjusts else None  # (V,)
        self._scratch = torch.empty(vocab_size) if params.logprobs or top_k_off else None  # (V,)
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

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply first (bias, penalties, a mask, min_tokens' ban) and no logprobs: the token is
        the argmax of the raw row, which `sample_rows` takes for many rows in one pass."""
        banning = self._generated < self._min_tokens and self._stop_ids.numel() > 0
        return (self.params.greedy and not self.params.logprobs and not self._adjusts and not self._constrained
                and not banning)

    @property
    def small_top_k(self) -> bool:
        """Sampled from a small top-k (`primitives.small_top_k`): the rows `sample_rows` takes the top-k of together."""
        return small_top_k(self.params, self.vocab_size)

    @property
    def top_p_alone(self) -> bool:
        """Sampled on top-p alone (`primitives.top_p_alone`): the rows `sample_rows` takes `nucleus_rows` of together."""
        return top_p_alone(self.params, self.vocab_size)

    @property
    def _constrained(self) -> bool:
        """The constraint has a mask to apply at this step (a free step's would allow every token)."""
        return self.constraint is not None and not self.constraint.free

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
        constrained = self._constrained
        if not constrained and not banning:
            return x, self.softcap
        if x is not self._adjusted:  # still the caller's buffer: never modified
            assert self._masked is not None
            x = self._masked.copy_(x)  # (V,)
        if constrained:
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
        return self._result(x, softcap, token, best)

    def _result(self, x: torch.Tensor, softcap: float | None, token: int,
                best: torch.Tensor | list[int] | None) -> SampleResult:
        """The token, with its logprobs when asked. x, softcap: the row it was chosen from (after steps 1-2 and
        the mask) and the soft-cap still to apply to it; best: candidate ids best first, when known."""
        params = self.params
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


def sample_rows(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[SampleResult]:
    """The next token of each row of logits [B, V] (raw, f32, not modified), row b by samplers[b]: each row exactly
    what samplers[b].sample(logits[b]) gives, token for token and RNG draw for RNG draw. Three kinds of rows are
    served together: the plain greedy rows (`Sampler.plain_greedy`) in one argmax pass, the rows sampled from
    a small top-k (`Sampler.small_top_k`, Gemma-4's default top_k 64) in one top-k pass per k (`_sample_top_k`), and
    the rows on top-p alone (`Sampler.top_p_alone`) in one first probe per temperature (`_sample_nucleus`; each
    row's total over the vocabulary stays a pass of its own, L2-resident). The rest (min-p with top-k off, a large
    top-k, nothing truncating) go row by row."""
    if len(samplers) == 1:
        return [samplers[0].sample(logits[0])]
    results: list[SampleResult | None] = [None] * len(samplers)
    plain = [b for b, sampler in enumerate(samplers) if sampler.plain_greedy]
    if len(plain) > 1:
        rows = logits if len(plain) == len(samplers) else logits[plain]  # [P, V]
        for b, token in zip(plain, argmax_rows(rows), strict=True):
            results[b] = SampleResult(token, None)
    by_k: dict[int, list[int]] = {}
    for b, sampler in enumerate(samplers):
        if results[b] is None and sampler.small_top_k:
            by_k.setdefault(sampler.params.top_k, []).append(b)
    for k, group in by_k.items():
        if len(group) > 1:
            for b, result in zip(group, _sample_top_k([samplers[b] for b in group], logits, group, k), strict=True):
                results[b] = result
    by_t: dict[float, list[int]] = {}
    for b, sampler in enumerate(samplers):
        if results[b] is None and sampler.top_p_alone:
            by_t.setdefault(sampler.params.temperature, []).append(b)
    for group in by_t.values():
        if len(group) > 1:
            for b, result in zip(group, _sample_nucleus([samplers[b] for b in group], logits, group), strict=True):
                results[b] = result
    for b, sampler in enumerate(samplers):
        if results[b] is None:
            results[b] = sampler.sample(logits[b])  # [V]
    return results  # type: ignore[return-value]


def _sample_top_k(samplers: Sequence[Sampler], logits: torch.Tensor, rows: Sequence[int], k: int) -> list[SampleResult]:
    """`Sampler.sample` of logits[rows[i]] by samplers[i], all with top_k == k on the small-top-k route: steps 1-2 and
    the mask per row (each into its own scratch row, as alone), one `topk_rows` over the prepared rows, then steps
    5-9 and the logprobs per row with the row's own generator: the same operations on the same values as alone."""
    prepared = [sampler.mask(sampler.adjust(logits[b])) for sampler, b in zip(samplers, rows, strict=True)]
    stacked = _stacked([x for x, _ in prepared], logits, rows)  # [R, V]
    values, ids = topk_rows(stacked, k)  # R lists of k, best first
    out = []
    for sampler, (x, softcap), row_values, row_ids in zip(samplers, prepared, values, ids, strict=True):
        c = top_k_candidates(row_values, row_ids, sampler.params, softcap)
        out.append(sampler._result(x, softcap, draw(c, sampler.rng), c.ids))
    return out


def _sample_nucleus(samplers: Sequence[Sampler], logits: torch.Tensor, rows: Sequence[int]) -> list[SampleResult]:
    """`Sampler.sample` of logits[rows[i]] by samplers[i], all on top-p alone at one temperature: steps 1-2 and the
    mask per row (as alone), one `nucleus_rows` per soft-cap still to apply (a masked row has had it applied), then
    the draw and the logprobs per row with the row's own generator: the same operations on the same values as alone."""
    prepared = [sampler.mask(sampler.adjust(logits[b])) for sampler, b in zip(samplers, rows, strict=True)]
    by_cap: dict[float | None, list[int]] = {}
    for i, (_, softcap) in enumerate(prepared):
        by_cap.setdefault(softcap, []).append(i)
    out: list[SampleResult | None] = [None] * len(rows)
    for softcap, members in by_cap.items():
        stacked = _stacked([prepared[i][0] for i in members], logits, [rows[i] for i in members])  # [M, V]
        scratch = [samplers[i]._scratch for i in members]  # each row's own [V], as alone (top-k off allocates it)
        found = nucleus_rows(stacked, [samplers[i].params for i in members], softcap, scratch)  # type: ignore[arg-type]
        for i, c in zip(members, found, strict=True):
            out[i] = samplers[i]._result(prepared[i][0], softcap, draw(c, samplers[i].rng), c.ids)
    return out  # type: ignore[return-value]


def _stacked(xs: Sequence[torch.Tensor], logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The prepared rows xs (xs[i] from logits[rows[i]]) as one [R, V] tensor: a view of the caller's logits when
    every row is still the caller's own and the rows are one contiguous range (no copy), else a stack."""
    untouched = all(x.data_ptr() == logits[b].data_ptr() for x, b in zip(xs, rows, strict=True))
    if untouched and list(rows) == list(range(rows[0], rows[0] + len(rows))) and logits.is_contiguous():
        return logits[rows[0] : rows[-1] + 1]  # [R, V] a view
    return torch.stack(list(xs))  # [R, V]
