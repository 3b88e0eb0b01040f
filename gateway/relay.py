"""POST /api/traces/{peer's id}/run: a peer's trace is continued at its home (docs/federation.md#trace-ids),
its events relayed as they come (SSE) or its result waited for (JSON), with the trace named by its
location-bearing id here. Only a registered peer is contacted (libs.peers resolves the id first, a 403
before any connection otherwise); the peer's refusals come back as the same errors its other routes give
(libs.peer_http)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from httpx_sse import EventSource
from sse_starlette.sse import EventSourceResponse

from agentmesh.libs import jsonbound
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, MeshError, Unavailable
from agentmesh.libs.identity import current_user
from agentmesh.libs.ids import TraceRef
from agentmesh.libs.peers import Peer

TRACE_KEYS = ("traceId", "sessionId")  # what names a trace in the peer's events: its own ids there


def here(peer: Peer, data: dict[str, Any]) -> dict[str, Any]:
    """An event of the peer's, its trace ids as they are named here (`@alias/<id>`)."""
    for key in TRACE_KEYS:
        value = data.get(key)
        if isinstance(value, str) and value:
            with contextlib.suppress(InvalidArgument):
                if TraceRef.parse(value).is_local:
                    data[key] = str(peer.ref(value))
    return data


async def _events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of the peer's SSE events (pings and anything else skipped)."""
    async for sse in EventSource(resp).aiter_sse():
        try:
            data = jsonbound.loads(sse.data)
        except (ValueError, jsonbound.BoundError):
            continue
        if isinstance(data, dict):
            yield data


async def relay_run(
    c: Clients, ref: TraceRef, body: dict[str, str], stream: bool, heartbeat_s: float
) -> dict[str, Any] | EventSourceResponse:
    peer = c.peers.registry.resolve(ref, current_user())
    client = c.peers.http.of(peer)
    stack = contextlib.AsyncExitStack()
    # opened here, so that a refusal (404, 403, a peer down) is this request's HTTP error, not an event
    resp = await stack.enter_async_context(client.stream(client.trace_path(ref.id, "/run"), body))
    if stream:

        async def relayed() -> AsyncIterator[dict[str, str]]:
            try:
                async for data in _events(resp):
                    yield {"data": json.dumps(here(peer, data))}
            except (httpx.HTTPError, MeshError) as exc:
                message = f"peer {peer.alias!r} stopped answering mid-turn ({type(exc).__name__})"
                yield {"data": json.dumps({"type": "error", "code": "unavailable", "message": message})}
            finally:
                await stack.aclose()

        return EventSourceResponse(relayed(), ping=heartbeat_s)
    start: dict[str, Any] = {}
    parts: list[str] = []
    error: dict[str, Any] | None = None
    finished = False
    try:
        async for data in _events(resp):
            kind = data.get("type")
            if kind == "start":
                start = here(peer, data)
            elif kind == "text-delta":
                parts.append(str(data.get("textDelta", "")))
            elif kind == "error":
                error = {"code": data.get("code", ""), "message": data.get("message", "")}
            elif kind == "finish":
                finished = True
    except httpx.HTTPError as exc:
        raise Unavailable(
            f"peer {peer.alias!r} stopped answering mid-turn: the turn may or may not have completed there"
        ) from exc
    finally:
        await stack.aclose()
    if error is None and not finished:
        error = {"code": "unavailable", "message": f"peer {peer.alias!r} ended the turn's stream early"}
    return {
        "traceId": start.get("traceId") or str(peer.ref(ref.id)),
        "ok": error is None,
        "output": "".join(parts),
        "messageId": start.get("assistantMessageId", 0),
        "error": error,
    }
