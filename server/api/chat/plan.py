"""The chat plan (`ChatPlan`: prompt ids, sampling, constraints, output parser) and `ChatPlanner`, which makes one from
a `ChatCompletionRequest` and submits it as GenerationRequests. The chat routes implement it; an API translated onto
the chat path (the Responses and Messages APIs) takes it as this protocol, so it depends on these names, not on the chat routes.
Such an API's fields become a chat request through `translated`, and the chat path's errors name its fields by its `Terms`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from server.api.http import parse
from server.api.schemas import ChatCompletionRequest
from server.constraints.constraint import ConstraintSpec
from server.constraints.thought import ThoughtBudget
from server.engine.types import ImageInput, RequestHandle, SamplingParams
from server.errors import APIError
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


def translated(fields: Mapping[str, Any], in_terms: Callable[[APIError], APIError]) -> ChatCompletionRequest:
    """`fields` (None: not set) parsed as the chat request a client would send; a mistake in them raised `in_terms`."""
    raw = json.dumps({key: value for key, value in fields.items() if value is not None}).encode()
    try:
        return parse(ChatCompletionRequest, raw)
    except APIError as exc:
        raise in_terms(exc) from None


@dataclass(frozen=True)
class Terms:
    """How a translated API names a chat param: `messages` and anything in it as `conversation` (the chat's message
    indices are not its own), a field of `fields` (chat's, its own: the first that matches) and what is under it
    renamed, anything else through `tools` (`tools[i].function...`)."""

    conversation: str
    fields: tuple[tuple[str, str], ...]
    tools: Callable[[str], str]

    def renamed(self, param: str, message: str, places: Mapping[str, str] | None = None) -> tuple[str, str]:
        """`param` in these terms (`places` first: params the API names otherwise), and `message` naming it there
        where it named `param`."""
        new = (places or {}).get(param) or self._param(param)
        return new, new + message[len(param):] if message.startswith(param) else message

    def _param(self, param: str) -> str:
        if param == "messages" or param.startswith(("messages.", "messages[")):
            return self.conversation
        for old, new in self.fields:
            if param == old or param.startswith((old + ".", old + "[")):
                return new + param[len(old):]
        return self.tools(param)
