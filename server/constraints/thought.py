"""A thinking budget as a constraint: at most `tokens` tokens inside the thought channel, then the channel's own closing
marker is forced and the answer follows. Torch-free; it knows no model family: the chat protocol names the markers
(`ChatProtocol.thought`), the API resolves them to ids and the budget (`ThoughtBudget`, a value), the engine builds
one matcher per run around the request's other constraint, if any (`BudgetedThought`).

What is counted: every token the model writes after the opening marker (a channel's name line too: Gemma-4's
`thought\\n` is two of them) up to the closing marker, which is not counted; over every thought of the generation
together (a thought opened after the budget is spent closes at once). So 0 closes a thought as soon as it opens. The
forced marker tokens are generated tokens like any other: they count toward max_tokens, which bounds the whole answer.

Composition: the wrapped constraint (a JSON-schema or tool-call grammar that allows a thought first, banned ids, ...)
decides every step but the forced ones, and is advanced with every token, the forced ones included: a grammar with
a thought channel allows its closing marker anywhere inside the thought, so forcing it never leaves the grammar.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from server.constraints.constraint import Constraint, bitmask


@dataclass(frozen=True, slots=True)
class ThoughtBudget:
    """At most `tokens` tokens between `opening` and `closing` (each a marker's token ids, in order)."""

    opening: tuple[int, ...]
    closing: tuple[int, ...]
    tokens: int

    def __post_init__(self) -> None:
        if not self.opening or not self.closing or self.tokens < 0:
            raise ValueError("a thought budget needs both markers and a budget >= 0")


class BudgetedThought(Constraint):
    """One run's thinking budget around `inner` (None: free text otherwise)."""

    def __init__(self, budget: ThoughtBudget, inner: Constraint | None, mask_words: int) -> None:
        self._budget = budget
        self._inner = inner
        self._left = budget.tokens
        self._inside = False
        self._forcing = 0  # closing-marker tokens already forced (while inside with no budget left)
        # The last tokens written, to spot a marker (the opening outside a thought, the closing inside one).
        self._recent: deque[int] = deque(maxlen=max(len(budget.opening), len(budget.closing)))
        self._forced = [bitmask((token,), mask_words, allowed=True) for token in budget.closing]
        self._all = np.full(mask_words, -1, dtype=np.int32)

    @property
    def _forced_now(self) -> int | None:
        """The index into the closing marker of the token this step must be, or None when the step is free."""
        return self._forcing if self._inside and self._left == 0 else None

    @property
    def free(self) -> bool:
        return self._forced_now is None and (self._inner is None or self._inner.free)

    def fill_mask(self, bitmask: np.ndarray) -> None:
        forced = self._forced_now
        if forced is not None:
            bitmask[:] = self._forced[forced]  # the inner constraint's mask would allow it: no need to compute it
        elif self._inner is not None:
            self._inner.fill_mask(bitmask)
        else:
            bitmask[:] = self._all

    def accept(self, token_id: int) -> bool:
        forced = self._forced_now
        if self._inner is not None and not self._inner.accept(token_id):
            return False
        if forced is not None:
            if token_id != self._budget.closing[forced]:
                return False
            self._forcing += 1
            if self._forcing == len(self._budget.closing):
                self._inside, self._forcing = False, 0
                self._recent.clear()
            return True
        if self._inside:
            self._recent.append(token_id)
            if self._ends_with(self._budget.closing):  # the model closed it itself, within its budget
                self._inside = False
                self._left += len(self._budget.closing) - 1  # the marker's tokens are not thought
                self._recent.clear()
            else:
                self._left -= 1
            return True
        self._recent.append(token_id)
        if self._ends_with(self._budget.opening):
            self._inside = True
            self._recent.clear()
        return True

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        recent = self._recent
        if len(marker) == 1:  # the usual case (a special token): no slicing on every step
            return bool(recent) and recent[-1] == marker[0]
        return len(recent) >= len(marker) and tuple(recent)[len(recent) - len(marker):] == marker

    @property
    def is_finished(self) -> bool:
        return self._inner is not None and self._inner.is_finished
