"""The chat plan: what a chat-shaped request becomes before it reaches the engine, and the interface that makes it.

`ChatPlanner.plan_chat` checks a `ChatCompletionRequest` and renders it (prompt ids through the model's protocol and
template, sampling, output constraints, the output parser); `submit_plan` turns the plan into GenerationRequests.
The chat routes implement it; every API that is a translation onto the chat path (the Responses API) takes it as
this protocol, so it depends on these two names, not on the chat routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.api.schemas import ChatCompletionRequest
from server.engine.types import RequestHandle, SamplingParams, TokenConstraint
from server.protocol import OutputParser, PromptInputs


@dataclass(frozen=True)
class ChatPlan:
    """A chat request checked, rendered and compiled: what each of its choices submits, and how its output parses.
    The one path from a chat-shaped request to the engine (chat completions, and the Responses API through it)."""

    model: str
    ids: list[int]
    inputs: PromptInputs
    sampling: SamplingParams
    constraints: list[TokenConstraint | None]  # one per choice: a constraint is stateful
    new_parser: Callable[[], OutputParser]
    keep_special_tokens: bool


class ChatPlanner(Protocol):
    async def plan_chat(self, body: ChatCompletionRequest, n: int = 1) -> ChatPlan:
        """Checks, the prompt through the model's protocol and template, and the output constraints (one per choice);
        a mistake is an APIError naming the chat field."""
        ...

    def submit_plan(self, plan: ChatPlan, body: ChatCompletionRequest, n: int, *, param: str,
                    request_id: str) -> list[RequestHandle]:
        """The plan's `n` choices submitted together, with the body's token limit, stop strings and eos fields; a
        prompt the context cannot hold is a 400 naming `param`."""
        ...
