"""The message object of `/v1/messages` as it is built: content blocks and their stream events (`MessageBuilder`), the
message before and after its content (`message_shell`, `finished`).

Deliberate choices (do not "fix" these without reading why):
- One builder makes the content blocks *and* the stream events that build them; a non-streamed message is the same
  builder fed the same engine deltas, so the two cannot differ.
- The thought channel is a `thinking` block holding the thought's text, its `signature` empty (this server signs
  nothing; a signature sent back is ignored). With `thinking.display: "omitted"` the block is there, its text empty.
- A tool call is emitted by the protocol's parser once, complete: its `tool_use` block's input arrives as one
  `input_json_delta` (Anthropic's clients accumulate partial JSON; one whole piece is valid). Its id is `toolu_...`.
- `usage.input_tokens` counts the prompt tokens prefilled for this request; `cache_read_input_tokens` those reused
  from the device's KV cache (their sum is the prompt, as Anthropic counts); `cache_creation_input_tokens` is 0: no
  cache marker is needed (or honoured) to keep a prefix. The stream's `message_start` cannot know the reuse yet: it
  counts the whole prompt as input, and `message_delta` carries the final counts (Anthropic's are cumulative there).
- Every field the `anthropic` SDK declares on a Message and its usage is there, null or zero where it does not apply
  (no container, no refusal details, no server tools, no cache writes); `output_tokens_details.thinking_tokens`
  counts the thought's tokens (server.api.thought_tokens).
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from server.api.thought_tokens import ThoughtTokens
from server.engine.types import Delta, Finish
from server.protocol import OutputParser, ParsedDelta, ToolCallDelta


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class MessageBuilder:
    """The generated text as content blocks (through the plan's parser) and their events in order: a `thinking` block
    for the thought channel, a `text` block for visible text, a `tool_use` block per complete call, a new block
    whenever the kind of text changes. Events carry copies: a block keeps growing after its start was sent."""

    def __init__(self, parser: OutputParser, *, show_thinking: bool = True) -> None:
        self.parser = parser
        self._show_thinking = show_thinking
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the thinking or text block text is added to
        self.called_tools = False
        self.thought = ThoughtTokens()

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        parsed = self.parser.feed(delta.text) if delta.text else ParsedDelta()
        self.thought.feed(delta, parsed)
        return self._add(parsed)

    def finish(self) -> list[dict[str, Any]]:
        end = self.parser.finish()
        self.called_tools = end.called_tools
        self.thought.finish(end.delta)
        return self._add(end.delta) + self._close()

    def _add(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events = self._text("thinking", parsed.reasoning) if parsed.reasoning else []
        if parsed.content:
            events += self._text("text", parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.blocks.append(block)
        return {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": copy.deepcopy(block)}

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close()
            self._open = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            events.append(self._start(self._open))
        if kind == "thinking" and not self._show_thinking:
            return events
        self._open[kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = self._close()
        block: dict[str, Any] = {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}}
        events.append(self._start(block))
        block["input"] = json.loads(call.arguments)  # the parser's arguments are a JSON object's text
        index = len(self.blocks) - 1
        return [*events, {"type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                {"type": "content_block_stop", "index": index}]


def message_shell(message_id: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """The message before any content (the stream's `message_start`)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "stop_details": None, "container": None, "diagnostics": None,
            "usage": _usage(prompt_tokens, 0, 0, 0)}


def _usage(input_tokens: int, reused: int, output_tokens: int, thinking_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": reused,
            "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
            "output_tokens_details": {"thinking_tokens": thinking_tokens},
            "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
            "service_tier": "standard", "speed": "standard", "inference_geo": None}


def stop_reason(finish: Finish, called_tools: bool) -> str:
    if finish.reason == "length":
        return "max_tokens"
    if finish.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called_tools else "end_turn"


def usage(finish: Finish, builder: MessageBuilder) -> dict[str, Any]:
    return _usage(finish.prompt_tokens - finish.reused_tokens, finish.reused_tokens, finish.completion_tokens,
                  builder.thought.count)


def final_delta(finish: Finish, builder: MessageBuilder) -> dict[str, Any]:
    """The stream's `message_delta`: how it ended, and the final usage."""
    return {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, builder.called_tools),
                                               "stop_sequence": finish.stop_sequence, "stop_details": None,
                                               "container": None},
            "usage": usage(finish, builder)}


def finished(shell: dict[str, Any], builder: MessageBuilder, finish: Finish) -> dict[str, Any]:
    return {**shell, "content": copy.deepcopy(builder.blocks), "stop_reason": stop_reason(finish, builder.called_tools),
            "stop_sequence": finish.stop_sequence, "usage": usage(finish, builder)}
