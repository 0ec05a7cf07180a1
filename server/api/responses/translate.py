"""A Responses request as a `ChatCompletionRequest` (`chat_request`): its conversation as chat messages, its tools,
tool_choice, text format, reasoning effort and sampling fields (vLLM's top_k, min_p, repetition_penalty, seed among them)
as the chat fields. A chat-path error is given back naming the Responses
field it came from (`text.format`, `reasoning.effort`, `input`, ...), not the chat field (`in_responses_terms`)."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from server.api.chat.plan import Terms, translated
from server.api.responses.schemas import (
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    InputItem,
    ReasoningItem,
    ResponsesRequest,
)
from server.api.schemas import ChatCompletionRequest
from server.constraints.client_grammar import GRAMMAR_KEY
from server.errors import APIError


def chat_messages(instructions: str | None, items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages: function calls join the assistant turn they follow, a reasoning item's
    text becomes the next assistant turn's `reasoning_content` (the template decides whether to render it), function
    call outputs become tool messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    thought = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            thought += item.text
            continue
        last = messages[-1] if messages else None
        if isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            arguments = item.arguments if isinstance(item, FunctionCallItem) else custom_arguments(item.input)
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            if last is not None and last["role"] == "assistant":  # the same assistant turn
                last.setdefault("tool_calls", []).append(call)
                if thought:
                    last["reasoning_content"] = last.get("reasoning_content", "") + thought
                    thought = ""
                continue
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
        else:
            message = {"role": item.role, "content": item.content}
        if message["role"] == "assistant" and thought:
            message["reasoning_content"] = thought
        thought = ""  # a thought no assistant turn follows has nothing to go with
        messages.append(message)
    return messages


CUSTOM_INPUT = "input"  # the one string argument a custom tool's input is written as in the model's call syntax


def custom_arguments(text: str) -> str:
    """A custom tool call's raw input as the arguments object the model writes it in."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The raw input of a custom tool call the model wrote as `{"input": text}`; the arguments text itself when the
    model wrote anything else (a call under "auto" to a free-text custom tool is not grammar-held)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value[CUSTOM_INPUT] if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str) else arguments


def chat_tool(tool: FunctionTool | CustomTool) -> dict[str, Any]:
    """A Responses tool as a chat function tool. A custom tool is a function of one string, `input`, its description
    saying so (and showing its grammar, which the model must follow and the grammar engine enforces)."""
    if isinstance(tool, FunctionTool):
        return tool.chat()
    described = tool.description or ""
    field: dict[str, Any] = {"type": "string", "description": "The tool's input: raw text, not JSON."}
    if tool.format.type == "grammar":
        syntax, definition = tool.format.syntax, tool.format.definition
        described += (f"\n\nWrite the whole input as the `{CUSTOM_INPUT}` string; it must match this {syntax} "
                      f"grammar:\n```\n{definition}\n```")
        field[GRAMMAR_KEY] = {"syntax": syntax, "definition": definition}
    else:
        described += f"\n\nWrite the whole input as the `{CUSTOM_INPUT}` string (free text)."
    parameters = {"type": "object", "properties": {CUSTOM_INPUT: field}, "required": [CUSTOM_INPUT]}
    return {"type": "function", "function": {"name": tool.name, "description": described.strip(),
                                             "parameters": parameters}}


def chat_request(body: ResponsesRequest, items: Sequence[InputItem]) -> ChatCompletionRequest:
    choice = body.tool_choice
    offered = body.offered_tools()
    fields = {
        "model": body.model,
        "messages": chat_messages(body.instructions, items),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "tools": [chat_tool(tool) for tool in offered] if offered else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice)
        else choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": body.text.format.chat() if body.text and body.text.format else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    return translated(fields, in_responses_terms)


_RENAMED = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("reasoning_effort", "reasoning.effort"), ("max_completion_tokens", "max_output_tokens"),
            ("chat_template_kwargs", "reasoning"))
# Message indices are not item indices (instructions, merged calls): any of them is `input`.
_TERMS = Terms("input", _RENAMED, functools.partial(re.compile(r"^(tools\[\d+\])\.function\b").sub, r"\1"))


def in_responses_terms(exc: APIError) -> APIError:
    """A chat-path error naming the Responses field it came from."""
    if not exc.param:
        return exc
    param, message = _TERMS.renamed(exc.param, exc.message)
    return APIError(exc.status, message, param=param, code=exc.code, type=exc.type, headers=exc.headers)
