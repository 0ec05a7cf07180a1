"""A request's constraint as a value, the matchers built from it, and the `CallFormat` a chat protocol fills in.

The value (`ConstraintSpec`: `Grammar`, `BannedIds` or `StopAfter`) is frozen, so that a request stays a value: the API
plans it with `plan_constraint` (planner.py; None for a request without one: zero cost), compiling any grammar up front
(a bad schema is a 400 before the response starts; the compiled grammar stays cached). The matcher (`Constraint`) is
stateful, built from the value by `build_matcher` for each run (the engine's: a request can be run again, after a
cache reset, from the same value). Per step `fill_mask(bitmask)` (1 bit per token id, set = allowed), the sampler sets
every disallowed logit to -inf (server/sampling/mask.py, the only part that touches torch), and `accept(token_id)`
advances it; `is_finished` says that only a stop id can follow. Why llguidance, and what its vocabulary costs: vocab.py.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from server.errors import InvalidRequest

if TYPE_CHECKING:
    import llguidance

    from server.constraints.vocab import GrammarVocab


class ConstraintError(InvalidRequest):
    """The request's schema, tools or tool_choice cannot be enforced: the API answers 400 naming `param`."""


@dataclass(frozen=True, slots=True)
class Grammar:
    """The output must match this grammar: llguidance's Lark dialect, special tokens referenced by id (`<[48]>`); or,
    with client grammars, llguidance's top-level JSON joining it with them (server.constraints.client_grammar)."""

    lark: str


@dataclass(frozen=True, slots=True)
class BannedIds:
    """These ids may never be sampled."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StopAfter:
    """Anything until `token_id` is sampled, then only a stop id."""

    token_id: int


ConstraintSpec = Grammar | BannedIds | StopAfter


class CallFormat(Protocol):
    """What the planner needs of a chat protocol with native tool calls (`ChatProtocol.calls`; None for a protocol
    without them). Texts, not ids: the vocabulary resolves them (`GrammarVocab.token_id`, `.special`)."""

    call_open: str  # the token that opens a call: banned under tool_choice "none"
    call_close: str  # the token that closes one: under parallel_tool_calls false, only a stop may follow it
    # The (opening, closing) tokens of the thought channel a thinking model may write before the constrained output;
    # None: the format has no thought channel.
    thought: tuple[str, str] | None

    def call_grammar(self, vocab: GrammarVocab, tools: Sequence[Mapping[str, Any]], names: Collection[str] | None, *,
                     loose: bool = False) -> str:
        """Lark rules defining `call`: one call to a function among `names` (all tools when None), its arguments valid
        for that function's parameters (the planner writes the start rule: how many calls, after which thought).
        A string parameter carrying a client grammar (server.constraints.client_grammar) is written as a reference to
        that sub-grammar. `loose`: only such tools' arguments are enforced, any other tool's are any object.
        Raises ConstraintError for what it cannot enforce."""
        ...


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """A tool's `function` object; ConstraintError unless it is a function tool with a name."""
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ConstraintError("tools must be function tools with a name", "tools")
    return function


class Constraint:
    """One run's constraint: per step `fill_mask`, then `accept` the sampled token."""

    def fill_mask(self, bitmask: np.ndarray) -> None:
        """Write the allowed set into `bitmask` (int32, `ceil(V / 32)` words; bit i of word w is token 32 w + i)."""
        raise NotImplementedError

    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; False if the constraint did not allow it (the request must end)."""
        raise NotImplementedError

    @property
    def is_finished(self) -> bool:
        """Only a stop id may follow (the engine may end the request here with finish_reason "stop")."""
        return False

    @property
    def free(self) -> bool:
        """This step allows every token: the sampler may skip the mask (a thinking budget outside its forced steps)."""
        return False


class GrammarConstraint(Constraint):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())


class BannedTokens(Constraint):
    """A fixed set of ids that may never be sampled (tool_choice "none": the call-opening token)."""

    def __init__(self, banned: Iterable[int], mask_words: int) -> None:
        self.banned = tuple(sorted(set(banned)))
        self._mask = bitmask(self.banned, mask_words, allowed=False)

    def fill_mask(self, bitmask: np.ndarray) -> None:
        bitmask[:] = self._mask

    def accept(self, token_id: int) -> bool:
        return token_id not in self.banned


class StopAfterCall(Constraint):
    """parallel_tool_calls false under tool_choice "auto": anything until the first call closes, then only a stop."""

    def __init__(self, call_close: int, stop_ids: Sequence[int], mask_words: int) -> None:
        self._close = call_close
        self._closed = False
        self._all = np.full(mask_words, -1, dtype=np.int32)
        self._stops = bitmask(stop_ids, mask_words, allowed=True)
        self._stop_ids = frozenset(stop_ids)

    def fill_mask(self, bitmask: np.ndarray) -> None:
        bitmask[:] = self._stops if self._closed else self._all

    def accept(self, token_id: int) -> bool:
        if self._closed:
            return token_id in self._stop_ids
        self._closed = token_id == self._close
        return True

    @property
    def is_finished(self) -> bool:
        return self._closed


def build_matcher(vocab: GrammarVocab, spec: ConstraintSpec) -> Constraint:
    """A fresh matcher for `spec` (a grammar's is a copy of the compiled one: cheap, unless the cache let it go)."""
    if isinstance(spec, Grammar):
        return GrammarConstraint(vocab.matcher(spec.lark))
    if isinstance(spec, BannedIds):
        return BannedTokens(spec.ids, vocab.mask_words)
    return StopAfterCall(spec.token_id, vocab.stop_ids, vocab.mask_words)


def mask_words(vocab_size: int) -> int:
    """32-bit words of a bitmask over `vocab_size` token ids (the layout of `Constraint.fill_mask`)."""
    return (vocab_size + 31) // 32


def bitmask(ids: Iterable[int], mask_words: int, *, allowed: bool) -> np.ndarray:
    """A bitmask (the layout of `Constraint.fill_mask`) allowing exactly `ids`, or everything but `ids`."""
    bits = np.full(mask_words * 32, not allowed, dtype=np.uint8)
    bits[list(ids)] = allowed
    return np.packbits(bits, bitorder="little").view(np.int32)


def allowed_ids(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask allows (for tests and diagnostics; the sampler expands masks in torch)."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)
