"""The chat plan (`ChatPlan`: prompt ids, sampling, constraints, output parser) and `ChatPlanner`, which makes one from
a `ChatCompletionRequest` and submits it as GenerationRequests. The chat routes implement it; an API translated onto
the chat path (the Responses and Messages APIs) takes it as this protocol, so it depends on these names, not on the chat routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.api.schemas import ChatCompletionRequest
from server.constraints.constraint import ConstraintSpec
from server.constraints.thought import ThoughtBudget
from server.engine.types import ImageInput, RequestHandle, SamplingParams
from server.protocol import OutputParser, PromptInputs


@dataclass(frozen=True)
class ChatPlan:
    """A chat request checked, rendered and compiled: what each of its choices submits, and how its output parses."""

    model: str
    ids: list[int]
    inputs: PromptInputs
    sampling: SamplingParams
    constraint: ConstraintSpec | None  # a value, shared by the choices: the engine builds each run's matcher
    new_parser: Callable[[], OutputParser]
    keep_special_tokens: bool
    thought_budget: ThoughtBudget | None = None  # the thought's cap (None: none, or thinking is off)
    images: tuple[ImageInput, ...] = ()  # read and placed (offsets in ids): the engine encodes them


class ChatPlanner(Protocol):
    async def plan_chat(self, body: ChatCompletionRequest) -> ChatPlan: ...  # mistakes: 400s naming chat fields

    async def prompt_ids(self, body: ChatCompletionRequest) -> list[int]: ...  # the prompt plan_chat renders, only

    def submit_plan(self, plan: ChatPlan, body: ChatCompletionRequest, n: int, *, param: str,
                    request_id: str) -> list[RequestHandle]: ...  # n choices together; too long a prompt: a 400 on `param`
