"""The response JSON of chat (`ChatFormat`) and legacy completions (`CompletionFormat`): one choice's stream chunks or
its entry in the body, built from engine events, logprobs included, and `usage`. The routes only drive a format."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.api.chat.prompts import Prompts
from server.api.thought_tokens import ThoughtTokens
from server.engine.types import Completion, Delta, Finish, PromptLogprobs, TokenLogprob
from server.protocol import OutputParser, ParsedDelta, ToolCallDelta
from server.protocol.base import ParsedMessage

_LOGPROB_FLOOR = -9999.0  # vLLM's floor: JSON has no -inf


def _lp(value: float) -> float:
    return value if math.isfinite(value) and value > _LOGPROB_FLOOR else _LOGPROB_FLOOR


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares: its id, model and creation time."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}


def usage(finishes: Sequence[Finish], n: int, fmts: Sequence[_Format]) -> dict[str, Any]:
    """OpenAI's usage over a request's choices, `n` per prompt: each prompt counted once, every completion; with the
    details the `openai` SDK declares (cached: the prompt prefix reused from the KV cache, written: the rest, prefilled
    now; reasoning: the thoughts' tokens; zero or null where they do not apply, or are not told apart)."""
    prompt = sum(finish.prompt_tokens for finish in finishes[::n])
    completion = sum(finish.completion_tokens for finish in finishes)
    cached = sum(finish.reused_tokens for finish in finishes[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached, "audio_tokens": 0,
                                      "image_tokens": None, "text_tokens": None},
            "completion_tokens_details": {"reasoning_tokens": sum(fmt.reasoning_tokens for fmt in fmts),
                                          "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0, "text_tokens": None}}


@dataclass
class _Format:
    """One choice's format. Each adds: opening() -> chunks before the first token; chunk(Delta) -> a chunk or None;
    final_chunks(reason); choice(text, deltas, finish) -> its entry in the non-stream body's `choices`."""

    object_name = ""
    chunk_object_name = ""
    prompts: Prompts
    envelope: Envelope
    index: int
    logprobs: bool

    @property
    def reasoning_tokens(self) -> int:
        return 0


@dataclass
class ChatFormat(_Format):
    """Chat responses: the generated text goes through the protocol's parser, which splits it into content, the
    thought channel (`reasoning_content`) and tool calls (`tool_calls`, finish_reason "tool_calls")."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    parser: OutputParser
    thought: ThoughtTokens = field(default_factory=ThoughtTokens)

    @property
    def reasoning_tokens(self) -> int:
        return self.thought.count

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.prompts.token_info(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": raw}

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for d in deltas:
            if d.logprob is not None:
                entry = self._entry(d.logprob.token_id, d.logprob.logprob)
                entry["top_logprobs"] = [self._entry(t, lp) for t, lp in d.logprob.top]
                content.append(entry)
        return {"content": content}

    def _chunk(self, delta: dict[str, Any], logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self.envelope.wrap(self.chunk_object_name, [choice])

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    @staticmethod
    def _delta_fields(parsed: ParsedDelta) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if parsed.reasoning:
            fields["reasoning_content"] = parsed.reasoning
        if parsed.content:
            fields["content"] = parsed.content
        if parsed.tool_calls:
            fields["tool_calls"] = [_tool_call(call, index=True) for call in parsed.tool_calls]
        return fields

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        parsed = self.parser.feed(delta.text) if delta.text else ParsedDelta()
        self.thought.feed(delta, parsed)
        fields = self._delta_fields(parsed)
        if fields or (self.logprobs and delta.logprob is not None):
            return self._chunk(fields or {"content": ""}, self._logprobs([delta]), None)
        return None

    def final_chunks(self, reason: str) -> list[dict[str, Any]]:
        end = self.parser.finish()
        self.thought.finish(end.delta)
        fields = self._delta_fields(end.delta)
        chunks = [self._chunk(fields, None, None)] if fields else []
        return [*chunks, self._chunk({}, None, _reason(reason, end.called_tools))]

    def prompt(self, prompt: PromptLogprobs) -> dict[str, Any] | None:
        return None  # chat scores no prompt

    def choice(self, done: Completion) -> dict[str, Any]:
        deltas, finish = done.deltas, done.finish
        parsed = ParsedMessage()  # fed delta by delta, as the stream is: the thought's tokens are counted
        for delta in deltas:
            piece = self.parser.feed(delta.text) if delta.text else ParsedDelta()
            self.thought.feed(delta, piece)
            parsed.add(piece)
        end = self.parser.finish()
        self.thought.finish(end.delta)
        parsed.add(end.delta)
        parsed.called_tools = end.called_tools
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
            message["content"] = parsed.content or None
        return {"index": self.index, "message": message, "logprobs": self._logprobs(deltas),
                "finish_reason": _reason(finish.reason, parsed.called_tools)}


def _reason(engine_reason: str, called_tools: bool) -> str:
    """A stop after complete calls is "tool_calls"; a cut ("length") stays what it is."""
    return "tool_calls" if called_tools and engine_reason == "stop" else engine_reason


def _tool_call(call: ToolCallDelta, index: bool = False) -> dict[str, Any]:
    entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **entry} if index else entry


class CompletionFormat(_Format):
    """Legacy completions. With `echo` the prompt's text comes first; with `scored` (echo and logprobs) its tokens'
    logprobs come first in `logprobs` too, the first token's null (nothing predicts it), as OpenAI and vLLM give them:
    in a stream, one chunk of the prompt's text and logprobs once its prefill ended, then the completion's."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, prompts: Prompts, envelope: Envelope, index: int, logprobs: bool, echo: str = "",
                 scored: bool = False) -> None:
        super().__init__(prompts, envelope, index, logprobs)
        self.echo = echo
        self.scored = scored
        self._echo_pending = scored  # the echo chunk waits for the prompt's logprobs (then goes out with them)
        self.offset = len(echo)  # text_offset of the next token

    def _entries(self, entries: Sequence[TokenLogprob | int], offset: int) -> tuple[dict[str, Any], int]:
        """OpenAI's legacy shape from `offset` on (and where the next token starts); the chosen token is always among
        top_logprobs (as vLLM does); a bare token id (the prompt's first) has null logprob and alternatives."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for lp in entries:
            if isinstance(lp, int):
                tokens.append(self.prompts.token_info(lp)[0])
                token_logprobs.append(None)
                tops.append(None)
            else:
                text = self.prompts.token_info(lp.token_id)[0]
                tokens.append(text)
                token_logprobs.append(_lp(lp.logprob))
                top = {self.prompts.token_info(t)[0]: _lp(v) for t, v in lp.top}
                top.setdefault(text, _lp(lp.logprob))
                tops.append(top)
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}, offset

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        shown, self.offset = self._entries([d.logprob for d in deltas if d.logprob is not None], self.offset)
        return shown

    def _prompt_logprobs(self, prompt: PromptLogprobs | None) -> dict[str, Any]:
        """The prompt's part of `logprobs` (text_offset from 0, within the echoed prompt)."""
        return self._entries([prompt.first_token, *prompt.entries] if prompt is not None else [], 0)[0]

    def _chunk(self, text: str, logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        return self.envelope.wrap(self.chunk_object_name,
                                  [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}])

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(self.echo, None, None)] if self.echo and not self.scored else []

    def prompt(self, prompt: PromptLogprobs) -> dict[str, Any] | None:
        """The echo chunk, with the prompt's logprobs."""
        self._echo_pending = False
        return self._chunk(self.echo, self._prompt_logprobs(prompt), None)

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        if delta.text or (self.logprobs and delta.logprob is not None):
            return self._chunk(delta.text, self._logprobs([delta]), None)
        return None

    def final_chunks(self, reason: str) -> list[dict[str, Any]]:
        # A request that ended before its prompt was scored (an error, a cancellation) still echoes its prompt.
        echo = [self._chunk(self.echo, None, None)] if self._echo_pending and self.echo else []
        self._echo_pending = False
        return [*echo, self._chunk("", None, reason)]

    def choice(self, done: Completion) -> dict[str, Any]:
        logprobs = self._logprobs(done.deltas)
        if self.scored and logprobs is not None:
            prompt = self._prompt_logprobs(done.prompt_logprobs)
            logprobs = {key: prompt[key] + logprobs[key] for key in prompt}
        return {"index": self.index, "text": self.echo + done.text, "logprobs": logprobs,
                "finish_reason": done.finish.reason}


Format = ChatFormat | CompletionFormat
