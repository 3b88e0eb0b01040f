"""Bringing a cached copy of a peer's trace up to date
(docs/federation.md#reading-and-appending-a-peers-trace) within a budget shorter than the caller's
(docs/federation.md#budgets).

One sync per owner and trace at a time: a read that finds one under way joins it. A read whose copy
exists waits for the sync at most `cached_read_wait_s` (and never past its caller's deadline minus
`deadline_margin_s`), then answers from the copy, marked stale, while the sync goes on in the
background and leaves the copy fresher for the next read. A read with no copy waits for as long as its
caller's deadline allows. The peer's HTTP client bounds the sync itself by the same deadline and marks a
peer that timed out down like one that refused (libs.peer_http).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass

from agentmesh.libs import deadlines
from agentmesh.libs.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from agentmesh.libs.ids import TraceRef
from agentmesh.libs.peers import Peer
from agentmesh.services.trace.store.base import CopyState, CopyStore, MessageQuery
from agentmesh.services.trace.store.remote import RemoteTraceStore
from agentmesh.trace.v1 import message_service_pb2 as ms

log = logging.getLogger(__name__)
UNREACHABLE = (Unavailable, DeadlineExceeded, ResourceExhausted)


@dataclass
class Remote:
    """A peer's trace: the peer, its location-bearing id and the store that reads it there."""

    peer: Peer
    ref: TraceRef  # the short form, @alias/id: the id we hand out and the copy's key
    store: RemoteTraceStore

    @property
    def home(self) -> str:
        return str(self.ref)


def located(peer: Peer, trace_id: str) -> str:
    """A trace id as the peer gave it, in a form that means the same here: its own traces as
    `@alias/<id>`; an id that already names where it lives stays as it is."""
    if not trace_id:
        return ""
    try:
        ref = TraceRef.parse(trace_id)
    except InvalidArgument:
        return trace_id
    return str(peer.ref(ref.id)) if ref.is_local else trace_id


class CopySync:
    def __init__(
        self,
        copies: CopyStore,
        page_size: int = 1000,
        cached_read_wait_s: float = 0.8,
        deadline_margin_s: float = 0.5,
    ) -> None:
        self.copies = copies
        self.page_size = page_size
        self.cached_read_wait_s = cached_read_wait_s
        self.deadline_margin_s = deadline_margin_s
        self._running: dict[tuple[str, str], asyncio.Task[CopyState]] = {}

    async def close(self) -> None:
        tasks, self._running = list(self._running.values()), {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def sync(self, owner: str, r: Remote, *, allow_stale: bool) -> tuple[CopyState, bool]:
        """Brings the owner's copy of `r` up to date; (the copy, True when it could not: stale).
        Without `allow_stale` (a turn or an append follows) the peer must answer: UNAVAILABLE if not."""
        state = await self.copies.find(owner, r.home)
        if state is not None and state.outbox and not state.outbox_pending:
            # a turn on the copy that ended unsent (its process died; a reaper settled its placeholder):
            # what it wrote never reached home, so it goes (never a silent local fork)
            await self.copies.drop_outbox(owner, state.trace_id)
            state = await self.copies.find(owner, r.home)
        if state is not None and state.outbox:
            if not allow_stale:
                raise FailedPrecondition(f"a turn is already running on {r.home} here")
            return state, False  # a turn runs on the copy: it is what the run reads
        if not allow_stale:
            try:
                return await self._fetch(owner, r, state), False
            except UNREACHABLE as err:
                raise Unavailable(f"cannot append to {r.home}: {err.message}; nothing was appended") from err
        task = self._running.get((owner, r.home))
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(owner, r, state))
            self._running[(owner, r.home)] = task
            task.add_done_callback(functools.partial(self._done, (owner, r.home)))
        wait = deadlines.budget(self.deadline_margin_s, self.cached_read_wait_s if state else None)
        why = ""
        try:
            async with asyncio.timeout(wait):
                return await asyncio.shield(task), False
        except TimeoutError:
            why = "did not answer in time"
        except UNREACHABLE as err:
            why = err.message
        state = await self.copies.find(owner, r.home)
        if state is None:
            raise Unavailable(f"{r.home}: {why}, and there is no cached copy")
        log.info("peer %s: %s; reading the cached copy of %s", r.peer.alias, why, r.home)
        return state, True

    def _done(self, key: tuple[str, str], task: asyncio.Task[CopyState]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled() and task.exception() is not None:  # retrieved: a reader may be gone
            log.info("the sync of %s ended: %s", key[1], task.exception())

    async def _fetch(self, owner: str, r: Remote, state: CopyState | None) -> CopyState:
        """The trace and every message after the last sequence held (plus any still pending there),
        page by page, saved into the copy."""
        since = state.home_sequence if state else 0
        if state is not None and state.pending_from:
            since = min(since, state.pending_from - 1)
        trace = await r.store.get_trace(owner, r.ref.id)
        while True:
            query = MessageQuery(r.ref.id, ms.PATH_MODE_ALL, since_sequence=since, limit=self.page_size)
            page = await r.store.list_messages(owner, query)
            for m in page.messages:
                m.caller_trace_id = located(r.peer, m.caller_trace_id)
            done = len(page.messages) < self.page_size
            saved = await self.copies.save(owner, r.home, trace, page.messages, final=done)
            if done:
                return saved
            since = page.messages[-1].sequence
