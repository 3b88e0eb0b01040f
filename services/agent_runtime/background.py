"""Background subagents (docs/agents.md#background-subagents): the tools a supervisor follows its
background children with, and the note its next turn gets when one of them ended.

A background child is a subagent like any other (a row, a hidden trace, a buffer subagent:<id>, a turn
the orchestrator runs and settles); only its supervisor's delegate call did not wait for it. Its row is
its handle: these tools read rows (SubagentService), follow buffers (StreamService) and stop a child
through its turn's owner (OrchestratorService.CancelTurn), as the supervisor's user. Nothing here holds
state, so a handle answers on any runtime replica, before and after a restart of any service.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from google.protobuf.struct_pb2 import Value

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, MeshError, NotFound, rpc
from agentmesh.libs.ids import subagent_key
from agentmesh.libs.protojson import enum_to_str
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.services.agent_runtime.tools import ToolContext, ToolOutcome
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import trace_pb2 as tp

FINAL = (ev.SUBAGENT_STATUS_COMPLETED, ev.SUBAGENT_STATUS_FAILED, ev.SUBAGENT_STATUS_CANCELLED)
WAIT_DEFAULT_MS = 30_000
WAIT_MAX_MS = 600_000
STOP_SETTLE_MS = 10_000  # how long subagent_stop waits for what it stopped to be settled
LATEST_WITHIN_S = 2.0  # reading a running child's text so far
LATEST_CHARS = 2000  # the tail of it the model is shown
SETTLE_POLL_S = 0.1  # a row is settled just after its buffer ends (docs/design/turns.md)
NOTE_HEAD = "Background subagents that ended since you last heard of them:"
NOTE_KEY, SEEN_KEY = "backgroundNote", "backgroundSeen"  # in an assistant message's metadata


async def _children(clients: Clients, trace_id: str, which: str = "") -> list[tp.SubagentSession]:
    """The background children of the trace (only `which`, when given: NotFound when it is none)."""
    listed = await rpc(
        clients.subagents.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=trace_id))
    )
    rows = [r for r in listed.subagents if r.background and (not which or r.id == which)]
    if which and not rows:
        raise NotFound(f"no background subagent {which!r} in this chat")
    return rows


def _status(row: tp.SubagentSession) -> str:
    return enum_to_str(ev.SubagentStatus.DESCRIPTOR, row.status)


def describe(row: tp.SubagentSession, latest: str | None = None) -> dict[str, Any]:
    """What the supervisor's model reads of one background child."""
    out: dict[str, Any] = {
        "id": row.id,
        "traceId": row.child_trace_id,
        "name": row.name,
        "status": _status(row),
    }
    out["goal"] = row.goal
    if row.summary:
        out["summary"] = row.summary
    if row.error:
        out["error"] = row.error
    if latest:
        out["latest"] = latest
    return out


async def _latest(clients: Clients, key: str) -> str:
    """The text a running child streamed so far (its tail), read up to the buffer's last event now."""
    try:
        info = await rpc(clients.stream.GetStreamInfo(ss.GetStreamInfoRequest(key=key)))
    except MeshError:
        return ""
    if not info.exists or not info.last_offset:
        return ""
    text: list[str] = []
    follow = clients.follows.follow(key, "", int(LATEST_WITHIN_S * 1000))
    try:
        async with asyncio.timeout(LATEST_WITHIN_S):
            async for event in follow:
                if event.HasField("text_delta"):
                    text.append(event.text_delta.text_delta)
                if event.offset == info.last_offset or events.is_terminal(event):
                    break
    except (MeshError, TimeoutError):
        pass
    finally:
        follow.cancel()
    return "".join(text)[-LATEST_CHARS:]


async def _ended(clients: Clients, key: str) -> None:
    """Returns once buffer `key` has ended (or cannot be followed: the rows decide then)."""
    follow = clients.follows.follow(key, "", WAIT_MAX_MS, terminal_only=True)
    try:
        async for event in follow:
            if events.is_terminal(event):
                return
    except MeshError:
        return
    finally:
        follow.cancel()


async def _settled(clients: Clients, trace_id: str, which: str, timeout_ms: int) -> list[tp.SubagentSession]:
    """The children (one or all) once every one has ended, or as they are when `timeout_ms` passes."""
    rows = await _children(clients, trace_id, which)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_ms / 1000):
            await asyncio.gather(
                *(_ended(clients, subagent_key(r.id)) for r in rows if r.status not in FINAL)
            )
            while any(r.status not in FINAL for r in rows):  # the row settles right after its buffer
                await asyncio.sleep(SETTLE_POLL_S)
                rows = await _children(clients, trace_id, which)
    return rows


def _seen(ctx: ToolContext, rows: list[tp.SubagentSession]) -> None:
    """The model learned how these ended: no note will tell it again."""
    ctx.state.background_seen.update(r.id for r in rows if r.status in FINAL)


def _which(args: dict[str, Any]) -> str:
    which = args.get("id", "")
    if not isinstance(which, str):
        raise InvalidArgument("id must be a string")
    return which.strip()


async def subagent_status(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    rows = await _children(ctx.clients, ctx.trace_id, _which(args))

    async def latest(row: tp.SubagentSession) -> str:
        return "" if row.status in FINAL else await _latest(ctx.clients, subagent_key(row.id))

    texts = await asyncio.gather(*(latest(r) for r in rows))
    _seen(ctx, rows)
    return ToolOutcome({"ok": True, "subagents": [describe(r, t) for r, t in zip(rows, texts, strict=True)]})


async def subagent_wait(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    which = _which(args)
    timeout_ms = args.get("timeoutMs", WAIT_DEFAULT_MS)
    if not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or not 0 <= timeout_ms <= WAIT_MAX_MS:
        raise InvalidArgument(f"timeoutMs must be an integer from 0 to {WAIT_MAX_MS}")
    rows = await _settled(ctx.clients, ctx.trace_id, which, timeout_ms)
    _seen(ctx, rows)
    ended = all(r.status in FINAL for r in rows)
    return ToolOutcome({"ok": True, "ended": ended, "subagents": [describe(r) for r in rows]})


async def subagent_stop(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    which = _which(args)
    running = [r for r in await _children(ctx.clients, ctx.trace_id, which) if r.status not in FINAL]
    await asyncio.gather(
        *(rpc(ctx.clients.orchestrator.CancelTurn(orc.CancelTurnRequest(subagent_id=r.id))) for r in running)
    )
    rows = await _settled(ctx.clients, ctx.trace_id, which, STOP_SETTLE_MS)
    _seen(ctx, rows)
    out = {"ok": True, "stopped": [r.id for r in running], "subagents": [describe(r) for r in rows]}
    return ToolOutcome(out)


# --- the note -------------------------------------------------------------------------------------


def _listed(message: tp.Message, key: str) -> list[Value]:
    """The items of the list `key` of a message's metadata, read in place (every supervisor turn reads
    its whole history here: no conversion of each message's metadata)."""
    if not message.HasField("metadata"):
        return []
    value = message.metadata.fields.get(key)
    return list(value.list_value.values) if value is not None and value.HasField("list_value") else []


def delegated_in_background(messages: list[tp.Message]) -> bool:
    """Whether a turn of this history started a background child (else there is none to tell of)."""
    for m in messages:
        for call in _listed(m, "toolCalls"):
            output = call.struct_value.fields.get("output")
            flag = output.struct_value.fields.get("background") if output is not None else None
            if flag is not None and flag.HasField("bool_value") and flag.bool_value:
                return True
    return False


async def note(clients: Clients, trace_id: str, history: list[tp.Message]) -> tuple[str, list[str]]:
    """The system note of a supervisor's turn: the background children of its trace that ended and that
    no earlier turn of its history was told of (by a note, or by a tool that saw them end); with their
    ids. ("", []) when there are none."""
    if not delegated_in_background(history):
        return "", []
    seen = {v.string_value for m in history for v in _listed(m, SEEN_KEY)}
    rows = [r for r in await _children(clients, trace_id) if r.status in FINAL and r.id not in seen]
    if not rows:
        return "", []
    lines = [NOTE_HEAD]
    for r in rows:
        result = r.summary if r.status == ev.SUBAGENT_STATUS_COMPLETED else (r.error or r.summary)
        lines.append(f"- {r.name} (id {r.id}, traceId {r.child_trace_id}) {_status(r)}: {result}")
    return "\n".join(lines), [r.id for r in rows]
