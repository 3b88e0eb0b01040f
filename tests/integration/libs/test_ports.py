"""Ports are owned: a gRPC service, the gateway's and the model server's HTTP sockets never share a
port (no SO_REUSEPORT), and the tests' port reservation (tests.mesh.Ports) works with servers that
refuse to share."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import httpx
import pytest

from agentmesh.libs import embedded_http
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import BindError, ServiceServer
from tests.mesh import Ports


async def app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def ports() -> Iterator[Ports]:
    held = Ports()
    yield held
    held.release()


def service(address: str) -> ServiceServer:
    return ServiceServer([], Signer(b"test-secret-of-the-ports-tests"), address=address, grace_s=0.1)


async def test_a_grpc_port_is_not_shared(ports: Ports) -> None:
    first = await service(f"127.0.0.1:{ports.take()}").start()
    try:
        with pytest.raises(BindError, match=r"cannot listen on 127\.0\.0\.1"):
            await service(first.target).start()
        # Not even by a server that asks for SO_REUSEPORT (gRPC's default).
        other = grpc.aio.server()
        with pytest.raises(RuntimeError):
            other.add_insecure_port(first.target)
        with pytest.raises(OSError):
            await embedded_http.serve(app, port=first.port)
    finally:
        await first.stop(0)


async def test_an_http_port_is_not_shared(ports: Ports) -> None:
    server = await embedded_http.serve(app, port=ports.take())
    try:
        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:.*in use"):
            embedded_http.bind("127.0.0.1", server.port)
        with pytest.raises(BindError):
            await service(f"127.0.0.1:{server.port}").start()
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{server.port}/")).text == "ok"
    finally:
        await server.stop()


async def test_a_reserved_port_is_kept_from_others_and_served_by_its_server(ports: Ports) -> None:
    port = ports.take()
    with socket.socket() as other, pytest.raises(OSError):  # a program that does not reuse addresses
        other.bind(("127.0.0.1", port))
    grpc_server = await service(f"127.0.0.1:{port}").start()  # the process the port was reserved for
    await grpc_server.stop(0)
    http_server = await embedded_http.serve(app, port=port)  # and again after it stopped (a restart)
    await http_server.stop()
