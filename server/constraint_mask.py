"""Applying a constraint's vocabulary mask to a row of logits: the torch side of server/constraints.py.

The sampler calls `TokenMask.apply_(constraint, logits)` on its own scratch row (never the graph's buffer) after
logit_bias and penalties and before greedy/top-k: disallowed tokens become -inf, so every later step (argmax,
top-k, soft-cap, temperature, top-p, the draw) sees only allowed tokens, and raw logprobs are those of the
constrained distribution. Requests without a constraint never get here.

Three ways to apply, chosen per step from the mask's words (so no step expands all 262,144 bits unless it must):
- few allowed (a grammar's structure: a handful of ids): gather them into a fresh -inf row;
- few disallowed (free text inside a string: everything but the special tokens): -inf at those ids;
- otherwise: one masked_fill over the vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from server.constraints import Constraint

_FEW_WORDS = 256  # up to this many 32-bit words to expand (8,192 ids), the sparse paths beat a full masked_fill
_ALL = np.int32(-1)


class TokenMask:
    """A reusable bitmask buffer for one vocabulary size (one per engine; not thread-safe)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def apply_(self, constraint: Constraint, logits: torch.Tensor) -> torch.Tensor:
        """Fill the mask from `constraint` and set the disallowed entries of `logits` ([V] float, modified) to -inf."""
        constraint.fill_mask(self.bits)
        return apply_bitmask_(logits, self.bits)


def _ids(bits: np.ndarray, words: np.ndarray, value: int) -> np.ndarray:
    """The ids whose bit equals `value` (0 or 1) within the given word indices."""
    unpacked = np.unpackbits(bits[words].view(np.uint8), bitorder="little").reshape(len(words), 32)  # [k, 32]
    rows, cols = np.nonzero(unpacked == value)
    return words[rows].astype(np.int64) * 32 + cols


def apply_bitmask_(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    vocab = logits.shape[0]
    allowed_words = np.flatnonzero(bits)
    if len(allowed_words) <= _FEW_WORDS:
        ids = _ids(bits, allowed_words, 1)
        index = torch.from_numpy(ids[ids < vocab])
        kept = logits.index_select(0, index)
        logits.fill_(float("-inf"))
        logits.index_copy_(0, index, kept)
        return logits
    partial_words = np.flatnonzero(bits != _ALL)
    if len(partial_words) <= _FEW_WORDS:
        ids = _ids(bits, partial_words, 0)
        logits.index_fill_(0, torch.from_numpy(ids[ids < vocab]), float("-inf"))
        return logits
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab]  # [V] uint8, 1 = allowed
    logits.masked_fill_(torch.from_numpy(allowed) == 0, float("-inf"))
    return logits
