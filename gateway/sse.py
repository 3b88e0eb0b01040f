"""Server-Sent Events over the stream service's follows (libs/streams/), shared by every streaming route.

Each SSE message carries `id: <offset>`, so a browser resumes with `Last-Event-ID` (or `?lastEventId=`)
and gets exactly the events after it. A subscription ends after the terminal event (`done` or `error`),
and at once when the client goes away (sse-starlette cancels the generator, whose `finally` cancels the
follow, so the stream service lets go too).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.params import OFFSET_PATTERN
from agentmesh.libs import events
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import Interrupted, InvalidArgument, MeshError, NotFound
from agentmesh.libs.ids import shown
from agentmesh.libs.streams.follower import Follow, FollowCancelled
from agentmesh.stream.v1 import stream_service_pb2 as pb

NO_BUFFER = {"active": False, "reason": "no-buffer"}
_OFFSET = re.compile(OFFSET_PATTERN)  # ASCII digits only (str.isdigit() also takes "²"), as documented


def resume_offset(request: Request) -> str:
    """The offset to resume after: the `Last-Event-ID` header, else `?lastEventId=`, else "".

    InvalidArgument (a 422 before any subscription) unless it has the shape of an offset of either
    backend: 1-20 ASCII digits, optionally `-` and 1-20 more, each part at most 2^64-1 (the pattern the
    OpenAPI document states, gateway/params.py).
    """
    offset = request.headers.get("last-event-id") or request.query_params.get("lastEventId") or ""
    if not _OFFSET.fullmatch(offset):
        raise InvalidArgument(
            f"invalid Last-Event-ID offset {shown(offset, 40)}: expected an event id like 1700000000000-0"
        )
    return offset.strip(" \t")


def drain_options(settings: MeshSettings) -> dict[str, Any]:
    """sse-starlette's own shutdown handling, told to wait for our farewell instead of cutting the stream."""
    return {"shutdown_event": anyio.Event(), "shutdown_grace_period": max(settings.shutdown_grace_s / 2, 1.0)}


def sse_message(event: ev.Event) -> bytes:
    """One SSE message as written: `id: <offset>` (none for an event outside the buffer) and `data:
    <json>`, with sse-starlette's line separator. Encoded once, here: EventSourceResponse writes bytes
    as they are, and compact JSON has no line break to split into more `data:` lines."""
    data = orjson.dumps(events.to_dict(event))
    if event.offset:
        return b"id: " + event.offset.encode() + b"\r\ndata: " + data + b"\r\n\r\n"
    return b"data: " + data + b"\r\n\r\n"


def subscribe(clients: Clients, key: str, from_offset: str, idle_timeout_ms: int = 0) -> Follow:
    """The follow `follow` reads (started now: a caller may start it before it reads)."""
    return clients.follows.follow(key, from_offset, idle_timeout_ms)


async def follow(
    clients: Clients,
    key: str,
    from_offset: str,
    idle_timeout_ms: int = 0,
    drain: Drain | None = None,
    interrupt: asyncio.Future[ev.Event] | None = None,
    started: Follow | None = None,
) -> AsyncIterator[ev.Event]:
    """Yields the events of `key` after `from_offset`, replay then live, up to the terminal one.

    A stream service that went away is followed again from the last offset by the follow itself
    (docs/design/streams.md#reconnects); any other failure is yielded as a final `error` event (code =
    the lowercase reason); the gateway's shutdown ends it with `shutdown`; `interrupt`, once it has a
    result, ends it with that event (the turn's end as its orchestrator reported it, when the buffer
    will not tell). `started`: the follow, made by `subscribe(clients, key, from_offset,
    idle_timeout_ms)` before the caller began reading.
    """
    handle = started or subscribe(clients, key, from_offset, idle_timeout_ms)
    drain = drain or Drain()
    if interrupt is not None:
        interrupt.add_done_callback(lambda _: handle.cancel())
    try:
        with drain.cancels(handle):
            async for event in handle:
                yield event
    except MeshError as err:
        if interrupt is not None and interrupt.done():
            yield interrupt.result()
        elif isinstance(err, FollowCancelled) and drain.draining:
            yield events.error(drain.farewell())
        elif from_offset and isinstance(err, NotFound):
            # The buffer this reader followed before is gone (with the in-memory stream service that
            # held it, restarted; or a newer buffer of the key replaced it): the live stream is lost,
            # the turn's stored reply is not.
            yield events.error(
                Interrupted(
                    f"the stream {shown(key)} this reader followed is gone (its stream service restarted, "
                    "or a newer turn replaced it); what was stored is in the history"
                )
            )
        else:
            yield events.error(err)
    finally:
        handle.cancel()


async def sse_events(
    clients: Clients, key: str, from_offset: str, idle_timeout_ms: int = 0, drain: Drain | None = None
) -> AsyncIterator[bytes]:
    """`follow` as SSE items."""
    async for event in follow(clients, key, from_offset, idle_timeout_ms, drain):
        yield sse_message(event)


async def stream_response(
    request: Request,
    clients: Clients,
    settings: MeshSettings,
    key: str,
    owns: Callable[[], Awaitable[bool]] | None = None,
) -> Response:
    """The SSE response for one buffer of the calling user (the stream service checks the identity).

    With no buffer: `{"active": false, "reason": "no-buffer"}` when `owns()` confirms the user owns
    the resource behind the key, else 404, so an id of somebody else's reads exactly like a missing one.
    """
    from_offset = resume_offset(request)
    info = await clients.stream.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    if not info.exists:
        if owns is not None and await owns():
            return JSONResponse(NO_BUFFER)
        raise NotFound(f"no stream {key}")
    drain: Drain = request.app.state.drain
    return EventSourceResponse(
        sse_events(clients, key, from_offset, drain=drain),
        ping=settings.stream.heartbeat_s,
        headers={"X-Stream-Resume": "true"},
        **drain_options(settings),
    )
