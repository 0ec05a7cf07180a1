"""A chat request's output constraint, planned in one place before anything is submitted: which fields ask for one,
the grammar vocabulary waited for (bounded), the constraint planned and compiled off the event loop (a bad schema is
a 400 before the response starts), and the fields that cannot go with one.

The answer is a value (`ConstraintSpec`) that every choice of the request shares; the engine builds each run's
matcher from it. The model's tool-call format comes from its protocol (`ChatProtocol.calls`), the vocabulary from the
composition root (one per host), so nothing here knows a model family.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from server.api.chat.prompts import invalid
from server.api.given import GrammarSource
from server.api.schemas import ChatCompletionRequest
from server.constraints.client_grammar import client_grammars
from server.constraints.constraint import ConstraintSpec
from server.constraints.planner import plan_constraint
from server.errors import APIError, InvalidRequest
from server.protocol import ChatProtocol, PromptInputs

if TYPE_CHECKING:
    from server.constraints.vocab import GrammarVocab

# A constrained request that arrives while the grammar vocabulary is still building (the first 15-60 s after start-up)
# waits this long for it, then gets a 503 with Retry-After.
GRAMMAR_WAIT_S = 60.0
GRAMMAR_RETRY_AFTER_S = 10


class OutputConstraints:
    def __init__(self, protocol: ChatProtocol, grammar: GrammarSource | None) -> None:
        self.protocol = protocol
        self.grammar = grammar

    def start(self) -> None:
        """After start-up: build the grammar vocabulary on its own thread (constrained requests need it)."""
        if self.grammar is not None:
            self.grammar.start()

    async def plan(self, body: ChatCompletionRequest, inputs: PromptInputs) -> ConstraintSpec | None:
        """The request's output constraint, or None; compiled off the event loop, within the compiler's limits."""
        request = _constraint_fields(body)
        if request is None:
            return None
        vocab = await self._vocab()
        plan = functools.partial(plan_constraint, vocab, self.protocol.calls, **request, thinking=inputs.thinking)
        try:
            spec = await anyio.to_thread.run_sync(plan)
        except InvalidRequest as exc:
            raise invalid(exc.message, exc.param or "response_format") from None
        for name in ("ignore_eos", "min_tokens"):
            if spec is not None and getattr(body, name):
                raise APIError(400, f"{name}: cannot be combined with a constrained output (response_format or a "
                               "tool_choice that forces or forbids calls): the grammar decides where it may end",
                               param=name, code="invalid_value")
        return spec

    async def _vocab(self) -> GrammarVocab:
        if self.grammar is None:
            raise APIError(500, "This server was started without a grammar vocabulary.", code="grammar_unavailable")
        try:
            vocab = await anyio.to_thread.run_sync(self.grammar.wait, GRAMMAR_WAIT_S)
        except RuntimeError as exc:
            raise APIError(500, str(exc), code="grammar_unavailable") from None
        if vocab is None:
            raise APIError(503, "The grammar engine is still loading its vocabulary (once, after start-up); retry "
                           "shortly.", code="grammar_loading", headers={"Retry-After": str(GRAMMAR_RETRY_AFTER_S)})
        return vocab


def _constraint_fields(body: ChatCompletionRequest) -> Mapping[str, Any] | None:
    """What the planner needs from a chat request, or None when the request has no constraint at all (then the
    grammar vocabulary is never waited for)."""
    response_format = body.response_format.model_dump(exclude_none=True) if body.response_format else None
    fmt = (response_format or {}).get("type", "text")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    choice = body.tool_choice
    forced_or_banned = tools and (choice not in (None, "auto") or body.parallel_tool_calls is False
                                  or any(True for _ in client_grammars(tools)))  # a grammar tool: enforced in "auto"
    if fmt == "text" and not forced_or_banned:
        if isinstance(choice, dict) or choice == "required":
            raise APIError(400, "tool_choice: requires tools", param="tool_choice", code="invalid_value")
        return None
    return {"response_format": response_format, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False}
