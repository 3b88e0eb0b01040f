"""The start gate of a run started before its turn's messages were stored (RunAgentRequest.await_start).

The turn engine of a new chat session starts the run as soon as its buffer exists, while BeginTurn
stores the user message and the placeholder: the run calls the model at once, and its sink stores
nothing until the turn's `start` (appended by the turn engine once those rows are stored) is the
first event of the buffer. `start` names the placeholder, the anchor of the run's subagents. When
the buffer ends first (the turn failed to begin) or cannot be read, the gate fails and the run stores
nothing.
"""

from __future__ import annotations

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.stream.v1 import stream_service_pb2 as ss
from libs import events
from libs.clients import Clients
from libs.errors import Cancelled, FailedPrecondition, Interrupted, from_rpc_error
from libs.rpc import end_call_soon


async def wait_for_start(clients: Clients, key: str, timeout_s: float) -> ev.TurnStart:
    """The `start` event of `key`, once stored; raises when the buffer ends or shows anything else first."""
    request = ss.SubscribeStreamRequest(key=key, idle_timeout_ms=int(timeout_s * 1000))
    call = clients.stream.SubscribeStream(request, timeout=timeout_s)
    try:
        async for resp in call:
            if resp.event.HasField("start"):
                return resp.event.start
            if events.is_terminal(resp.event):
                raise Cancelled(f"{key} ended before its turn started")
            raise FailedPrecondition(f"{key} holds {events.kind(resp.event)} before its turn's start")
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc
    finally:
        end_call_soon(call)  # the run goes on at once
    raise Interrupted(f"{key} ended before its turn started")
