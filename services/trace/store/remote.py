"""RemoteTraceStore (docs/requirements.md#remote-trace-store): a peer's traces through its gateway's trace
API (`/api/traces`), over libs.peer_http (timeouts, bounded retries of reads, no redirects, gzip, a
size bound, TLS verified). The peer decides who we are from the credential of its registry entry, so
`owner` is not sent; what a peer's trace cannot do from here (rename, move its head, delete) is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from agentmesh.libs.errors import FailedPrecondition, Unavailable
from agentmesh.libs.peer_http import PeerClient
from agentmesh.libs.protojson import from_json, to_json
from agentmesh.services.trace.domain import Cursor
from agentmesh.services.trace.store.base import Deleted, MessagePage, MessageQuery, MessageStore, TraceStore
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp

MODES: dict[int, str] = {ms.PATH_MODE_ALL: "all"}  # anything else: the main path
# What a message sent home carries (ids, sequences and times are the peer's to give).
SENT_FIELDS = ("role", "content", "thinking", "metadata", "model", "usage", "status", "source")


def _parse(data: Any, msg: Any, what: str) -> Any:
    try:
        return from_json(data, msg)
    except (ValueError, TypeError) as exc:
        raise Unavailable(f"the peer answered a malformed {what}: {exc}") from exc


def outgoing(message: tp.Message) -> dict[str, Any]:
    """A message as POST /api/traces/{id}/messages takes it."""
    data = to_json(message)
    return {k: v for k, v in data.items() if k in SENT_FIELDS}


class RemoteTraceStore(TraceStore, MessageStore):
    def __init__(self, client: PeerClient) -> None:
        self.client = client

    def _refused(self, what: str) -> FailedPrecondition:
        return FailedPrecondition(f"{what} a trace of peer {self.client.peer.alias!r} is done at its home")

    async def get_trace(self, owner: str, trace_id: str) -> tp.Trace:
        body = await self.client.get(self.client.trace_path(trace_id))
        if not isinstance(body, dict):
            raise Unavailable("the peer answered a malformed trace")
        return _parse(body.get("trace"), tp.Trace(), "trace")  # type: ignore[no-any-return]

    async def count_messages(self, owner: str, trace_id: str) -> tuple[int, int]:
        body = await self.client.get(self.client.trace_path(trace_id))
        return int(body.get("messageCount", 0)), int(body.get("mainPathCount", 0))

    async def list_messages(self, owner: str, query: MessageQuery) -> MessagePage:
        params = {
            "mode": MODES.get(query.mode, "main_path"),
            "head_sequence": query.head_sequence,
            "since_sequence": query.since_sequence,
            "limit": query.limit,
            "offset": query.offset,
        }
        body = await self.client.get(
            self.client.trace_path(query.trace_id, "/messages"), {k: v for k, v in params.items() if v}
        )
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise Unavailable("the peer answered a malformed message page")
        messages = [_parse(m, tp.Message(), "message") for m in body["messages"]]
        return MessagePage(messages, int(body.get("headSequence", 0)), int(body.get("total", 0)))

    async def append_messages(
        self, owner: str, trace_id: str, messages: Sequence[tp.Message], parent_sequence: int | None = None
    ) -> list[tp.Message]:
        payload: dict[str, Any] = {"messages": [outgoing(m) for m in messages]}
        if parent_sequence is not None:
            payload["parentSequence"] = parent_sequence
        body = await self.client.post(self.client.trace_path(trace_id, "/messages"), payload)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise Unavailable("the peer answered a malformed append")
        return [_parse(m, tp.Message(), "message") for m in body["messages"]]

    async def append_message(
        self, owner: str, message: tp.Message, parent_sequence: int | None = None
    ) -> tp.Message:
        (out,) = await self.append_messages(owner, message.trace_id, [message], parent_sequence)
        return out

    # ---- what a peer's trace does not do from here ------------------------------------------------

    async def create_trace(self, owner: str, trace: tp.Trace, trace_id: str) -> tp.Trace:
        raise self._refused("creating")

    async def list_traces(self, owner: str, limit: int, after: Cursor | None) -> list[tp.Trace]:
        raise self._refused("listing")

    async def update_trace(self, owner: str, trace: tp.Trace, fields: Collection[str]) -> tp.Trace:
        raise self._refused("changing")

    async def delete_traces(self, owner: str, trace_ids: Sequence[str] | None) -> Deleted:
        raise self._refused("deleting")

    async def set_head(self, owner: str, trace_id: str, head_sequence: int) -> tp.Trace:
        raise self._refused("moving the head of")

    async def create_trace_with_messages(
        self, owner: str, trace: tp.Trace, trace_id: str, messages: Sequence[tp.Message]
    ) -> tuple[tp.Trace, list[tp.Message]]:
        raise self._refused("creating")

    async def update_message(self, owner: str, message: tp.Message, fields: Collection[str]) -> tp.Message:
        raise self._refused("changing a message of")

    async def get_message(self, owner: str, message_id: int) -> tp.Message:
        raise self._refused("reading one message by id of")
