"""agent-invoke of a peer's agent (docs/requirements.md#remote-agents): `agentSlug:
"@alias/slug"` names agent `slug` of the registered peer `alias` (only registered peers are called).

- without continueFrom: a new call over A2A, to `{peer url}/a2a/{slug}` with the peer's key
  (services/agent_runtime/a2a_client.py, through invoke.RemoteCallee);
- with continueFrom `@alias/id` (or `agent://...` of the same peer): the peer continues that trace
  there (POST /api/traces/{id}/run, SSE relayed into this call's own buffer `a2a:<task>`);

either way the caller's side panel follows the peer's agent live, and the tool returns the
location-bearing id of the peer's trace (`@alias/<id>`) with `remote: true`. (A continueFrom of a
peer's trace with one of OUR agents is not this: the trace service runs it on its cached copy and
sends the turn home.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.aio import to_the_end
from agentmesh.libs.errors import Cancelled, DeadlineExceeded, InvalidArgument, MeshError, from_event, rpc
from agentmesh.libs.identity import current_user
from agentmesh.libs.ids import SLUG_PATTERN, TraceRef, a2a_key
from agentmesh.libs.peer_http import PeerClient
from agentmesh.libs.peers import Peer
from agentmesh.services.agent_runtime.children import create_buffer, create_task, set_task_state, settle_task
from agentmesh.services.agent_runtime.tools import ToolContext
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)


def parse_remote_slug(slug: str) -> tuple[str, str] | None:
    """("alias", "slug") of `@alias/slug`; None for a local slug."""
    if not slug.startswith("@"):
        return None
    import re

    alias, sep, agent = slug[1:].partition("/")
    if not sep or not alias or not re.fullmatch(SLUG_PATTERN, agent):
        raise InvalidArgument(f"a peer's agent is named @alias/slug, not {slug!r}")
    return alias, agent


class PeerCallee:
    def __init__(self, peer: Peer, client: PeerClient, slug: str) -> None:
        self.peer, self.client, self.slug = peer, client, slug

    @property
    def name(self) -> str:
        return f"@{self.peer.alias}/{self.slug}"

    async def run(self, ctx: ToolContext, text: str, continue_from: str, depth: int) -> Any:
        from agentmesh.services.agent_runtime.invoke import InvokeResult

        if not continue_from:
            return await self._over_a2a(ctx, text, depth)
        ref = TraceRef.parse(continue_from)
        peers = ctx.clients.peers.registry
        if ref.is_local or peers.resolve(ref, current_user()).alias != self.peer.alias:
            raise InvalidArgument(
                f"continueFrom {continue_from!r} is not a trace of peer {self.peer.alias!r}: "
                "a peer's agent continues that peer's traces"
            )
        target = ref.id
        task = await create_task(ctx, self.name, depth)
        key = a2a_key(task.id)
        with ctx.leases.hold(task=task.id, stream=key):
            try:
                await create_buffer(ctx, key, {"agent": self.name, "kind": "a2a", "taskId": task.id})
                await ctx.sink.store(
                    ev.Event(
                        a2a_task_started=ev.A2ATaskStarted(
                            task_id=task.id,
                            callee_agent_slug=self.name,
                            callee_agent_name=f"{self.slug} ({self.peer.alias})",
                            tool_call_id=ctx.tool_call_id,
                            trace_id=str(self.peer.ref(target)) if target else "",
                        )
                    )
                )
                await set_task_state(ctx, task.id, tp.TASK_STATE_WORKING)
                timeout_s = ctx.agent.invoke.timeout_ms / 1000 if ctx.agent.invoke.timeout_ms else None
                async with asyncio.timeout(timeout_s):
                    trace_id, output, failure = await self._relay(ctx, key, text, target)
            except TimeoutError:
                err: MeshError = DeadlineExceeded(f"{self.name} did not finish in time")
                await to_the_end(settle_task(ctx, key, task.id, err))
                return InvokeResult("", False, task.id, "", error=err, remote=True)
            except asyncio.CancelledError:
                await to_the_end(settle_task(ctx, key, task.id, Cancelled("the call was cancelled")))
                raise
            except MeshError as err:
                await to_the_end(settle_task(ctx, key, task.id, err))
                return InvokeResult("", False, task.id, "", error=err, remote=True)
        home = str(self.peer.ref(trace_id)) if trace_id else ""
        if failure is None:
            await rpc(ctx.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone())))
            await set_task_state(ctx, task.id, tp.TASK_STATE_COMPLETED)
            return InvokeResult(output, True, task.id, home, remote=True)
        await to_the_end(settle_task(ctx, key, task.id, failure))
        return InvokeResult(output, False, task.id, home, error=failure, remote=True)

    async def _over_a2a(self, ctx: ToolContext, text: str, depth: int) -> Any:
        """A new call: the peer's agent over A2A (`{url}/a2a/{slug}`, the peer's key as the Bearer
        token), through the A2A client's RemoteCallee: live into our buffer, our copy of the exchange
        (localTraceId); the id handed out is the peer's trace in the short form, @alias/<contextId>."""
        from agentmesh.agents.v1 import agent_pb2 as ap
        from agentmesh.services.agent_runtime.a2a_client import agent_url
        from agentmesh.services.agent_runtime.invoke import RemoteCallee

        self.peer.api_key()  # an unset credential variable fails here, before anything is created
        agent = ap.Agent(
            slug=self.name,
            name=f"{self.slug} ({self.peer.alias})",
            remote=ap.RemoteAgent(
                card_url=agent_url(self.peer.url, self.slug), credential_env=self.peer.credential
            ),
        )
        result = await RemoteCallee(agent).run(ctx, text, "", depth)
        if result.trace_id:
            result.trace_id = str(self.peer.ref(TraceRef.parse(result.trace_id).id))
        if result.error is not None:  # say which peer
            result.error = type(result.error)(f"{self.name}: {result.error.message}")
        result.remote = True
        return result

    async def _relay(
        self, ctx: ToolContext, key: str, text: str, target: str
    ) -> tuple[str, str, MeshError | None]:
        """Continues the peer's trace `target` there (its /run, SSE); the text and reasoning go into our
        buffer as they arrive. (trace id at the peer, the output, the failure or None)."""
        path, body = self.client.trace_path(target, "/run"), {"input": text, "agent": self.slug}
        trace_id, parts, failure = target, [], None
        async with self.client.stream(path, body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                try:
                    data = json.loads(line[5:])
                except ValueError:
                    continue
                kind = data.get("type")
                out: ev.Event | None = None
                if kind == "start":
                    trace_id = str(data.get("sessionId") or trace_id)
                elif kind == "text-delta":
                    parts.append(str(data.get("textDelta", "")))
                    out = events.text_delta(str(data.get("textDelta", "")))
                elif kind == "reasoning-delta":
                    out = events.reasoning_delta(str(data.get("reasoningDelta", "")))
                elif kind == "error":
                    stream_error = ev.StreamError(message=str(data.get("message", "")))
                    stream_error.code = _code(data.get("code"))  # type: ignore[assignment]
                    failure = from_event(stream_error)
                    failure = type(failure)(f"{self.name}: {failure.message}")
                    break
                elif kind == "done":
                    break
                if out is not None:
                    await rpc(ctx.clients.stream.AppendEvents(ss.AppendEventsRequest(key=key, events=[out])))
        if trace_id:
            TraceRef(trace_id)  # the peer's id must be a local id there (InvalidArgument otherwise)
        return trace_id, "".join(parts), failure


def _code(name: Any) -> int:
    try:
        return int(ev.ErrorCode.Value(f"ERROR_CODE_{str(name).upper()}"))
    except ValueError:
        return int(ev.ERROR_CODE_INTERNAL)
