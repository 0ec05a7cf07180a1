"""Applying a constraint's vocabulary mask to a row of logits (the torch side of server/constraints/): disallowed
tokens become -inf, so every later sampling step sees only allowed tokens and raw logprobs are the constrained ones.

A mask becomes a plan: the ids to keep (when few are allowed: a grammar's structure) or the ids to ban (when few
are not: free text inside a string), found from the mask's 32-bit words without expanding all 262,144 bits unless
it must. `TokenMask` keeps the plans of recent masks: a JSON document alternates between a few masks (inside a key,
inside a string value, ...), and then applying one is a single `index_fill_`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from server.sampling.params import TokenConstraint

_FEW_WORDS = 256  # up to this many 32-bit words to expand (8,192 ids), the sparse paths beat a full unpack
_ALL = np.int32(-1)


class MaskPlan(NamedTuple):
    keep: bool  # True: only `ids` are allowed; False: `ids` are the disallowed ones
    ids: torch.Tensor  # [k] int64


class TokenMask:
    """A reusable bitmask buffer for one vocabulary size, with recent masks' plans (one per constrained Sampler)."""

    def __init__(self, vocab_size: int, plans: int = 16) -> None:
        self.vocab_size = vocab_size
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._plans: OrderedDict[bytes, MaskPlan] = OrderedDict()
        self._max_plans = plans

    def apply_(self, constraint: TokenConstraint, logits: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """Fill the mask from `constraint` and set the disallowed entries of `logits` ([V] float, modified) to -inf.
        `softcap`: also apply Gemma's soft-cap to the allowed entries (cap(-inf) is -30, so it cannot come after)."""
        constraint.fill_mask(self.bits)
        return self.apply_filled_(logits, softcap)

    def apply_filled_(self, logits: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        """Apply what is in `self.bits` now."""
        key = self.bits.tobytes()  # 32 KB at V=262,144: hashing it is ~20x cheaper than planning
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = mask_plan(self.bits, self.vocab_size)
            if len(self._plans) > self._max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return apply_plan_(logits, plan, softcap)


def _ids(bits: np.ndarray, words: np.ndarray, value: int) -> np.ndarray:
    """The ids whose bit equals `value` (0 or 1) within the given word indices."""
    unpacked = np.unpackbits(bits[words].view(np.uint8), bitorder="little").reshape(len(words), 32)  # [k, 32]
    rows, cols = np.nonzero(unpacked == value)
    return words[rows].astype(np.int64) * 32 + cols


def mask_plan(bits: np.ndarray, vocab_size: int) -> MaskPlan:
    allowed_words = np.flatnonzero(bits)
    if len(allowed_words) <= _FEW_WORDS:
        ids = _ids(bits, allowed_words, 1)
        return MaskPlan(True, torch.from_numpy(ids[ids < vocab_size]))
    partial_words = np.flatnonzero(bits != _ALL)
    if len(partial_words) <= _FEW_WORDS:
        ids = _ids(bits, partial_words, 0)
        return MaskPlan(False, torch.from_numpy(ids[ids < vocab_size]))
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size].view(np.bool_)  # [V]
    count = int(np.count_nonzero(allowed))
    if count <= vocab_size // 2:
        return MaskPlan(True, torch.from_numpy(np.flatnonzero(allowed)))
    return MaskPlan(False, torch.from_numpy(np.flatnonzero(~allowed)))


def apply_plan_(logits: torch.Tensor, plan: MaskPlan, softcap: float | None = None) -> torch.Tensor:
    """-inf where the plan disallows; with `softcap`, cap * tanh(x / cap) on the allowed entries (only those, when
    few are allowed)."""
    if plan.keep:
        kept = logits.index_select(0, plan.ids)  # (k,)
        if softcap is not None:
            kept.div_(softcap).tanh_().mul_(softcap)
        logits.fill_(float("-inf"))
        logits.index_copy_(0, plan.ids, kept)
        return logits
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)  # (V,)
    if len(plan.ids):
        logits.index_fill_(0, plan.ids, float("-inf"))
    return logits


def apply_bitmask_(logits: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """`logits` ([V] float, modified) with every id whose bit is 0 set to -inf."""
    return apply_plan_(logits, mask_plan(bits, logits.shape[0]))
