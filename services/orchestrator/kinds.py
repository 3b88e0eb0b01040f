"""The kinds of turn (docs/design/turns.md, "Kinds"): a RunTurnRequest resolved, by who asks, into the
Turn the engine runs — its trace, its agent as read now, its buffer, its role and its provenance —
and, for a task (an agent-invoke callee, an A2A task we serve), the task's row.

| caller | trace                                    | buffer          | role       | source |
|--------|------------------------------------------|-----------------|------------|--------|
| chat   | the one named (any kind of the user's), or a new chat | trace:<id> | supervisor | user |
| invoke | a new hidden one, or the callee trace it continues | a2a:<task id> | a2a callee | a2a |
| a2a    | a new hidden one, or the contextId it continues | a2a:<task id> | a2a callee | a2a |
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.libs import events
from agentmesh.libs.a2a import agent_url
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, NotFound, rpc
from agentmesh.libs.identity import current_user
from agentmesh.libs.ids import SLUG_PATTERN, TraceRef, a2a_key, is_local_id, new_id, trace_key
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.orchestrator.early import LastReads, runs_alone
from agentmesh.services.orchestrator.turns import Turn, limit
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

MAX_INPUT_CHARS = 100_000
TITLE_CHARS = 80


@dataclass
class Resolved:
    """A turn ready to begin, with its task row when it is a task."""

    turn: Turn
    task: tp.A2ATask | None = None


def _peer_slug(slug: str) -> tuple[str, str] | None:
    """("alias", "slug") of a peer's agent `@alias/slug`; None for a slug of this mesh."""
    if not slug.startswith("@"):
        return None
    alias, sep, agent = slug[1:].partition("/")
    if not sep or not alias or not re.fullmatch(SLUG_PATTERN, agent):
        raise InvalidArgument(f"a peer's agent is named @alias/slug, not {slug!r}")
    return alias, agent


def _authority(card_url: str) -> str:
    parts = urlsplit(card_url)
    return parts.netloc.lower()


class Kinds:
    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self.last_reads = LastReads()

    @property
    def _timeout_ms(self) -> int:
        return int(self.clients.settings.turn_timeout_s * 1000)

    async def resolve(self, req: orc.RunTurnRequest) -> Resolved:
        if not req.input.strip():
            raise InvalidArgument("input must not be empty")
        if len(req.input) > MAX_INPUT_CHARS:
            raise InvalidArgument(f"input is longer than {MAX_INPUT_CHARS} characters")
        which = req.WhichOneof("caller") or "chat"
        if which == "invoke":
            return await self._invoke(req)
        if which == "a2a":
            return await self._a2a(req)
        return await self._chat(req)

    async def agent(self, slug: str) -> ap.Agent:
        """The agent `slug` as the calling user reads it: theirs or built-in, or a registered peer's
        (`@alias/slug`: called over A2A with the peer's key)."""
        return await self.reading(slug)

    async def _get_agent(self, slug: str) -> ap.Agent:
        user = current_user()
        try:
            agent = (await rpc(self.clients.agents.GetAgent(ag.GetAgentRequest(slug=slug)))).agent
        except NotFound:
            self.last_reads.forget(user, slug)
            raise
        self.last_reads.put(user, slug, agent)
        return agent

    def reading(self, slug: str) -> asyncio.Future[ap.Agent]:
        """`agent(slug)` under way: a peer's agent is resolved at once (a malformed slug or an unset
        credential fails here, before anything is created), one of ours is read meanwhile."""
        peer_agent = _peer_slug(slug)
        if peer_agent is None:
            return asyncio.ensure_future(self._get_agent(slug))
        alias, name = peer_agent
        peer = self.clients.peers.registry.resolve(TraceRef("x", alias=alias), current_user())
        peer.api_key()
        resolved: asyncio.Future[ap.Agent] = asyncio.get_running_loop().create_future()
        resolved.set_result(
            ap.Agent(
                slug=slug,
                name=f"{name} ({alias})",
                remote=ap.RemoteAgent(card_url=agent_url(peer.url, name), credential_env=peer.credential),
            )
        )
        return resolved

    # --- chat ---------------------------------------------------------------------------------------

    async def _chat(self, req: orc.RunTurnRequest) -> Resolved:
        if not req.trace_id:
            if not req.agent:
                raise InvalidArgument("agent is required for a new trace")
            trace_id = new_id()
            title = req.input.strip()[:TITLE_CHARS]
            new_trace = tp.Trace(id=trace_id, agent=req.agent, kind=tp.TRACE_KIND_CHAT, title=title)
            return Resolved(self._chat_turn(req, trace_id, req.agent, new_trace))
        if not is_local_id(req.trace_id):
            raise InvalidArgument(
                "a peer's trace is continued at its home (its POST /api/traces/{id}/run), or by "
                "agent-invoke with continueFrom"
            )
        trace = (await rpc(self.clients.trace.GetTrace(ts.GetTraceRequest(trace_id=req.trace_id)))).trace
        if trace.home:  # our cached copy of a peer's trace takes no turn: it would fork the peer's trace
            raise InvalidArgument(
                f"{trace.home} lives on a peer: continue it there, or with agent-invoke continueFrom"
            )
        return Resolved(self._chat_turn(req, trace.id, req.agent or trace.agent, None))

    def _chat_turn(
        self, req: orc.RunTurnRequest, trace_id: str, slug: str, new_trace: tp.Trace | None
    ) -> Turn:
        # The agent is read while the turn begins: its rows and buffer need only its slug. A new chat
        # of an agent that runs alone may start its run with the agent as last read here meanwhile.
        last = self.last_reads.get(current_user(), slug) if new_trace is not None else None
        return Turn(
            trace_id=trace_id,
            agent=ap.Agent(slug=slug),
            agent_read=self.reading(slug),
            last_read=last if last is not None and runs_alone(last) else None,
            input=req.input,
            stream_key=trace_key(trace_id),
            role=rt.RUN_ROLE_SUPERVISOR,
            source=tp.MESSAGE_SOURCE_USER,
            limit_ms=limit(req.limits.timeout_ms, self._timeout_ms),
            overrides=rt.RunOverrides(max_output_tokens=req.limits.max_output_tokens),
            parent_sequence=req.parent_sequence if req.HasField("parent_sequence") else None,
            new_trace=new_trace,
            fresh_key=new_trace is not None,
            stream_metadata={"agent": slug, "kind": "chat"},
        )

    # --- tasks --------------------------------------------------------------------------------------

    async def _invoke(self, req: orc.RunTurnRequest) -> Resolved:
        caller = req.invoke
        if not req.agent:
            raise InvalidArgument("agent is required")
        agent = await self.agent(req.agent)
        continue_local, remote_context = "", ""
        if req.trace_id:
            continue_local, remote_context = self._continued(agent, req.trace_id)
        context = {
            "toolCallId": caller.tool_call_id,
            "depth": caller.depth,
            "anchorMessageId": caller.anchor_message_id,
        }
        if agent.HasField("remote"):
            context["remoteUrl"] = agent.remote.card_url
        row = tp.A2ATask(
            callee_agent=agent.slug,
            caller_agent=caller.agent,
            caller_trace_id=caller.trace_id,
            caller_context=events.struct(context),
        )
        task = await self._create_task(row, continue_local)
        turn = self._task_turn(req, task, agent, caller.depth)
        turn.caller_agent, turn.caller_trace_id = caller.agent, caller.trace_id
        turn.remote_context_id = remote_context
        return Resolved(turn, task)

    def _continued(self, agent: ap.Agent, trace_id: str) -> tuple[str, str]:
        """(the callee trace to continue, the remote conversation to continue) for an invoke that
        continues `trace_id`: for an agent of ours the trace itself, for a remote or a peer's agent
        the conversation at the remote's home."""
        ref = TraceRef.parse(trace_id)
        if not agent.HasField("remote"):
            # An agent of ours continues a trace here, or a peer's trace on our copy of it, the turn
            # sent home (the trace service's copies: docs/federation.md).
            return trace_id, ""
        peer_agent = _peer_slug(agent.slug)
        if peer_agent is not None:
            if (
                ref.is_local
                or self.clients.peers.registry.resolve(ref, current_user()).alias != peer_agent[0]
            ):
                raise InvalidArgument(
                    f"continueFrom {trace_id!r} is not a trace of peer {peer_agent[0]!r}: "
                    "a peer's agent continues that peer's traces"
                )
        elif ref.is_local or ref.authority != _authority(agent.remote.card_url):
            raise InvalidArgument(f"continueFrom {trace_id!r} is not a trace of {agent.slug!r}")
        return "", ref.id

    async def _a2a(self, req: orc.RunTurnRequest) -> Resolved:
        try:
            agent = await self.agent(req.agent) if req.agent else None
        except (NotFound, InvalidArgument):
            agent = None
        if agent is None or not agent.public or agent.HasField("remote"):
            raise NotFound(f"no public agent {req.agent!r}")
        context = {"via": "a2a", "messageId": req.a2a.message_id[:200]}
        row = tp.A2ATask(callee_agent=agent.slug, caller_context=events.struct(context))
        task = await self._create_task(row, req.trace_id)
        return Resolved(self._task_turn(req, task, agent, req.a2a.depth), task)

    async def _create_task(self, row: tp.A2ATask, continue_trace_id: str) -> tp.A2ATask:
        request = tks.CreateA2ATaskRequest(task=row, continue_trace_id=continue_trace_id)
        return (await rpc(self.clients.tasks.CreateA2ATask(request))).task

    def _task_turn(self, req: orc.RunTurnRequest, task: tp.A2ATask, agent: ap.Agent, depth: int) -> Turn:
        metadata = {"agent": agent.slug, "kind": "a2a", "taskId": task.id}
        if agent.model:
            metadata["model"] = agent.model
        return Turn(
            trace_id=task.trace_id,
            agent=agent,
            input=req.input,
            stream_key=a2a_key(task.id),
            role=rt.RUN_ROLE_A2A_CALLEE,
            source=tp.MESSAGE_SOURCE_A2A,
            task_id=task.id,
            depth=depth,
            limit_ms=limit(req.limits.timeout_ms, self._timeout_ms),
            overrides=rt.RunOverrides(model=agent.model, max_output_tokens=req.limits.max_output_tokens),
            fresh_key=True,
            stream_metadata=metadata,
        )
