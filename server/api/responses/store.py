"""The stored responses of `/v1/responses`: bounded in count and in bytes, the oldest evicted first.

Each entry keeps the response object as it was returned (what `GET /v1/responses/{id}` answers), the whole
conversation it ends (the input items of every earlier turn, this request's input items, then its output items), and
this request's input items as `GET /v1/responses/{id}/input_items` lists them.
A `previous_response_id` therefore needs one entry, not a chain of them: evicting an older turn never breaks a later
one. The price is that a long conversation is held once per turn; `max_bytes` bounds the total.

Deliberate choices:
- In memory, per process: a restart forgets every response (a client then gets a 404 and sends the whole input).
- Sizes are the entries' compact JSON in UTF-8, measured once when stored.
- An entry larger than the whole byte budget is not kept (evicting everything else would not make room).
- Everything runs on the event loop: no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    conversation: tuple[dict[str, Any], ...]  # input items of every turn so far, then this response's output items
    inputs: tuple[dict[str, Any], ...]  # this request's input items, listed (ids, parts, status)
    size: int  # bytes of JSON


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response: dict[str, Any], conversation: Sequence[dict[str, Any]],
            inputs: Sequence[dict[str, Any]]) -> bool:
        """Keep a response (replacing one with the same id); evicts the oldest until both bounds hold. False when
        it cannot be kept at all (storing off, or larger than the whole byte budget)."""
        size = len(json.dumps([response, list(conversation), list(inputs)], ensure_ascii=False,
                              separators=(",", ":")).encode())
        if self.max_count == 0 or size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, tuple(conversation), tuple(inputs), size)
        self.bytes += size
        while len(self._entries) > self.max_count or self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
