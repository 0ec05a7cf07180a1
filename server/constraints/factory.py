"""`ConstraintFactory`: the one place a run's matcher is built from a request's constraint values: its grammar (or
banned ids, ...) through the grammar vocabulary, inside its thinking budget when it has one. The engine calls it once
per run, so the request stays a value that can run again."""

from __future__ import annotations

from collections.abc import Callable

from server.constraints.constraint import Constraint, ConstraintSpec, mask_words
from server.constraints.thought import BudgetedThought, ThoughtBudget


class ConstraintFactory:
    """`grammar`: a spec -> a fresh matcher (the grammar vocabulary's, server.constraints.vocab.VocabLoader.matcher);
    None for an engine that takes no constrained requests (a thinking budget needs no vocabulary: it still works)."""

    def __init__(self, vocab_size: int, grammar: Callable[[ConstraintSpec], Constraint] | None = None) -> None:
        self.mask_words = mask_words(vocab_size)
        self._grammar = grammar

    def __call__(self, spec: ConstraintSpec | None, thought: ThoughtBudget | None) -> Constraint | None:
        """This run's matcher (None: free text, zero cost)."""
        inner = None
        if spec is not None:
            if self._grammar is None:
                raise RuntimeError("this engine was built without a grammar vocabulary (see "
                                   "server.app.runtime.build_engine)")
            inner = self._grammar(spec)
        return inner if thought is None else BudgetedThought(thought, inner, self.mask_words)
