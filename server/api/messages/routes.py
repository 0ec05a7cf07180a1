"""The Messages API's routes: `POST /v1/messages`, planned and submitted through the chat package's `ChatPlanner` (the
same checks, prompt, constraints, budget and parser as `/v1/chat/completions`; only the shape is new), and
`POST /v1/messages/count_tokens`, the same prompt counted.

Deliberate choices (do not "fix" these without reading why):
- Every error of these routes is Anthropic's JSON (the app's handler picks the shape by route, see server/errors.py);
  after the headers of a stream, a failure is an `error` event, as Anthropic sends it.
- The stream's events come in Anthropic's order: `message_start`, then per block `content_block_start`,
  `content_block_delta`s, `content_block_stop` (a `ping` after the first block's start, or before the end when there
  is no block), then `message_delta` (stop_reason, usage) and `message_stop`. `message_start` goes out as soon as the
  request is admitted, and a `ping` event every --sse-ping seconds while no other event comes (a long prompt being
  prefilled, or waiting for a slot): Claude Code resends a request after ~300 s without a byte.
- `context_management` edits are applied to the body before it is planned (context.py), so the prompt, usage and
  count_tokens all see the edited conversation; what they cleared is the message's (and the stream's `message_start`
  and `message_delta`'s) `context_management.applied_edits`.
- A prompt longer than the context is a 400 whose message is exactly `prompt is too long: N tokens > M maximum`
  (M: the context less the one token a completion needs), the text Claude Code compacts its conversation on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.chat.plan import ChatPlanner
from server.api.http import parse, read_body
from server.api.messages.builder import MessageBuilder, final_delta, finished, message_shell
from server.api.messages.context import apply_edits
from server.api.messages.schemas import CountTokensRequest, MessagesRequest, PromptBody
from server.api.messages.translate import chat_request, check_images, in_messages_terms
from server.api.schemas import ChatCompletionRequest
from server.api.service import Service
from server.api.sse import frame, with_keepalive
from server.engine.types import Completion, Delta, RequestHandle
from server.errors import AnthropicError, APIError

PING = {"type": "ping"}
Body = TypeVar("Body", bound=PromptBody)


def _event(payload: dict[str, Any]) -> bytes:
    return frame(payload, event=payload["type"])


class MessagesRoutes:
    def __init__(self, service: Service, chat: ChatPlanner, *, images_off: str | None = None) -> None:
        """`images_off`: why this server reads no images (image blocks are a 400 naming the first); None: it does."""
        self.service = service
        self.settings = service.settings
        self.chat = chat
        self.images_off = images_off

    def _chat_body(self, body: PromptBody) -> ChatCompletionRequest:
        check_images(body, self.images_off, self.settings.allow_image_urls)
        return chat_request(body)

    async def _count(self, body: PromptBody) -> int:
        try:
            return len(await self.chat.prompt_ids(chat_request(body)))
        except APIError as exc:
            raise in_messages_terms(exc, body) from None

    async def _edited(self, body: Body) -> tuple[Body, dict[str, Any] | None]:
        """`body` with its context edits applied, and the `context_management` to answer with (None: none asked)."""
        if body.context_management is None:
            return body, None
        check_images(body, self.images_off, self.settings.allow_image_urls)  # before any rendering reads them
        edited, applied = await apply_edits(body, self._count)
        return edited, {"applied_edits": applied}

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)

    # ------------------------------------------------------------------ POST /v1/messages

    async def create(self, request: Request) -> Response:
        body, managed = await self._edited(parse(MessagesRequest, await self._body(request)))
        chat_body = self._chat_body(body)
        message_id = f"msg_{request.state.completion_id}"
        try:
            plan = await self.chat.plan_chat(chat_body)
            (handle,) = self.chat.submit_plan(plan, chat_body, 1, param="messages", request_id=message_id)
        except APIError as exc:
            raise in_messages_terms(exc, body) from None
        shell = message_shell(message_id, plan.model, len(plan.ids))
        if managed is not None:
            shell["context_management"] = managed
        thinking = body.thinking
        builder = MessageBuilder(plan.new_parser(), show_thinking=thinking is None or thinking.display not in (
            "omitted", "updates"))

        def whole(done: list[Completion]) -> dict[str, Any]:
            for delta in done[0].deltas:
                builder.feed(delta)
            builder.finish()
            return finished(shell, builder, done[0].finish)

        return await self.service.answer(request, [handle], self._stream(handle, builder, shell) if body.stream else None,
                                         whole)

    async def _stream(self, handle: RequestHandle, builder: MessageBuilder,
                      shell: dict[str, Any]) -> AsyncIterator[bytes]:
        yield _event({"type": "message_start", "message": shell})
        pinged = False
        try:
            async for engine_event in with_keepalive(self.service.events(handle), self.settings.sse_ping_s):
                if engine_event is None:  # nothing for a while: the prompt is being prefilled, or waits
                    yield _event(PING)
                    continue
                payloads = builder.feed(engine_event) if isinstance(engine_event, Delta) else builder.finish()
                for payload in payloads:
                    yield _event(payload)
                    if not pinged and payload["type"] == "content_block_start":
                        pinged = True
                        yield _event(PING)
                if not isinstance(engine_event, Delta):
                    if not pinged:
                        yield _event(PING)
                    last = final_delta(engine_event, builder)
                    if "context_management" in shell:
                        last["context_management"] = shell["context_management"]
                    yield _event(last)
                    yield _event({"type": "message_stop"})
        except Exception as exc:  # noqa: BLE001 - after the headers: in-band; a bug must still end the stream properly
            error = AnthropicError.of(self.service.stream_failure(exc, shell["id"]))
            yield _event(error.to_json())

    # ------------------------------------------------------------------ POST /v1/messages/count_tokens

    async def count_tokens(self, request: Request) -> Response:
        body, managed = await self._edited(parse(CountTokensRequest, await self._body(request)))
        chat_body = self._chat_body(body)
        try:
            ids = await self.chat.prompt_ids(chat_body)
        except APIError as exc:
            raise in_messages_terms(exc, body) from None
        answer: dict[str, Any] = {"input_tokens": len(ids)}
        if managed is not None:  # as Anthropic answers it: the count before the edits too. Each applied edit's
            # cleared_input_tokens is its before minus its after, and each before the last one's after: their sum
            # and today's count are the original's, with no second rendering of the unedited conversation.
            cleared = sum(edit["cleared_input_tokens"] for edit in managed["applied_edits"])
            answer["context_management"] = {"original_input_tokens": len(ids) + cleared}
        return JSONResponse(answer)
