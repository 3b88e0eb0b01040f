"""The run of a remote agent (docs/requirements.md#one-invoke-engine, docs/federation.md): what the model
loop is for an agent of ours, the call to the remote is for an agent of the catalog with a
`remote.cardUrl`, or a registered peer's `@alias/slug`. Its reply streams into the turn's buffer as
text deltas, and the turn is stored like any (docs/design/turns.md).

- An A2A agent (a catalog entry, or a peer's agent without a trace to continue) is called with the
  a2a-sdk client (a2a_client.py); its trace is at its home, `agent://host[:port]/<contextId>` (for a
  peer `@alias/<contextId>`).
- With `AGENTMESH_A2A__PUSH_RECEIVE` on, an agent whose card says `pushNotifications` is followed
  through push notifications to our gateway instead of a held stream (a2a_push.py).
- A peer's agent continuing a trace of that peer runs there: POST {peer}/api/traces/{id}/run, its
  SSE relayed into the turn's buffer.
"""

from __future__ import annotations

import os
import re
from typing import Any

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, jsonbound, telemetry
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, MeshError, from_event
from agentmesh.libs.identity import current_user
from agentmesh.libs.ids import SLUG_PATTERN, TraceRef
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime.a2a_client import RemoteAgent
from agentmesh.services.agent_runtime.a2a_push import PushInbox
from agentmesh.services.agent_runtime.sink import EventSink

REMOTE_TIMEOUT_S = 600.0  # per A2A request; the run's own deadline ends it sooner


def parse_peer_slug(slug: str) -> tuple[str, str] | None:
    """("alias", "slug") of a peer's agent `@alias/slug`; None for a slug of this mesh."""
    if not slug.startswith("@"):
        return None
    alias, sep, agent = slug[1:].partition("/")
    if not sep or not alias or not re.fullmatch(SLUG_PATTERN, agent):
        raise InvalidArgument(f"a peer's agent is named @alias/slug, not {slug!r}")
    return alias, agent


def credential(name: str) -> str:
    """The Bearer token a remote agent's `credentialEnv` names, read at call time from this process's
    environment: the variable itself, else the file `<name>_FILE` names (a mounted secret)."""
    if not name:
        return ""
    value = os.environ.get(name, "")
    if not value and os.environ.get(f"{name}_FILE"):
        try:
            with open(os.environ[f"{name}_FILE"], encoding="utf-8") as f:
                value = f.read().strip()
        except OSError:
            value = ""
    return value


class RemoteRuns:
    def __init__(self, clients: Clients) -> None:
        self.clients = clients

    async def run(self, req: rt.RunAgentRequest, sink: EventSink) -> rt.RunResult:
        peer = parse_peer_slug(req.agent.slug)
        try:
            if peer is not None and req.remote_context_id:
                return await self._relay(req, sink, *peer)
            return await self._a2a(req, sink, peer)
        except MeshError as err:
            if peer is not None:  # say which peer
                raise type(err)(f"{req.agent.slug}: {err.message}") from err
            raise

    async def _a2a(
        self, req: rt.RunAgentRequest, sink: EventSink, peer: tuple[str, str] | None
    ) -> rt.RunResult:
        agent = req.agent
        remote = RemoteAgent(
            agent.remote.card_url, credential(agent.remote.credential_env), timeout_s=REMOTE_TIMEOUT_S
        )
        settings = self.clients.settings
        if settings.a2a.push_receive:  # taken when its card says pushNotifications (docs/a2a.md)
            remote.push = PushInbox(self.clients, settings.push_receiver_url, remote.base)
        meta: dict[str, Any] = {"remoteUrl": agent.remote.card_url}

        def where(context_id: str) -> str:
            if peer is not None:
                return str(TraceRef(context_id, alias=peer[0]))
            return str(TraceRef(context_id, host=remote.host, port=int(remote.port or 0)))

        async def on_task(remote_task: str, remote_context: str) -> None:
            meta.update(remoteTaskId=remote_task, remoteContextId=remote_context)
            if remote_context:  # the caller announces the call with where it runs (invoke.py)
                await sink.store(_remote_started(where(remote_context), remote_task))

        with telemetry.span(f"remote-agent {agent.slug}", agent=agent.slug, url=agent.remote.card_url):
            card = await remote.resolve()
            meta["remoteAgent"] = card.name
            reply = await remote.call(
                req.input,
                on_text=lambda chunk: sink.emit(events.text_delta(chunk)),
                on_task=on_task,
                context_id=req.remote_context_id,
                depth=req.depth,
            )
        await sink.flush()
        context_id = str(meta.get("remoteContextId") or reply.context_id or "")
        ref = where(context_id) if context_id else ""
        result = rt.RunResult(
            content=reply.text,
            model=card.name,
            usage=ev.Usage(input_tokens=reply.input_tokens, output_tokens=reply.output_tokens),
            finish_reason=ev.FINISH_REASON_STOP,
            trace_ref=ref,
        )
        if reply.pushed:
            meta["remotePush"] = True
        result.metadata.CopyFrom(events.struct(meta))
        return result

    async def _relay(self, req: rt.RunAgentRequest, sink: EventSink, alias: str, slug: str) -> rt.RunResult:
        """Continues the peer's trace `remote_context_id` there (its /run, SSE): the text and the
        reasoning go into the turn's buffer as they arrive."""
        peers = self.clients.peers
        peer = peers.registry.resolve(TraceRef("x", alias=alias), current_user())
        client = peers.http.of(peer)
        target = req.remote_context_id
        path, body = client.trace_path(target, "/run"), {"input": req.input, "agent": slug}
        trace_id, parts = target, []
        async with client.stream(path, body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                try:
                    data = jsonbound.loads(line[5:])
                except (ValueError, jsonbound.BoundError):
                    continue
                if not isinstance(data, dict):
                    continue
                kind = data.get("type")
                if kind == "start":
                    trace_id = str(data.get("traceId") or data.get("sessionId") or trace_id)
                    TraceRef(trace_id)  # the peer's id must be a local id there (InvalidArgument otherwise)
                    await sink.store(_remote_started(str(peer.ref(trace_id))))
                elif kind == "text-delta":
                    parts.append(str(data.get("textDelta", "")))
                    sink.emit(events.text_delta(parts[-1]))
                elif kind == "reasoning-delta":
                    sink.emit(events.reasoning_delta(str(data.get("reasoningDelta", ""))))
                elif kind == "error":
                    failure = ev.StreamError(message=str(data.get("message", "")))
                    failure.code = _code(data.get("code"))  # type: ignore[assignment]
                    raise from_event(failure)
                elif kind == "done":
                    break
        await sink.flush()
        TraceRef(trace_id)  # the peer's id must be a local id there (InvalidArgument otherwise)
        return rt.RunResult(
            content="".join(parts), finish_reason=ev.FINISH_REASON_STOP, trace_ref=str(peer.ref(trace_id))
        )


def _remote_started(trace_ref: str, task_id: str = "") -> ev.Event:
    return ev.Event(remote_task_started=ev.RemoteTaskStarted(trace_id=trace_ref, task_id=task_id))


def _code(name: Any) -> int:
    try:
        return int(ev.ErrorCode.Value(f"ERROR_CODE_{str(name).upper()}"))
    except ValueError:
        return int(ev.ERROR_CODE_INTERNAL)
