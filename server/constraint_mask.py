"""Applying a constraint's vocabulary mask to a row of logits: the torch side of server/constraints.py.

The sampler calls `TokenMask.apply_(constraint, logits)` on its own scratch row (never the graph's buffer) after
logit_bias and penalties and before greedy/top-k: disallowed tokens become -inf, so every later step (argmax,
top-k, soft-cap, temperature, top-p, the draw) sees only allowed tokens, and raw logprobs are those of the
constrained distribution. Requests without a constraint never get here.

Two ways to apply, chosen per step by how many tokens the grammar allows (measured in server/constraint_bench.py):
few allowed (inside a grammar's structure: a handful of ids) -> gather them into a fresh -inf row; many allowed
(free text inside a string) -> one masked_fill over the vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from server.constraints import Constraint

_GATHER_MAX = 4096  # up to this many allowed ids, gathering them beats a full-vocabulary masked_fill


class TokenMask:
    """A reusable bitmask buffer for one vocabulary size (one per engine; not thread-safe)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def apply_(self, constraint: Constraint, logits: torch.Tensor) -> torch.Tensor:
        """Fill the mask from `constraint` and set the disallowed entries of `logits` ([V] float, modified) to -inf."""
        constraint.fill_mask(self.bits)
        return apply_bitmask_(logits, self.bits)


def apply_bitmask_(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    vocab = logits.shape[0]
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]  # [V] uint8, 1 = allowed
    ids = np.flatnonzero(allowed)
    if len(ids) <= _GATHER_MAX:
        index = torch.from_numpy(ids)
        kept = logits.index_select(0, index)
        logits.fill_(float("-inf"))
        logits.index_copy_(0, index, kept)
    else:
        logits.masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))
    return logits
