"""HybridTraceStore (docs/requirements.md#hybrid-trace-store, #remote-trace-cache): one TraceStore and
MessageStore that routes by trace reference. A local id goes to the local stores; `@alias/id` or
`agent://host[:port]/id` goes to the registered peer it names (libs.peers refuses anything else
before any connection), read through a cached copy in our own database:

- a read brings the copy up to date first (the first read fetches everything; later ones only what is
  after the last sequence held, plus any message still pending there), then answers from the copy, with
  every paging option the local store has; when the peer does not answer, the copy answers, marked
  stale with its sync time; with no copy, the read fails UNAVAILABLE;
- an append of finished messages (POST /api/traces/{id}/messages here) goes straight to the peer; when
  the peer does not answer it fails UNAVAILABLE and nothing is appended anywhere; an append to a copy
  by its local id is refused (FAILED_PRECONDITION naming the home id): it would never reach home, and
  the next sync would drop it;
- a turn of a local agent on a peer's trace (agent-invoke continueFrom) appends its user message and
  pending placeholder to the copy (the outbox), so the run reads the peer's main path as its history;
  when the placeholder completes, the turn's messages are sent home in one append and the outbox is
  dropped (the next sync brings them back under the peer's sequences); a turn that fails or cannot be
  sent home leaves nothing behind: never a silent local fork.

The handlers, and behind them the runtime and the orchestrator, see one store and never know where a
trace lives. It holds no rule of the domain: the handlers have applied them before it is called.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence

from agentmesh.libs.errors import (
    FailedPrecondition,
    MeshError,
    NotFound,
    Unavailable,
)
from agentmesh.libs.ids import TraceRef
from agentmesh.libs.peer_http import NotSent, PeerClients
from agentmesh.libs.peers import PeerRegistry
from agentmesh.services.trace.domain import FINAL_MESSAGE_STATES, Cursor
from agentmesh.services.trace.store.base import (
    Append,
    CopyState,
    CopyStore,
    Deleted,
    MessagePage,
    MessageQuery,
    MessageStore,
    TraceCopy,
    TraceStore,
    each_apart,
)
from agentmesh.services.trace.store.copy_sync import UNREACHABLE, CopySync, Remote
from agentmesh.services.trace.store.remote import RemoteTraceStore
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)


def unconfirmed(r: Remote, err: MeshError, what: str = "") -> Unavailable:
    """An append the peer did not confirm: certainly not appended when the request never left, else
    perhaps (the answer was lost): the message says which, never a guess."""
    what = f" {what}" if what else ""
    if isinstance(err, NotSent):
        return Unavailable(f"cannot append{what} to {r.home}: {err.message}; nothing was appended")
    return Unavailable(
        f"the append{what} to {r.home} was not confirmed ({err.message}): it may or may not have arrived; "
        "read the trace to see"
    )


def copy_refused(trace_id: str, home: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"trace {trace_id} is this mesh's cached copy of {home}: append to {home}, which appends at its home"
    )


class HybridTraceStore(TraceStore, MessageStore):
    def __init__(
        self,
        local: TraceStore,
        local_messages: MessageStore,
        copies: CopyStore,
        registry: PeerRegistry | None = None,
        peers: PeerClients | None = None,
        page_size: int = 1000,
        cached_read_wait_s: float = 0.8,
        deadline_margin_s: float = 0.5,
    ) -> None:
        self.local = local
        self.messages = local_messages
        self.copies = copies
        self.registry = registry or PeerRegistry()
        self.peers = peers
        self.syncer = CopySync(copies, page_size, cached_read_wait_s, deadline_margin_s)

    async def close(self) -> None:
        await self.syncer.close()

    # ---- routing ----------------------------------------------------------------------------------

    def remote(self, trace_id: str, owner: str | None = None) -> Remote | None:
        """None for a local id; the peer of a remote one; InvalidArgument for a malformed id and
        PermissionDenied for an unregistered host or alias, or a peer `owner` may not use (before any
        connection)."""
        ref = TraceRef.parse(trace_id)
        if ref.is_local:
            return None
        peer = self.registry.resolve(ref, owner)
        if self.peers is None:
            raise Unavailable("this mesh has no peers configured")
        return Remote(peer, peer.ref(ref.id), RemoteTraceStore(self.peers.of(peer)))

    async def sync(self, owner: str, r: Remote, *, allow_stale: bool) -> tuple[CopyState, bool]:
        """Brings the owner's copy of `r` up to date; (the copy, True when it could not: stale)."""
        return await self.syncer.sync(owner, r, allow_stale=allow_stale)

    def _out(self, message: tp.Message, r: Remote) -> tp.Message:
        message.trace_id = r.home
        return message

    # ---- reads ------------------------------------------------------------------------------------

    async def get_trace(self, owner: str, trace_id: str) -> tp.Trace:
        r = self.remote(trace_id, owner)
        if r is None:
            return await self.local.get_trace(owner, trace_id)
        state, stale = await self.sync(owner, r, allow_stale=True)
        trace = await self.local.get_trace(owner, state.trace_id)
        trace.id, trace.home, trace.stale = r.home, r.home, stale
        return trace

    async def count_messages(self, owner: str, trace_id: str) -> tuple[int, int]:
        r = self.remote(trace_id, owner)
        if r is None:
            return await self.local.count_messages(owner, trace_id)
        state = await self.copies.find(owner, r.home)  # GetTrace has just brought it up to date
        if state is None:
            state, _ = await self.sync(owner, r, allow_stale=True)
        return await self.local.count_messages(owner, state.trace_id)

    async def list_messages(self, owner: str, query: MessageQuery) -> MessagePage:
        r = self.remote(query.trace_id, owner)
        if r is None:
            return await self.messages.list_messages(owner, query)
        state, stale = await self.sync(owner, r, allow_stale=True)
        if self.peers is not None:
            self.peers.metrics.trace_reads.labels(r.peer.alias, "stale" if stale else "fresh").inc()
        local = MessageQuery(
            state.trace_id, query.mode, query.head_sequence, query.since_sequence, query.limit, query.offset
        )
        page = await self.messages.list_messages(owner, local)
        for m in page.messages:
            self._out(m, r)
        fresh = await self.copies.find(owner, r.home)
        page.stale = stale
        page.sync_time = fresh.synced_at if fresh else None
        return page

    async def list_traces(self, owner: str, limit: int, after: Cursor | None) -> list[tp.Trace]:
        return await self.local.list_traces(owner, limit, after)

    async def get_message(self, owner: str, message_id: int) -> tp.Message:
        return await self.messages.get_message(owner, message_id)

    # ---- writes -----------------------------------------------------------------------------------

    async def create_trace(self, owner: str, trace: tp.Trace, trace_id: str) -> tp.Trace:
        return await self.local.create_trace(owner, trace, trace_id)

    async def create_trace_with_messages(
        self, owner: str, trace: tp.Trace, trace_id: str, messages: Sequence[tp.Message]
    ) -> tuple[tp.Trace, list[tp.Message]]:
        return await self.messages.create_trace_with_messages(owner, trace, trace_id, messages)

    async def _refuse_copy(self, owner: str, trace_id: str) -> None:
        """A cached copy takes no append by its local id: a message appended there would never reach
        home, and the next sync would drop it."""
        home = (await self.copies.homes({(owner, trace_id)})).get((owner, trace_id))
        if home is not None:
            raise copy_refused(trace_id, home)

    async def append_message(
        self, owner: str, message: tp.Message, parent_sequence: int | None = None
    ) -> tp.Message:
        if self.remote(message.trace_id, owner) is None:
            await self._refuse_copy(owner, message.trace_id)
            return await self.messages.append_message(owner, message, parent_sequence)
        (out,) = await self.append_messages(owner, message.trace_id, [message], parent_sequence)
        return out

    async def append_each(self, appends: Sequence[Append]) -> list[tp.Message | MeshError]:
        """The appends to local traces go to the local store together; those to a peer's trace one
        after another (as append_message), beside them; those to a copy by its local id are refused."""

        def placed(a: Append) -> tuple[Append, bool]:  # (the append, to a local trace)
            return a, self.remote(a.message.trace_id, a.owner) is None

        async def both(found: list[tuple[Append, bool]]) -> list[tp.Message | MeshError]:
            homes = await self.copies.homes({(a.owner, a.message.trace_id) for a, here in found if here})

            def copy_of(a: Append) -> str | None:
                return homes.get((a.owner, a.message.trace_id))

            local, peers = await asyncio.gather(
                self.messages.append_each([a for a, here in found if here and copy_of(a) is None]),
                MessageStore.append_each(self, [a for a, here in found if not here]),
            )
            mine, theirs = iter(local), iter(peers)
            out: list[tp.Message | MeshError] = []
            for a, here in found:
                home = copy_of(a) if here else None
                if home is not None:
                    out.append(copy_refused(a.message.trace_id, home))
                else:
                    out.append(next(mine) if here else next(theirs))
            return out

        return await each_apart(appends, placed, both)

    async def append_messages(
        self, owner: str, trace_id: str, messages: Sequence[tp.Message], parent_sequence: int | None = None
    ) -> list[tp.Message]:
        r = self.remote(trace_id, owner)
        if r is None:
            await self._refuse_copy(owner, trace_id)
            return await self.messages.append_messages(owner, trace_id, messages, parent_sequence)
        if any(m.status == tp.MESSAGE_STATUS_PENDING for m in messages):
            # A turn of a local agent: into the copy's outbox, sent home when it completes.
            state, _ = await self.sync(owner, r, allow_stale=False)
            copied = []
            for m in messages:
                c = tp.Message()
                c.CopyFrom(m)
                c.trace_id = state.trace_id
                copied.append(c)
            stored = await self.messages.append_messages(owner, state.trace_id, copied, parent_sequence)
            return [self._out(m, r) for m in stored]
        try:
            sent = await r.store.append_messages(owner, r.ref.id, messages, parent_sequence)
        except UNREACHABLE as err:
            raise unconfirmed(r, err) from err
        try:
            await self.sync(owner, r, allow_stale=True)
        except MeshError as err:  # appended at home; the copy catches up on the next read
            log.info("could not refresh the copy of %s after an append: %s", r.home, err.message)
        return [self._out(m, r) for m in sent]

    async def update_message(self, owner: str, message: tp.Message, fields: Collection[str]) -> tp.Message:
        out = await self.messages.update_message(owner, message, fields)
        if "status" not in fields or out.status not in FINAL_MESSAGE_STATES:
            return out
        state = await self.copies.of_trace(owner, out.trace_id)
        if state is None or out.sequence <= state.home_sequence:
            return out
        return await self._send_home(owner, state, out)

    async def _send_home(self, owner: str, state: CopyState, placeholder: tp.Message) -> tp.Message:
        """The turn on a copy ended: a completed one goes home in one append, then the outbox goes."""
        r = self.remote(state.home, owner)
        assert r is not None
        outbox = await self.copies.outbox(owner, state.trace_id)
        try:
            if placeholder.status != tp.MESSAGE_STATUS_COMPLETED:
                return self._out(placeholder, r)  # a failed or cancelled turn is not sent home
            parent = outbox[0].parent_sequence if outbox else None
            try:
                sent = await r.store.append_messages(owner, r.ref.id, outbox, parent)
            except UNREACHABLE as err:
                raise unconfirmed(r, err, "the turn") from err
        finally:
            await self.copies.drop_outbox(owner, state.trace_id)
        try:
            await self.sync(owner, r, allow_stale=True)
        except MeshError as err:
            log.info("could not refresh the copy of %s after sending a turn: %s", r.home, err.message)
        return self._out(sent[-1], r)

    async def update_trace(self, owner: str, trace: tp.Trace, fields: Collection[str]) -> tp.Trace:
        if self.remote(trace.id, owner) is not None:
            raise FailedPrecondition("a peer's trace is renamed at its home")
        return await self.local.update_trace(owner, trace, fields)

    async def set_head(self, owner: str, trace_id: str, head_sequence: int) -> tp.Trace:
        if self.remote(trace_id, owner) is not None:
            raise FailedPrecondition("a peer's trace moves its head at its home")
        return await self.local.set_head(owner, trace_id, head_sequence)

    async def delete_traces(self, owner: str, trace_ids: Sequence[str] | None) -> Deleted:
        """Deleting a peer's trace here deletes our cached copy of it (the trace stays at home)."""
        if trace_ids is None:
            return await self.local.delete_traces(owner, None)
        local_ids = []
        for tid in trace_ids:
            r = self.remote(tid, owner)
            if r is None:
                local_ids.append(tid)
                continue
            state = await self.copies.find(owner, r.home)
            if state is None:
                raise NotFound("trace not found")
            local_ids.append(state.trace_id)
        return await self.local.delete_traces(owner, local_ids)

    async def copy_for_turn(self, owner: str, trace_id: str) -> TraceCopy | None:
        """For agent-invoke continueFrom: the copy of a peer's trace, synced now (the peer must answer:
        a turn appends to it); None for a local id."""
        r = self.remote(trace_id, owner)
        if r is None:
            return None
        state, _ = await self.sync(owner, r, allow_stale=False)
        return TraceCopy(state.trace_id, r.home)
