"""What a request asks of the sampler, as values: `SamplingParams`, and `TokenConstraint`, the interface a constraint
answers (a vocabulary mask per step, advanced token by token). Torch-free, below the engine: the sampler never
imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# Below this temperature we decode greedily: dividing by a tiny temperature overflows float32 (vLLM does the same).
GREEDY_EPS = 1e-5


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 (or -1) => off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM: divide positive / multiply negative logits of seen tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class TokenConstraint(Protocol):
    """What the sampler and the engine need of a constraint (server.constraints.constraint.Constraint is one)."""

    def fill_mask(self, bitmask: Any) -> None: ...
    def accept(self, token_id: int) -> bool: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def free(self) -> bool: ...  # this step's mask would allow every token: skipped
