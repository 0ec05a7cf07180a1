"""A Messages request as a `ChatCompletionRequest` (`chat_request`): its system prompt and content blocks as chat
messages, its tools, tool_choice, output format and thinking as the chat fields. A chat-path error is given back in
Anthropic's shape naming the Messages field it came from (`in_messages_terms`).

The thinking mapping (the chat path holds the one thinking budget every route shares):
- `thinking: {type: enabled, budget_tokens: N}` -> thinking on (`chat_template_kwargs.enable_thinking`) and
  `reasoning_budget = N`; `{type: adaptive}` -> thinking on, no budget of its own; `{type: disabled}` -> thinking off;
- `output_config.effort` -> `reasoning_effort` (Anthropic's "max" is chat's highest, "xhigh"); without `thinking` it
  turns thinking on, as any effort does on chat. With thinking disabled it is refused: here an effort only sizes the
  thought, so it would change nothing.

System turns: a `system` turn inside `messages` (Claude Code sends a trailing one, and reminders mid-conversation) is a
chat `system` message in place, which Gemma-4's template renders as a system turn where it stands: the prompt before
it stays what it was (a turn appended to the system prompt instead would change the prompt's first tokens, and no
cached prefix would survive it). The top-level system's `x-anthropic-billing-header:` block (Claude Code's first block,
different in every invocation) is billing metadata, not an instruction, and left out of the prompt, so that two
invocations share their whole system prompt and tools in the cache.

Deferred tools (`defer_loading: true`) are left out of the prompt until the conversation surfaces them: a tool_use of
that name, or a tool result that names it in a `<function>{...}</function>` line (the form Claude Code's ToolSearch
answers in). A surfaced tool is declared with the others from then on (Gemma-4 declares tools in the system turn, so
that request re-prefills from there once).

Images: an `image` block is a chat `image_url` part (a base64 source as its data: URL, a url source as its URL), read
by the chat path's own reader, so the prompt and the images the engine gets are chat's. The route checks first what
it can without reading (`check_images`: a server that reads no images, a url source where none is downloaded), in
Messages words; a reader's error about a part is given back naming the block it came from (`places`, by the same walk
as the translation).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from server.api.chat.plan import Terms, translated
from server.api.messages.schemas import (
    ImageBlock,
    InputMessage,
    MessagesRequest,
    PromptBody,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UrlSource,
)
from server.api.schemas import ChatCompletionRequest
from server.errors import AnthropicError, APIError, ContextOverflow

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


Shown = Sequence[tuple[int, TextBlock | ImageBlock]]  # text and image blocks with their indices in the content sent


def _content(blocks: Shown, where: str, chat_index: int, places: dict[str, str] | None) -> str | list[dict[str, Any]]:
    """Text blocks as one text (joined with "\n", as chat joins its parts); with images, chat content parts in order
    (an image: an `image_url` part, which the chat path's reader reads), each image's chat param
    (`messages[C].content[P]`) recorded in `places` as its block's (`WHERE[B]`)."""
    if not any(isinstance(block, ImageBlock) for _, block in blocks):
        return "\n".join(block.text for _, block in blocks if isinstance(block, TextBlock))
    parts: list[dict[str, Any]] = []
    for part, (index, block) in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
            continue
        parts.append({"type": "image_url", "image_url": {"url": block.source.url}})
        if places is not None:
            places[f"messages[{chat_index}].content[{part}]"] = f"{where}[{index}]"
    return parts


def _result(block: ToolResultBlock, where: str, chat_index: int,
            places: dict[str, str] | None) -> str | list[dict[str, Any]]:
    """A tool_result's content as a tool message's: its text (`{"error": TEXT}` with `is_error`), then its images."""
    blocks = list(enumerate(block.content))
    if not block.is_error:
        return _content(blocks, where, chat_index, places)
    error = TextBlock(type="text", text=json.dumps({"error": "\n".join(
        b.text for b in block.content if isinstance(b, TextBlock))}))
    return _content([(-1, error), *((j, b) for j, b in blocks if isinstance(b, ImageBlock))], where, chat_index, places)


BILLING_HEADER = "x-anthropic-billing-header:"
_FUNCTION_LINE = re.compile(r"<function>(.*?)</function>", re.DOTALL)


def system_text(system: Sequence[TextBlock] | None) -> str:
    """The top-level system prompt's text, the billing-header block left out (see the module docstring)."""
    return "\n".join(b.text for b in system or () if not b.text.startswith(BILLING_HEADER))


def chat_messages(system: Sequence[TextBlock] | None, messages: Sequence[InputMessage],
                  places: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages: an assistant message's thinking blocks are its `reasoning_content`
    (the template decides whether to render it), its tool_use blocks its `tool_calls`; a user message's tool_result
    blocks become tool messages (before its text and images, as Anthropic orders them), its text and image blocks one
    user message (chat content parts, in order). A result with `is_error` is given to the model as `{"error": TEXT}`
    (Gemma-4 renders it as the tool's response object), followed by its images if it has any. `places`, when given,
    maps each image's chat param to its Messages block's: a chat-path error about an image names the block sent."""
    text = system_text(system)
    chat: list[dict[str, Any]] = [{"role": "system", "content": text}] if text else []
    for i, message in enumerate(messages):
        if message.role == "system":
            chat.append({"role": "system", "content": "\n".join(b.text for b in message.content
                                                                 if isinstance(b, TextBlock))})
            continue
        if message.role == "assistant":
            texts = [block.text for block in message.content if isinstance(block, TextBlock)]
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
        for j, block in enumerate(message.content):
            if isinstance(block, ToolResultBlock):
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": _result(block, f"messages[{i}].content[{j}].content", len(chat), places)})
        shown = [(j, block) for j, block in enumerate(message.content) if isinstance(block, TextBlock | ImageBlock)]
        if shown or not any(isinstance(block, ToolResultBlock) for block in message.content):
            chat.append({"role": "user", "content": _content(shown, f"messages[{i}].content", len(chat), places)})
    return chat


def image_blocks(body: PromptBody) -> list[tuple[str, ImageBlock]]:
    """Every image block of the conversation with its param (`messages[0].content[1]`, or inside a tool_result
    `messages[0].content[0].content[1]`), in order."""
    found: list[tuple[str, ImageBlock]] = []
    for i, message in enumerate(body.messages):
        for j, block in enumerate(message.content):
            if isinstance(block, ImageBlock):
                found.append((f"messages[{i}].content[{j}]", block))
            elif isinstance(block, ToolResultBlock):
                found += [(f"messages[{i}].content[{j}].content[{k}]", inner) for k, inner in enumerate(block.content)
                          if isinstance(inner, ImageBlock)]
    return found


def check_images(body: PromptBody, images_off: str | None, allow_urls: bool) -> None:
    """What the route knows before reading: a server that reads no images (`images_off` says why) refuses the first
    image block, one that downloads none the first url source, each naming the block (the chat path would name its
    own part)."""
    blocks = image_blocks(body)
    if blocks and images_off is not None:
        param = blocks[0][0]
        raise AnthropicError(400, f"{param}: image blocks are not supported: {images_off}", param=param,
                             code="invalid_value")
    if not allow_urls:
        param = next((param for param, block in blocks if isinstance(block.source, UrlSource)), None)
        if param is not None:
            raise AnthropicError(400, f"{param}: url image sources are off on this server (--allow-image-urls): send "
                                 "the image as a base64 source", param=param, code="invalid_value")


def surfaced_tools(messages: Sequence[InputMessage]) -> set[str]:
    """The tool names the conversation has brought up: called, or given in a tool result's `<function>` line."""
    names: set[str] = set()
    for message in messages:
        for block in message.content:
            if isinstance(block, ToolUseBlock):
                names.add(block.name)
            elif isinstance(block, ToolResultBlock):
                for inner in block.content:
                    if isinstance(inner, TextBlock) and "<function>" in inner.text:
                        names.update(_function_names(inner.text))
    return names


def _function_names(text: str) -> list[str]:
    names = []
    for match in _FUNCTION_LINE.finditer(text):
        try:
            declared = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(declared, dict) and isinstance(declared.get("name"), str):
            names.append(declared["name"])
    return names


def effort_of(body: PromptBody) -> str | None:
    """The effort asked for: the latest turn's own `output_config.effort` (per-turn control), else the body's."""
    for message in reversed(body.messages):
        if message.output_config is not None and message.output_config.effort is not None:
            return message.output_config.effort
    return body.output_config.effort if body.output_config else None


def _thinking_fields(body: PromptBody) -> dict[str, Any]:
    thinking, effort = body.thinking, effort_of(body)
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
    surfaced = surfaced_tools(body.messages) if body.tools and any(t.defer_loading for t in body.tools) else set()
    tools = [tool for tool in body.tools or () if not tool.defer_loading or tool.name in surfaced]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.system, body.messages),
        "tools": [{"type": "function", "function": tool.model_dump(include={"name", "description"}, exclude_none=True)
                   | {"parameters": tool.input_schema}} for tool in tools] or None,
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
    return translated(fields, lambda exc: in_messages_terms(exc, body))


_RENAMED = (("response_format.json_schema.schema", "output_config.format.schema"),
            ("response_format.json_schema", "output_config.format"), ("response_format", "output_config.format"),
            ("reasoning_effort", "output_config.effort"), ("reasoning_budget", "thinking.budget_tokens"),
            ("chat_template_kwargs", "thinking"), ("stop", "stop_sequences"),
            ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))
_TOOL_FUNCTION = re.compile(r"^(tools\[\d+\])\.function(?:\.parameters\b)?")
# Chat's message indices are not Messages indices (the system prompt, tool results): any of them is `messages`.
_TERMS = Terms("messages", _RENAMED, functools.partial(_TOOL_FUNCTION.sub, lambda m: m.group(1) + (
    ".input_schema" if m.group(0).endswith("parameters") else "")))


def in_messages_terms(exc: APIError, body: PromptBody | None = None) -> AnthropicError:
    """A chat-path error in Anthropic's shape, naming the Messages field it came from (with `body`, the request it
    was translated from: an error about an image part names its image block). A prompt too long for the context is
    worded exactly as Anthropic words it (see ContextOverflow)."""
    if isinstance(exc, ContextOverflow):
        return AnthropicError(400, exc.anthropic_message, param="messages", code=exc.code)
    if not exc.param:
        return AnthropicError.of(exc)
    places: dict[str, str] = {}  # an image part's chat param -> the block it came from
    if body is not None and exc.param.startswith("messages["):
        chat_messages(body.system, body.messages, places)  # the same walk as the translation, to find the block
    param, message = _TERMS.renamed(exc.param, exc.message, places)
    return AnthropicError(exc.status, message, param=param, code=exc.code, headers=exc.headers)
