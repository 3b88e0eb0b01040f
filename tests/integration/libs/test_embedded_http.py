"""libs/embedded_http: the sockets it binds serve like uvicorn's own."""

from __future__ import annotations

import socket

import httpx

from agentmesh.libs import embedded_http


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


async def test_connections_have_tcp_nodelay() -> None:
    """Without TCP_NODELAY a response written as head then body waits for the client's delayed ACK
    (about 40 ms each); asyncio sets it only on sockets created as IPPROTO_TCP."""
    server = await embedded_http.serve(app)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            assert (await http.get("/")).text == "ok"
            (connection,) = server.server_state.connections
            sock = connection.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        await server.stop()
