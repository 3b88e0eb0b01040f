"""The reaper: settles what work left behind when the process running it died. Every orchestrator
replica runs one (at start, then every half lease): LeaseService.ReapExpired settles the expired rows in
the trace database (never the same row twice across replicas).

The reaper does not end their buffers: the stream service does, with an `interrupted` error, once the
buffer's own lease runs out (the dead process renewed both). A buffer is ended by its lease, never by
its key: by the time a row is reaped, the user may have started a new turn whose live buffer has the
same key (`session:<id>`)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.libs import identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.metrics import OrchestratorMetrics

log = logging.getLogger(__name__)
BATCH = 100


class Reaper:
    def __init__(self, clients: Clients, lease_s: float, metrics: OrchestratorMetrics | None = None) -> None:
        self.clients = clients
        self.metrics = metrics or OrchestratorMetrics()
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
                for kind, count in (
                    ("message", resp.messages),
                    ("task", resp.tasks),
                    ("subagent", resp.subagents),
                ):
                    if count:
                        self.metrics.reaped.labels(kind).inc(count)
                if resp.stream_keys or resp.messages or resp.tasks or resp.subagents:
                    log.info(
                        "reaped orphans",
                        extra={
                            "messages": resp.messages,
                            "tasks": resp.tasks,
                            "subagents": resp.subagents,
                            "buffers": list(resp.stream_keys),
                        },
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
