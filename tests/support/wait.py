"""Waiting on state, never on a guess of how long something takes: poll a condition until it holds or a generous
deadline passes (then fail, saying what was awaited). The deadline is a safety net for a hung test, not a measure."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

POLL_S = 0.005


def wait_until(condition: Callable[[], object], what: str = "the condition", timeout: float = 30.0,
               alive: Callable[[], bool] | None = None) -> None:
    """Block until `condition()` is truthy. `alive`: also fail at once when it turns false (a thread that died)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert alive is None or alive(), f"gave up waiting for {what}: what should provide it is gone"
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(POLL_S)


async def until(condition: Callable[[], object], what: str = "the condition", timeout: float = 30.0) -> None:
    """`wait_until` for a coroutine: yields to the event loop between checks."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(POLL_S)
