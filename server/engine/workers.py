"""`HostWorkers`: where a request's host work runs, off the device-owner thread, so no stream waits for it: an image
encode (`--vision host`: seconds of matmuls a picture) and the scoring of a prompt's chunk (log-softmax and gather over
[T, V] logits: ~70 ms a 128-token chunk at V = 262k). torch releases the GIL inside its big ops, so a worker's kernels
and the device thread's graph calls and sampling run side by side.

- One thread per kind of work (`VISION`, `SCORING`), each its own queue: a scored prompt never waits behind an image.
  One thread a kind, not more: the work is matmul- or bandwidth-bound and torch already spreads one op over the cores.
- The worker threads run at a lower CPU priority (nice +NICE, Linux: per thread): on a host with fewer free cores than
  busy threads, the device thread, whose every millisecond is every stream's, wins the core; the workers take the
  rest (the device thread mostly waits on the device).
- `inline()` runs every piece of work at once on the caller's thread, its future done before `submit` returns: the
  engine core stepped by a test (synchronous, thread-free) behaves as it always did.
- `on_done` is called from the worker when a piece of work ends (the front wakes the device thread with it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

VISION, SCORING = "vision", "scoring"
NICE = 10


def _background() -> None:
    """A worker thread's own priority, lowered (always allowed; a platform without per-thread nice keeps it)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


class HostWorkers:
    def __init__(self, *, threads: bool = True, on_done: Callable[[], None] | None = None) -> None:
        self._on_done = on_done
        self._pools: dict[str, ThreadPoolExecutor] = {}
        if threads:
            self._pools = {kind: ThreadPoolExecutor(1, thread_name_prefix=f"host-{kind}", initializer=_background)
                           for kind in (VISION, SCORING)}

    @classmethod
    def inline(cls) -> HostWorkers:
        return cls(threads=False)

    @property
    def threaded(self) -> bool:
        return bool(self._pools)

    def submit(self, kind: str, work: Callable[..., T], *args: Any) -> Future[T]:
        """`work(*args)` on `kind`'s thread (inline: now); its future holds the result or the exception."""
        pool = self._pools.get(kind)
        if pool is None:
            future: Future[T] = Future()
            try:
                future.set_result(work(*args))
            except Exception as exc:  # noqa: BLE001 - the future carries it, as a pool's would
                future.set_exception(exc)
        else:
            future = pool.submit(work, *args)
        if self._on_done is not None:
            on_done = self._on_done
            future.add_done_callback(lambda _: on_done())
        return future

    def shutdown(self) -> None:
        """No more work; what has not started is dropped (its requests are ending with the engine)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
