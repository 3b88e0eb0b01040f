"""The reaper: settles what work left behind when the process running it died. Every orchestrator
replica runs one (at start, then every half lease): LeaseService.ReapExpired settles the expired rows in
the trace database (never the same row twice across replicas) and names their buffers, which the reaper
ends with an `interrupted` error, so every reader of them gets a terminal event."""

from __future__ import annotations

import asyncio
import logging

import grpc

from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.stream.v1 import stream_service_pb2 as ss
from libs import identity
from libs.clients import Clients
from libs.errors import Interrupted

log = logging.getLogger(__name__)
BATCH = 100


class Reaper:
    def __init__(self, clients: Clients, lease_s: float) -> None:
        self.clients = clients
        self.interval_s = max(lease_s / 2, 0.05)
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._reap_forever(), name="reaper")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None

    async def reap(self) -> int:
        """Rounds until nothing is left; returns how many rows were settled."""
        settled = 0
        with identity.acting_as(""):  # the mesh's own business, whoever's work it was
            while True:
                resp = await self.clients.leases.ReapExpired(ls.ReapExpiredRequest(limit=BATCH))
                settled += resp.messages + resp.tasks + resp.subagents
                error = Interrupted("the process running this turn stopped; it was settled").to_event()
                for key in resp.stream_keys:
                    try:
                        await self.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, error=error))
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.NOT_FOUND:  # gone already: nothing to end
                            raise
                if resp.stream_keys or resp.messages or resp.tasks or resp.subagents:
                    log.info(
                        "reaped orphans",
                        extra={"messages": resp.messages, "tasks": resp.tasks, "subagents": resp.subagents},
                    )
                if max(resp.messages, resp.tasks, resp.subagents) < BATCH:
                    return settled

    async def _reap_forever(self) -> None:
        while True:
            try:
                await self.reap()
            except grpc.aio.AioRpcError as exc:
                log.warning("reaping failed, retrying: %s", exc.details())
            await asyncio.sleep(self.interval_s)
