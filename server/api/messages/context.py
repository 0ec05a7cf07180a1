"""Anthropic's context editing (`context_management.edits`) applied to a Messages body before it is rendered
(`apply_edits`), and what each edit cleared (`applied_edits`, as Anthropic reports them).

Deliberate choices (do not "fix" these without reading why):
- The edits run in the order sent, each on the conversation the earlier ones left, as Anthropic applies them. The
  client keeps its full history; only this request's prompt is edited.
- `cleared_input_tokens` is measured, not estimated: the prompt's tokens before the edit minus after (the same
  rendering the request is prefilled with, so count_tokens and usage agree). That costs one more rendering per edit
  that clears something (a 20k-token prompt renders in tens of ms), none for an edit that clears nothing.
- Gemma-4's template drops the thoughts of turns before the last user message anyway: clearing those thinking turns
  is counted in `cleared_thinking_turns` and changes no token (`cleared_input_tokens` 0).
- A cleared tool result becomes a placeholder text (the call stays, so the conversation still reads as one); a cleared
  input becomes `{}`. An edit that clears nothing (not triggered, nothing old enough, below `clear_at_least`) is not
  listed in `applied_edits`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from server.api.messages.schemas import (
    ClearThinking,
    ClearToolUses,
    InputMessage,
    PromptBody,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)

CLEARED_RESULT = "[This tool result was cleared to save context.]"

Count = Callable[[PromptBody], Awaitable[int]]  # a body's prompt tokens, as the request renders it


async def apply_edits(body: PromptBody, count: Count) -> tuple[PromptBody, list[dict[str, Any]]]:
    """`body` with its context-management edits applied, and what each applied edit cleared."""
    applied: list[dict[str, Any]] = []
    if body.context_management is None:
        return body, applied
    tokens: int | None = None  # the current body's prompt tokens, once counted
    for edit in body.context_management.edits:
        if isinstance(edit, ClearThinking):
            edited, turns = clear_thinking(body.messages, edit)
            if not turns:
                continue
            before = tokens if tokens is not None else await count(body)
            candidate = body.model_copy(update={"messages": edited})
            tokens = await count(candidate)
            applied.append({"type": edit.type, "cleared_thinking_turns": turns, "cleared_input_tokens": before - tokens})
            body = candidate
            continue
        before = tokens if tokens is not None else await count(body)
        tokens = before
        if not _triggered(edit, body.messages, before):
            continue
        edited, uses = clear_tool_uses(body.messages, edit)
        if not uses:
            continue
        candidate = body.model_copy(update={"messages": edited})
        after = await count(candidate)
        if edit.clear_at_least is not None and before - after < edit.clear_at_least.value:
            continue
        applied.append({"type": edit.type, "cleared_tool_uses": uses, "cleared_input_tokens": before - after})
        body, tokens = candidate, after
    return body, applied


def clear_thinking(messages: list[InputMessage], edit: ClearThinking) -> tuple[list[InputMessage], int]:
    """The messages with the thinking blocks of all but the last `keep` assistant turns that have some removed, and
    how many turns lost theirs."""
    if edit.keep == "all":
        return messages, 0
    thinking = [i for i, m in enumerate(messages) if m.role == "assistant" and
                any(isinstance(b, ThinkingBlock) for b in m.content)]
    cleared = set(thinking[:max(0, len(thinking) - edit.keep.value)])
    if not cleared:
        return messages, 0
    return [m.model_copy(update={"content": [b for b in m.content if not isinstance(b, ThinkingBlock)]})
            if i in cleared else m for i, m in enumerate(messages)], len(cleared)


def _tool_uses(messages: list[InputMessage]) -> list[ToolUseBlock]:
    return [b for m in messages if m.role == "assistant" for b in m.content if isinstance(b, ToolUseBlock)]


def _triggered(edit: ClearToolUses, messages: list[InputMessage], tokens: int) -> bool:
    if edit.trigger.type == "input_tokens":
        return tokens > edit.trigger.value
    return len(_tool_uses(messages)) > edit.trigger.value


def clear_tool_uses(messages: list[InputMessage], edit: ClearToolUses) -> tuple[list[InputMessage], int]:
    """The messages with the results of every tool use but the last `keep` cleared (uses of `exclude_tools` kept), and
    their inputs too where `clear_tool_inputs` says so; and how many uses were cleared."""
    uses = _tool_uses(messages)
    excluded = set(edit.exclude_tools or ())
    old = uses[:max(0, len(uses) - edit.keep.value)]
    cleared = {use.id: use.name for use in old if use.name not in excluded}
    if not cleared:
        return messages, 0
    inputs = edit.clear_tool_inputs
    clear_input = set(cleared) if inputs is True else {i for i, n in cleared.items() if n in inputs} if inputs else set()
    placeholder = TextBlock(type="text", text=CLEARED_RESULT)

    def edited(block: Any) -> Any:
        if isinstance(block, ToolResultBlock) and block.tool_use_id in cleared:
            return block.model_copy(update={"content": [placeholder], "is_error": None})
        if isinstance(block, ToolUseBlock) and block.id in clear_input:
            return block.model_copy(update={"input": {}})
        return block

    return [m.model_copy(update={"content": [edited(b) for b in m.content]}) for m in messages], len(cleared)
