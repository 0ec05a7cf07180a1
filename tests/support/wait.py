"""Waiting on state, never on a guess of how long something takes: poll a condition until it holds or a generous
deadline passes (then fail, saying what was awaited). The deadline is a safety net for a hung test, not a measure."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

POLL_S = 0.005
# An HTTP poll builds a client (a TLS context, ~50 ms of CPU) and a connection: a few a second, not 200, so that the
# waiting test does not take a core from the server it waits for on a shared 2-core machine.
HTTP_POLL_S = 0.2

T = TypeVar("T")


def wait_until(condition: Callable[[], object], what: str = "the condition", timeout: float = 30.0,
               alive: Callable[[], bool] | None = None, poll: float = POLL_S) -> None:
    """Block until `condition()` is truthy. `alive`: also fail at once when it turns false (a thread that died)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert alive is None or alive(), f"gave up waiting for {what}: what should provide it is gone"
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(poll)


def wait_for_value(get: Callable[[], T], holds: Callable[[T], object], what: str, timeout: float = 30.0,
                   poll: float = POLL_S) -> T:
    """`wait_until` that hands back the value it waited on (the /health body that said "error"), for the test's
    own assertions on the rest of it."""
    seen: list[T] = []

    def held() -> object:
        seen[:] = [get()]
        return holds(seen[0])

    wait_until(held, what, timeout, poll=poll)
    return seen[0]


def answers(url: str, status: int = 200, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers `status` now; False too while nothing listens there yet (a server starting)."""
    try:
        return httpx.get(url, timeout=timeout).status_code == status
    except httpx.TransportError:
        return False


def wait_serving(proc: subprocess.Popen[str], url: str, timeout: float, log: Path | None = None,
                 request_timeout: float = 2.0) -> None:
    """Until GET `url` answers 200 from the server process `proc`; fails at once if `proc` exits first. A failure
    (exit or deadline; `proc` is then killed) carries the tail of its output: `log` when it writes there, else its
    stdout pipe."""
    try:
        wait_until(lambda: answers(url, timeout=request_timeout), f"{url} to answer 200", timeout,
                   alive=lambda: proc.poll() is None, poll=HTTP_POLL_S)
    except AssertionError as exc:
        if proc.poll() is None:
            proc.kill()
        output = log.read_text(errors="replace") if log is not None else proc.communicate()[0]
        raise AssertionError(f"{exc} (exit code {proc.wait()}):\n{(output or '')[-4000:]}") from None


async def until(condition: Callable[[], object], what: str = "the condition", timeout: float = 30.0) -> None:
    """`wait_until` for a coroutine: yields to the event loop between checks."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(POLL_S)
