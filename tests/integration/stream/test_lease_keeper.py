"""libs.leases.LeaseKeeper against a real stream service: a trace service that cannot renew its rows'
leases must not keep the buffers' leases from being renewed (under load that ended live turns)."""

from __future__ import annotations

import socket

import grpc
import pytest

from agentmesh.libs.clients import Clients
from agentmesh.libs.identity import Signer
from agentmesh.libs.leases import LeaseKeeper
from tests.conftest import service_settings
from tests.integration.stream.conftest import StreamFactory, create, info


def _closed_port() -> str:
    """An address nobody listens on: the trace service is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_buffers_are_renewed_while_the_trace_service_fails(
    stream_factory: StreamFactory, signer: Signer, unique: str
) -> None:
    h = await stream_factory(lease_s=1.0)
    if h.clock is None:
        pytest.skip("the lease clock is moved by hand on the memory backend only")
    settings = service_settings(rpc_timeout_s=2.0)
    settings.addresses.stream = h.server.target
    settings.addresses.trace = _closed_port()
    clients = Clients(settings, signer)
    keeper = LeaseKeeper(clients, lease_s=1.0)
    key = f"trace:{unique}"
    await create(h, key)
    try:
        with keeper.hold(message=41, stream=key):
            for _ in range(3):  # three lease lengths pass, one renewal in each
                h.clock.advance(0.9)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await keeper.renew()  # the rows' renewal fails, and says so
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        found = await info(h, key)
        assert found.exists and not found.closed, "the buffer's lease was renewed all along"
        h.clock.advance(1.1)  # nobody renews any more: the lease runs out as it should
        assert (await info(h, key)).closed
    finally:
        await clients.close()
