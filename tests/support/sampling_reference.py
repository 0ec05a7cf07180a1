"""The naive sampling reference the equivalence tests compare `server.sampling.sampler` against: soft-cap everything, sort the
whole vocabulary (the HF warpers' way), and what `Sampler.sample` draws from, as a distribution; `chi_square_ok`, the
test of drawn tokens against a distribution.

The bench's own full-sort baseline (`server.tools.bench.host.full_sort_top_p`, what `sampling_speedup_vs_full_sort`
divides by) is product code: tests/test_bench.py checks it against this reference, never the other way round."""

from __future__ import annotations

import math

import torch

from server.sampling.params import SamplingParams
from server.sampling.primitives import candidates

# Gemma-4's final-logit soft-cap: the reference's default, so its 3-argument call is the Gemma-4 baseline.
GEMMA4_SOFTCAP = 30.0


def reference_probs(
    logits: torch.Tensor, params: SamplingParams, softcap: float | None = GEMMA4_SOFTCAP
) -> torch.Tensor:
    """The sampling distribution over the whole vocabulary [V], computed the straightforward (HF warper) way.

    Applies logit_bias (penalties need per-request history; `Sampler` owns them) and steps 4-8 with a full sort.
    """
    assert not params.greedy
    x = logits.clone()  # (V,)
    for token, bias in params.logit_bias:
        x[token] += bias
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)  # (V,)
    x = x / params.temperature  # (V,)
    values, order = torch.sort(x, descending=True)  # (V,), (V,)
    if 0 < params.top_k < x.numel():
        values[params.top_k :] = -math.inf
    probs = torch.softmax(values, 0)  # (V,) best first
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs[0]] = 0.0
        probs /= probs.sum()
    if params.top_p < 1.0:
        probs[probs.cumsum(0) - probs >= params.top_p] = 0.0
        probs /= probs.sum()
    return torch.zeros_like(probs).scatter_(0, order, probs)  # (V,) back in vocabulary order


def candidate_distribution(
    x: torch.Tensor, params: SamplingParams, softcap: float | None, scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `Sampler.sample` draws from: (token ids, probabilities summing to 1)."""
    c = candidates(x, params, softcap, scratch)
    ids = torch.arange(x.numel()) if c.ids is None else torch.as_tensor(c.ids[: c.n])  # (n,)
    weights = torch.as_tensor(c.weights[: c.n], dtype=torch.float64)  # (n,)
    return ids, (weights / float(c.cum[c.n - 1])).float()  # (n,), (n,)


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square against expected probabilities, at p = 1e-4 (Wilson-Hilferty critical value)."""
    n = int(counts.sum())
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "drew a token outside the support"
    expected = probs[support].double() * n
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return True
    z = 3.719  # one-sided normal quantile for 1e-4
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical
