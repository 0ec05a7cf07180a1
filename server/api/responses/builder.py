"""The response object of `/v1/responses` as it is built: output items and their typed events (`OutputBuilder`), the
object before and after its output (`response_shell`, `finished`), an input item as listed (`listed_item`).

Deliberate choices (do not "fix" these without reading why):
- One builder makes the output items *and* the stream events that build them; a non-streamed response is the same
  builder fed the same engine deltas, so the two cannot differ.
- The thought channel is a `reasoning` item whose `content` holds the thought's text (`reasoning_text` parts, as
  OpenAI's open-weight models return it). There is no summarizer (a second generation at ~6 tok/s would double the
  wait), so when `reasoning.summary` is asked for, the item's `summary` is the thought itself, verbatim, as one
  `summary_text` part: clients that show only summaries (agents, IDE assistants) then show the thinking. Without
  that field `summary` is `[]`, as OpenAI's.
- A response cut by `max_output_tokens` (or by the context) is `status: "incomplete"` with
  `incomplete_details.reason: "max_output_tokens"`.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Mapping
from typing import Any

from server.api.chat.plan import ChatPlan
from server.api.responses.schemas import FunctionChoice, ReasoningConfig, ResponsesRequest, TextFormat
from server.api.responses.translate import custom_input
from server.api.thought_tokens import ThoughtTokens
from server.engine.types import Delta, Finish
from server.protocol import OutputParser, ParsedDelta, ToolCallDelta


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it (OpenAI's item shapes): with an id (the one it
    was sent with, else a new one), text content as parts, `status: "completed"`."""
    listed = {"id": item.get("id") or _new_id(_ID_PREFIXES[item["type"]]), **item, "status": "completed"}
    if item["type"] == "message":
        if isinstance(item["content"], list):  # with images: the chat parts it was read into, as Responses parts
            listed["content"] = [{"type": "input_text", "text": part["text"]} if part["type"] == "text" else
                                 {"type": "input_image", "image_url": part["image_url"]["url"],
                                  "detail": part["image_url"].get("detail") or "auto"} for part in item["content"]]
        elif item["role"] == "assistant":
            listed["content"] = [{"type": "output_text", "text": item["content"], "annotations": []}]
        else:
            listed["content"] = [{"type": "input_text", "text": item["content"]}]
    return listed


class OutputBuilder:
    """The generated text as output items (through the plan's parser) and their events in order (each a dict with its
    `type`; the stream adds `sequence_number`): a `reasoning` item for the thought channel, a `message` item for visible
    text, a `function_call` item per complete call, a new item whenever the kind of text changes. Events carry copies:
    an item keeps growing after its `output_item.added` was sent."""

    def __init__(self, parser: OutputParser, *, summary: bool = False, custom: frozenset[str] = frozenset(),
                 namespaces: Mapping[str, str] | None = None) -> None:
        self.parser = parser
        self._summary = summary  # the thought is also each reasoning item's summary (reasoning.summary was asked)
        self._custom = custom  # names of custom tools: their calls are custom_tool_call items, their input raw text
        self._namespaces = dict(namespaces or {})  # a namespaced tool's name -> its namespace
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item text is added to
        self._thought = ThoughtTokens()  # usage's reasoning_tokens, counted as Messages counts thinking_tokens

    @property
    def reasoning_tokens(self) -> int:
        return self._thought.count

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        parsed = self.parser.feed(delta.text) if delta.text else ParsedDelta()
        self._thought.feed(delta, parsed)
        return self._add(parsed)

    def finish(self, reason: str) -> list[dict[str, Any]]:
        parsed = self.parser.finish().delta
        self._thought.finish(parsed)
        events = self._add(parsed)
        if not self.items:  # nothing at all: still one (empty) message, so output_text is ""
            events += self._start("message")
        return events + self._close("incomplete" if reason == "length" else "completed")

    def _add(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events = self._text("reasoning", parsed.reasoning) if parsed.reasoning else []
        if parsed.content:
            events += self._text("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._call(call)
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items) - 1}

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self._open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": copy.deepcopy(item)}
        item["content"].append(part)
        events = [added, {"type": "response.content_part.added", **self._where(item), "content_index": 0,
                          "part": copy.deepcopy(part)}]
        if kind == "reasoning" and self._summary:
            item["summary"].append({"type": "summary_text", "text": ""})
            events.append({"type": "response.reasoning_summary_part.added", **self._where(item), "summary_index": 0,
                           "part": {"type": "summary_text", "text": ""}})
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close("completed") + self._start(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        if kind == "message":
            events.append({"type": "response.output_text.delta", **self._where(item), "content_index": 0,
                           "delta": text, "logprobs": []})
        else:
            events.append({"type": "response.reasoning_text.delta", **self._where(item), "content_index": 0,
                           "delta": text})
            if item["summary"]:
                item["summary"][0]["text"] += text
                events.append({"type": "response.reasoning_summary_text.delta", **self._where(item),
                               "summary_index": 0, "delta": text})
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        part = item["content"][0]
        where = {**self._where(item), "content_index": 0}
        if item["type"] == "message":
            events = [{"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []}]
        else:
            events = [{"type": "response.reasoning_text.done", **where, "text": part["text"]}]
        events.append({"type": "response.content_part.done", **where, "part": copy.deepcopy(part)})
        for summary in item.get("summary", ()):  # one part at most: the thought itself
            at = {**self._where(item), "summary_index": 0}
            events += [{"type": "response.reasoning_summary_text.done", **at, "text": summary["text"]},
                       {"type": "response.reasoning_summary_part.done", **at, "part": copy.deepcopy(summary)}]
        item["status"] = status
        return [*events,
                {"type": "response.output_item.done", "output_index": where["output_index"],
                 "item": copy.deepcopy(item)}]

    def _call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        if call.name in self._custom:
            return self._custom_call(call)
        events = self._close("completed")
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        if call.name in self._namespaces:
            item["namespace"] = self._namespaces[call.name]
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        # The parser emits a call once, complete: its arguments are one delta.
        events.append({"type": "response.function_call_arguments.delta", **self._where(item), "delta": call.arguments})
        item.update(arguments=call.arguments, status="completed")
        events.append({"type": "response.function_call_arguments.done", **self._where(item), "name": call.name,
                       "arguments": call.arguments})
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        return events

    def _custom_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        """A call to a custom tool: a `custom_tool_call` item, its `input` the raw text the model wrote as the call's
        one string argument (server.api.responses.translate.chat_tool), with OpenAI's input delta/done events."""
        events = self._close("completed")
        text = custom_input(call.arguments)
        item: dict[str, Any] = {"id": _new_id("ctc"), "type": "custom_tool_call", "status": "in_progress",
                                "call_id": call.id, "name": call.name, "input": ""}
        if call.name in self._namespaces:
            item["namespace"] = self._namespaces[call.name]
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        events.append({"type": "response.custom_tool_call_input.delta", **self._where(item), "delta": text})
        item.update(input=text, status="completed")
        events.append({"type": "response.custom_tool_call_input.done", **self._where(item), "input": text})
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        return events


def response_shell(response_id: str, body: ResponsesRequest, plan: ChatPlan) -> dict[str, Any]:
    """The response object before any output: its id and the request's settings echoed, as OpenAI's."""
    choice = body.tool_choice
    text_format = body.text.format if body.text and body.text.format else TextFormat(type="text")
    reasoning = body.reasoning or ReasoningConfig()
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "max_tool_calls": None, "model": plan.model, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.asked_summary},
        "store": body.store is not False, "temperature": plan.sampling.temperature,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True),
                 **({"verbosity": body.text.verbosity} if body.text and body.text.verbosity else {})},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "top_p": plan.sampling.top_p, "truncation": "disabled", "usage": None, "user": body.user,
        "metadata": body.metadata or {},
    }


def finished(shell: dict[str, Any], builder: OutputBuilder, finish: Finish) -> dict[str, Any]:
    cut = finish.reason == "length"
    return {
        **shell, "status": "incomplete" if cut else "completed", "completed_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": copy.deepcopy(builder.items),
        "usage": {
            "input_tokens": finish.prompt_tokens,
            # cached: the prompt prefix reused from the device's KV cache; written: the rest, prefilled now
            "input_tokens_details": {"cached_tokens": finish.reused_tokens,
                                     "cache_write_tokens": finish.prompt_tokens - finish.reused_tokens,
                                     "cache_write_tokens_details": None},  # no TTL: kept until evicted
            "output_tokens": finish.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": builder.reasoning_tokens},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        },
    }
