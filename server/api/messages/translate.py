"""A Messages request as a `ChatCompletionRequest` (`chat_request`): its system prompt and content blocks as chat
messages, its tools, tool_choice, output format and thinking as the chat fields. A chat-path error is given back in
Anthropic's shape naming the Messages field it came from (`in_messages_terms`).

The thinking mapping (the chat path holds the one thinking budget every route shares):
- `thinking: {type: enabled, budget_tokens: N}` -> thinking on (`chat_template_kwargs.enable_thinking`) and
  `reasoning_budget = N`; `{type: adaptive}` -> thinking on, no budget of its own; `{type: disabled}` -> thinking off;
- `output_config.effort` -> `reasoning_effort` (Anthropic's "max" is chat's highest, "xhigh"); without `thinking` it
  turns thinking on, as any effort does on chat. With thinking disabled it is refused: here an effort only sizes the
  thought, so it would change nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from server.api.http import parse
from server.api.messages.schemas import (
    InputMessage,
    MessagesRequest,
    PromptBody,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.api.schemas import ChatCompletionRequest
from server.errors import AnthropicError, APIError

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_messages(system: Sequence[TextBlock] | None, messages: Sequence[InputMessage]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages: an assistant message's thinking blocks are its `reasoning_content`
    (the template decides whether to render it), its tool_use blocks its `tool_calls`; a user message's tool_result
    blocks become tool messages (before its text, as Anthropic orders them). A result with `is_error` is given to the
    model as `{"error": TEXT}` (Gemma-4 renders it as the tool's response object)."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": "\n".join(b.text for b in system)}] if system else []
    for message in messages:
        texts = [block.text for block in message.content if isinstance(block, TextBlock)]
        if message.role == "assistant":
            thought = "".join(block.thinking for block in message.content if isinstance(block, ThinkingBlock))
            calls = [{"id": block.id, "type": "function", "function": {"name": block.name,
                                                                       "arguments": json.dumps(block.input)}}
                     for block in message.content if isinstance(block, ToolUseBlock)]
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                turn["tool_calls"] = calls
            if thought:
                turn["reasoning_content"] = thought
            chat.append(turn)
            continue
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                content = json.dumps({"error": block.content}) if block.is_error else block.content
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        if texts or not any(isinstance(block, ToolResultBlock) for block in message.content):
            chat.append({"role": "user", "content": "\n".join(texts)})
    return chat


def _thinking_fields(body: PromptBody) -> dict[str, Any]:
    thinking, effort = body.thinking, body.output_config.effort if body.output_config else None
    fields: dict[str, Any] = {}
    if thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking.type != "disabled"}
        if thinking.type == "enabled":
            fields["reasoning_budget"] = thinking.budget_tokens
        if thinking.type == "disabled" and effort is not None:
            raise AnthropicError(400, "output_config.effort: sizes the thought here, and thinking.type is 'disabled' "
                                 "(leave out one of them)", param="output_config.effort", code="invalid_value")
    if effort is not None:
        fields["reasoning_effort"] = "xhigh" if effort == "max" else effort
    return fields


def chat_request(body: PromptBody) -> ChatCompletionRequest:
    """`body` (a MessagesRequest, or a count_tokens body: the same prompt, nothing to sample) as a chat request."""
    choice = body.tool_choice
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.system, body.messages),
        "tools": [{"type": "function", "function": tool.model_dump(include={"name", "description"}, exclude_none=True)
                   | {"parameters": tool.input_schema}} for tool in body.tools] if body.tools else None,
        "tool_choice": None if choice is None else _CHOICES.get(choice.type) or
        {"type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
        **_thinking_fields(body),
    }
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.json_schema, "strict": True}}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k)
    raw = json.dumps({key: value for key, value in fields.items() if value is not None}).encode()
    try:
        return parse(ChatCompletionRequest, raw)
    except APIError as exc:
        raise in_messages_terms(exc) from None


_RENAMED = (("response_format.json_schema.schema", "output_config.format.schema"),
            ("response_format.json_schema", "output_config.format"), ("response_format", "output_config.format"),
            ("reasoning_effort", "output_config.effort"), ("reasoning_budget", "thinking.budget_tokens"),
            ("chat_template_kwargs", "thinking"), ("stop", "stop_sequences"),
            ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))
_TOOL_FUNCTION = re.compile(r"^(tools\[\d+\])\.function(?:\.parameters\b)?")


def _renamed(param: str) -> str:
    if param == "messages" or param.startswith(("messages.", "messages[")):
        return "messages"  # chat message indices are not Messages indices (the system prompt, tool results)
    for old, new in _RENAMED:
        if param == old or param.startswith((old + ".", old + "[")):
            return new + param[len(old):]
    return _TOOL_FUNCTION.sub(lambda m: m.group(1) + (".input_schema" if m.group(0).endswith("parameters") else ""),
                              param)


def in_messages_terms(exc: APIError) -> AnthropicError:
    """A chat-path error in Anthropic's shape, naming the Messages field it came from."""
    if not exc.param:
        return AnthropicError.of(exc)
    param = _renamed(exc.param)
    message = param + exc.message[len(exc.param):] if exc.message.startswith(exc.param) else exc.message
    return AnthropicError(exc.status, message, param=param, code=exc.code, headers=exc.headers)
