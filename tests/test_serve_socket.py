"""The listening socket `serve()` hands to uvicorn: connections accepted on it must have Nagle off.

asyncio sets TCP_NODELAY on an accepted connection only when its socket says proto == IPPROTO_TCP; a listener made
with proto 0 gave every keep-alive response and SSE chunk a wait for the client's delayed ACK (~40 ms each).
"""

from __future__ import annotations

import asyncio
import socket

from server.app.serve import listen


def test_connections_accepted_on_the_listener_have_nagle_off() -> None:
    async def accepted_nodelay() -> int:
        listener = listen("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)  # as uvicorn does with it
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
