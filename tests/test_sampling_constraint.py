"""The sampler under a constraint: masked tokens get exactly zero probability, through the soft-cap, on every path
(greedy, top-k, top-k off, top-p, min-p), and are never offered as logprob alternatives; min_tokens bans stop ids."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from server.constraints.constraint import BannedTokens, Constraint
from server.sampling.params import SamplingParams
from server.sampling.sampler import Sampler

V = 4096
SOFTCAP = 30.0


class Allowed(Constraint):
    """A fixed allowed set: the smallest real constraint (the grammar ones need a 262k GrammarVocab)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = set(allowed)
        self.words = np.zeros((V + 31) // 32, dtype=np.int32)
        for token in allowed:
            self.words[token >> 5] |= np.int32(1 << (token & 31)) if token & 31 != 31 else np.int32(-(1 << 31))

    def fill_mask(self, bitmask: np.ndarray) -> None:
        bitmask[:] = self.words

    def accept(self, token_id: int) -> bool:
        return token_id in self.allowed


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 8.0  # (V,) wide: the cap matters


PATHS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=40),
         SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, min_p=0.05),
         SamplingParams(temperature=1.0, top_k=1000, top_p=0.95)]


@pytest.mark.parametrize("params", PATHS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_only_allowed_tokens_are_ever_sampled(params: SamplingParams) -> None:
    # The allowed tokens are among the *worst* logits: without an exact mask they would never win.
    x = logits()
    allowed = torch.argsort(x)[:5].tolist()
    for seed in range(200):
        sampler = Sampler(SamplingParams(**{**_fields(params), "seed": seed}), V, [], SOFTCAP,
                          constraint=Allowed(allowed))
        assert sampler.sample(x).token_id in allowed


def test_banned_tokens_never_sampled_even_when_best() -> None:
    x = logits()
    best = torch.topk(x, 3).indices.tolist()
    for seed in range(200):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), V, [], SOFTCAP,
                          constraint=BannedTokens(best, (V + 31) // 32))
        assert sampler.sample(x).token_id not in best


def test_logprobs_are_those_of_the_constrained_distribution_and_the_callers_row_is_untouched() -> None:
    x = logits(1)
    before = x.clone()
    allowed = [3, 99, 1234, 4000]
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=10), V, [], SOFTCAP,
                      constraint=Allowed(allowed))
    result = sampler.sample(x)
    assert torch.equal(x, before)
    capped = SOFTCAP * torch.tanh(x[allowed].double() / SOFTCAP)
    expected = torch.log_softmax(capped, 0)
    best = allowed[int(expected.argmax())]
    assert result.token_id == best
    assert result.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    # Exactly the allowed tokens are offered as alternatives, none of the masked ones (-inf never reaches a client).
    assert sorted(t for t, _ in result.top_logprobs) == sorted(allowed)
    assert math.fsum(math.exp(lp) for _, lp in result.top_logprobs) == pytest.approx(1.0, abs=1e-4)


def test_min_tokens_masks_the_stop_ids_until_reached() -> None:
    x = logits(2)
    stop = int(x.argmax())
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), V, [], SOFTCAP,
                      stop_ids=[stop], min_tokens=2)
    for _ in range(2):
        result = sampler.sample(x)
        assert result.token_id != stop and stop not in [t for t, _ in result.top_logprobs]
        sampler.accept(result.token_id)
    assert sampler.sample(x).token_id == stop


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
