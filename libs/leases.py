"""LeaseKeeper: how a process that runs work keeps its leases alive (the orchestrator for its turns'
placeholders and buffers, the runtime for its agent-invoke tasks, subagents and their buffers).

Work registers what it holds (`with keeper.hold(message=..., stream=...)`); one loop per process
renews everything held, every third of the lease time, in one LeaseService call and one StreamService
call, as the mesh itself. When the process dies, the renewals stop, the leases run out, and a
surviving service settles what was left (the orchestrator's reaper; the stream service ends the
buffers). A renewal that fails is retried at the next tick; a lease lasts three ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc

from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.libs import identity
from agentmesh.libs.clients import Clients
from agentmesh.stream.v1 import stream_service_pb2 as ss

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, clients: Clients, lease_s: float) -> None:
        self.clients = clients
        self.interval_s = max(lease_s / 3, 0.05)
        self.held: Counter[tuple[str, int | str]] = Counter()  # (kind, id) -> how many hold it
        self._loop: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def hold(
        self, *, message: int = 0, task: str = "", subagent: str = "", stream: str = ""
    ) -> Iterator[None]:
        """Keeps these leases alive for the duration of the block (the same lease may be held twice)."""
        kinds = (("message", message), ("task", task), ("subagent", subagent), ("stream", stream))
        leases: list[tuple[str, int | str]] = [(kind, key) for kind, key in kinds if key]
        self.held.update(leases)
        try:
            yield
        finally:
            self.held.subtract(leases)
            for lease in leases:
                if self.held[lease] <= 0:
                    del self.held[lease]

    def _ids(self, kind: str) -> list[Any]:
        return [key for (k, key) in self.held if k == kind]

    def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._renew_forever(), name="lease-keeper")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None

    async def renew(self) -> None:
        """One round: every lease held now, the two services' side by side."""
        results = await asyncio.gather(self._renew_rows(), self._renew_streams(), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _renew_rows(self) -> None:
        messages, tasks, subagents = (self._ids(k) for k in ("message", "task", "subagent"))
        if messages or tasks or subagents:
            with identity.acting_as(""):  # leases are the mesh's own business
                await self.clients.leases.RenewLeases(
                    ls.RenewLeasesRequest(message_ids=messages, task_ids=tasks, subagent_ids=subagents)
                )

    async def _renew_streams(self) -> None:
        streams = self._ids("stream")
        if streams:
            with identity.acting_as(""):
                await self.clients.stream.RenewStreams(ss.RenewStreamsRequest(keys=streams))

    async def _renew_forever(self) -> None:
        # One loop per service: a trace service slowed by load (its writes queue) must not hold back the
        # buffers' renewals until their leases run out, which ended busy turns as if they were abandoned.
        await asyncio.gather(self._every(self._renew_rows), self._every(self._renew_streams))

    async def _every(self, renew: Any) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await renew()
            except grpc.aio.AioRpcError as exc:
                log.warning("lease renewal failed, retrying: %s", exc.details())
