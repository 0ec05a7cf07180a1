"""`serve(settings, listener) -> int`, the composition root: take the socket `listen()` bound before anything
loaded, load the host side, build the engine and the app (which is given only the engine and the model's facts),
apply the process-wide policy, run uvicorn on that socket until SIGTERM.

SIGTERM (or Ctrl+C) drains instead of stopping at once: `/health` turns 503 "draining" (the load balancer
stops sending), new requests get 503, requests in flight run to completion for up to `shutdown_grace_s`, the
rest are cancelled, then uvicorn stops and we exit 0. A second signal stops at once.

Deliberate choices:
- `DrainingServer.handle_exit` replaces uvicorn's: uvicorn's records the signal and re-raises it after
  shutdown (so the process would die *by* SIGTERM, exit status 143, not 0), and stops at once.
- uvicorn's own access log is off: the API logs one line per generation request with its token counts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from server.app.process import collector_paused, release_freed_memory
from server.config import Settings
from server.errors import ArtifactError

log = logging.getLogger("server.api")  # the server's one log voice, as before the move


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[bool]], grace_s: float) -> None:
        super().__init__(config)
        self._drain = drain
        self.grace_s = grace_s
        self.drained: bool | None = None  # None: no drain happened; else whether it finished in time
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            log.warning("signal %d again: stopping now", sig)
            self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining for up to %g s, then stopping", sig, self.grace_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        try:
            self.drained = await self._drain(self.grace_s)
        finally:
            self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
    """The bound listening socket, made before anything loads: a taken port or a bad address fails at once, not after
    the graph load. uvicorn is handed the socket (its own bind would come only after the app is built)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on connections whose socket says
    # proto == IPPROTO_TCP. With proto 0 every small write (an SSE chunk, a short JSON answer on a keep-alive
    # connection) waited for the client's delayed ACK: +40 ms per response, measured by the bench's TTFT.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse a TIME_WAIT port
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve(settings: Settings, listener: socket.socket | None = None, *, chat: bool = True,
          description: str | None = None) -> int:
    """Serve until SIGTERM; `listener` is the socket from `listen()` (made here when not given). `chat`, `description`:
    as `load_host` takes them (the demo knows which of its models is a base model)."""
    listener = listener or listen(settings.host, settings.port)
    with collector_paused():  # the engine freezes start-up's objects out of the collector once the graph is in
        from server.api.app import create_app
        from server.app.page import chat_page_html
        from server.app.runtime import build_engine, load_host
        from server.vision.load import VisionUnavailable

        try:
            host = load_host(settings.artifacts, settings.graph, settings.served_model_name, settings.cache_dir,
                             chat=chat, description=description, settings=settings)
        except (ArtifactError, VisionUnavailable) as exc:
            print(f"error: {exc}", file=sys.stderr)
            listener.close()
            return 1
        release_freed_memory()
        engine = build_engine(host, settings)
        app = create_app(settings, engine, host.info, page=chat_page_html())
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level.lower(), access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, server_header=False)
    server = DrainingServer(config, app.state.drain, settings.shutdown_grace_s)
    log.info("serving %s (%s graph) on http://%s:%d", host.model_name, host.graph_kind, settings.host, listener.getsockname()[1])
    try:
        server.run(sockets=[listener])
    except SystemExit as exc:  # uvicorn exits 1 when its start-up fails (the port is already ours)
        return exc.code if isinstance(exc.code, int) else 1
    if server.drained is False:
        log.warning("some requests were cancelled at shutdown")
    return 0
