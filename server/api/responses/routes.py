"""The Responses API's routes: `POST /v1/responses`, planned and submitted through the chat package's `ChatPlanner`
(the same checks, prompt, constraints and parser as `/v1/chat/completions`; only the shape is new), `GET` and `DELETE
/v1/responses/{id}`, and its `/input_items`.

Deliberate choices (do not "fix" these without reading why):
- A stored response keeps its whole conversation (see store.py); `previous_response_id` continues it.
  `instructions` are not carried over from the previous response, nor are `tools` (OpenAI's rules).
- After the headers of a stream, a failure is `response.failed` (its `error` set), not an HTTP status; a response
  cut short ends its stream with `response.incomplete`.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.chat.plan import ChatPlanner
from server.api.http import parse, read_body
from server.api.responses.builder import OutputBuilder, finished, listed_item, response_shell
from server.api.responses.schemas import INPUT_ITEMS, CustomTool, ReasoningConfig, ResponsesRequest
from server.api.responses.store import ResponseStore
from server.api.responses.translate import chat_request, in_responses_terms
from server.api.service import Service
from server.api.sse import frame
from server.engine.types import Completion, Delta, RequestHandle
from server.errors import APIError

log = logging.getLogger("server.api")


def _not_found(response_id: str, param: str | None = None) -> APIError:
    shown = response_id if len(response_id) <= 100 else response_id[:100] + "..."
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id '{shown}' not found (never stored, deleted, evicted from this server's "
                    "bounded store, or stored before a restart).", param=param,
                    code="previous_response_not_found" if param else "response_not_found",
                    type="invalid_request_error")


class ResponsesRoutes:
    def __init__(self, service: Service, chat: ChatPlanner, store: ResponseStore) -> None:
        self.service = service
        self.settings = service.settings
        self.chat = chat
        self.store = store

    # ------------------------------------------------------------------ POST /v1/responses

    async def create(self, request: Request) -> Response:
        body = parse(ResponsesRequest, await read_body(request, self.settings.max_body_bytes,
                                                       self.settings.body_timeout_s), untagged=True)
        history: tuple[dict[str, Any], ...] = ()
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = previous.conversation
        given = [item.model_dump(by_alias=True, exclude_none=True) for item in body.input]
        conversation = [*history, *given]
        if not conversation:
            raise APIError(400, "input: required (a string or a list of items)", param="input", code="invalid_value")
        chat_body = chat_request(body, INPUT_ITEMS.validate_python(conversation))
        response_id = f"resp_{request.state.completion_id}"
        try:
            plan = await self.chat.plan_chat(chat_body)
            (handle,) = self.chat.submit_plan(plan, chat_body, 1, param="input", request_id=response_id)
        except APIError as exc:
            raise in_responses_terms(exc) from None
        shell = response_shell(response_id, body, plan)
        custom = frozenset(tool.name for tool in body.offered_tools() if isinstance(tool, CustomTool))
        builder = OutputBuilder(plan.new_parser(), summary=(body.reasoning or ReasoningConfig()).asked_summary is not None,
                                custom=custom, namespaces=body.namespaces())

        def keep(response: dict[str, Any]) -> None:
            if body.store is False:
                return
            inputs = [listed_item(item) for item in given]  # ids for the items sent without one: only when stored
            if not self.store.put(response, [*conversation, *response["output"]], inputs):
                log.warning("%s: not stored (larger than --responses-store-bytes, or storing is off)", response_id)

        def whole(done: list[Completion]) -> dict[str, Any]:
            for delta in done[0].deltas:
                builder.feed(delta)
            builder.finish(done[0].finish.reason)
            response = finished(shell, builder, done[0].finish)
            keep(response)
            return response

        return await self.service.answer(request, [handle],
                                         self._stream(handle, builder, shell, keep) if body.stream else None, whole)

    async def _stream(self, handle: RequestHandle, builder: OutputBuilder, shell: dict[str, Any],
                      keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def event(payload: dict[str, Any]) -> bytes:
            return frame({**payload, "sequence_number": next(numbers)}, event=payload["type"])

        yield event({"type": "response.created", "response": shell})
        yield event({"type": "response.in_progress", "response": shell})
        try:
            async for engine_event in self.service.events(handle):
                if isinstance(engine_event, Delta):
                    for payload in builder.feed(engine_event):
                        yield event(payload)
                    continue
                for payload in builder.finish(engine_event.reason):
                    yield event(payload)
                response = finished(shell, builder, engine_event)
                keep(response)
                yield event({"type": f"response.{response['status']}", "response": response})
        except Exception as exc:  # noqa: BLE001 - after the headers: in-band; a bug must still end the stream properly
            error = {"code": "server_error", "message": self.service.stream_failure(exc, shell["id"]).message}
            failed = {**shell, "status": "failed", "output": copy.deepcopy(builder.items), "error": error}
            yield event({"type": "response.failed", "response": failed})

    # ------------------------------------------------------------------ GET, DELETE /v1/responses/{id}, input_items

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(400, "stream: replaying a stored response as a stream is not supported", param="stream",
                           code="invalid_value")
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response)

    async def input_items(self, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items`: the input items of that request (not of earlier turns), a cursor page
        as OpenAI's: `limit` 1-100 (20), `order` `desc` (newest first, the default) or `asc`, `after` an item id."""
        response_id = request.path_params["response_id"]
        query = request.query_params
        unknown = sorted(set(query) - {"limit", "order", "after", "include", "include[]"})
        if unknown:
            raise APIError(400, f"{unknown[0]}: unknown query parameter (supported: limit, order, after)",
                           param=unknown[0], code="invalid_value")
        if query.getlist("include") or query.getlist("include[]"):
            raise APIError(400, "include: nothing can be included (text items only)", param="include",
                           code="invalid_value")
        limit_text = query.get("limit", "20")
        if not (limit_text.isascii() and limit_text.isdigit() and 1 <= int(limit_text) <= 100):
            raise APIError(400, "limit: must be an integer from 1 to 100", param="limit", code="invalid_value")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order: must be 'asc' or 'desc'", param="order", code="invalid_value")
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        items = list(stored.inputs if order == "asc" else reversed(stored.inputs))
        start = 0
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                raise APIError(400, f"after: no input item of {response_id} has that id", param="after",
                               code="invalid_value")
            start = ids.index(query["after"]) + 1
        page = items[start:start + int(limit_text)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": start + len(page) < len(items)})

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
