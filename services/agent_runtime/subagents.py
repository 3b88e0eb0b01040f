"""Session subagents
(docs/requirements.md#session-subagents): delegate_task / delegate_parallel for the supervisor role only.

Each subagent gets a subagent_sessions row anchored to the turn's assistant placeholder
(`parentMessageId`), its own hidden session, and its live text on subagent:<id>. At most
`maxConcurrent` run at once; the rest wait `queued`. A failure or timeout touches only its own
subagent; the supervisor's model receives every result or error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf import field_mask_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.aio import to_the_end
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Cancelled, Internal, InvalidArgument, MeshError, as_mesh_error, rpc
from agentmesh.libs.ids import subagent_key
from agentmesh.libs.protojson import enum_to_str, to_json
from agentmesh.libs.tools import MAX_DELEGATE_TASKS
from agentmesh.libs.turns import turn_messages, turn_start
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime.children import ChildOutcome, close_buffer, run_child
from agentmesh.services.agent_runtime.tools import SUBAGENT, ToolContext, ToolOutcome, names
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import trace_pb2 as tp

MAX_TASKS = MAX_DELEGATE_TASKS

GUIDANCE = """

## You are a subagent
You are a subagent inside a chat session, working for the parent agent "{parent}".
- Complete only this goal: {goal}
- Never ask the user anything: you cannot talk to the user, and clarify is not available to you.
- Never delegate: you cannot create other subagents.
- Your final answer goes to the parent agent, not to the user: answer with a concise summary of the result."""


@dataclass
class _Plan:
    """One subagent to start: what the call asked, resolved against the agents and the config."""

    goal: str
    context: str
    source: int  # ev.SubagentSource
    agent: ap.Agent
    name: str
    tool_names: list[str] | None
    max_steps: int


async def _plan(ctx: ToolContext, task: Any) -> _Plan:
    """Resolves one task of a delegate call; InvalidArgument (naming the problem) when it cannot run."""
    cfg = ctx.agent.effective_subagent_config
    if not isinstance(task, dict):
        raise InvalidArgument("each task must be an object")
    goal = str(task.get("goal") or "").strip()
    context = str(task.get("context") or "")
    slug = str(task.get("agentSlug") or task.get("agentId") or "").strip()
    mode = str(task.get("mode") or ("preset" if slug else "clone"))
    rounds = task.get("maxToolRounds")
    max_steps = int(rounds) + 1 if isinstance(rounds, int) and rounds >= 0 else 0
    if not goal:
        raise InvalidArgument("goal is required")
    if mode == "clone":
        plan = _Plan(
            goal, context, ev.SUBAGENT_SOURCE_CLONE, ctx.agent, f"{ctx.agent.name} (clone)", None, max_steps
        )
    elif mode == "preset":
        allowed = names(cfg, "allowed_preset_agent_ids")
        agent = await ctx.agents.find(slug) if slug else None
        if agent is None:
            raise InvalidArgument(f"unknown preset agent {slug!r}")
        if allowed is not None and slug not in allowed:
            raise InvalidArgument(f"preset agent {slug!r} is not allowed for {ctx.agent.slug!r}")
        plan = _Plan(goal, context, ev.SUBAGENT_SOURCE_PRESET, agent, agent.name, None, max_steps)
    else:
        raise InvalidArgument(f"mode must be preset or clone, not {mode!r}")
    asked = task.get("toolNames")
    tools = [str(n) for n in asked] if isinstance(asked, list) else None
    allowed_tools = names(cfg, "allowed_tool_names")
    if allowed_tools is not None:
        tools = [n for n in (tools if tools is not None else allowed_tools) if n in allowed_tools]
    if tools is not None:
        tools = [n for n in tools if n not in cfg.blocked_tool_names]
    plan.tool_names = tools
    return plan


class RowWriter:
    """The changes of one batch's rows: one call in flight at a time, and whatever is asked for
    meanwhile goes in the next as one UpdateSubagentSessions (one transaction), so the rows of
    subagents that start or end together settle in a write or two, not one write after another. A
    call of several that fails is retried row by row: one row's failure stays its own."""

    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self._queue: list[tuple[sbs.UpdateSubagentSessionRequest, asyncio.Future[tp.SubagentSession]]] = []
        self._writer: asyncio.Task[None] | None = None

    async def update(self, request: sbs.UpdateSubagentSessionRequest) -> tp.SubagentSession:
        """The changed row (or the change's error). A caller cancelled meanwhile stops waiting; the
        change is still written."""
        fut: asyncio.Future[tp.SubagentSession] = asyncio.get_running_loop().create_future()
        self._queue.append((request, fut))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return await asyncio.shield(fut)

    async def _write(self) -> None:
        batch: list[tuple[sbs.UpdateSubagentSessionRequest, asyncio.Future[tp.SubagentSession]]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                for (_, fut), result in zip(batch, await self._send([r for r, _ in batch]), strict=True):
                    if isinstance(result, BaseException):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
        except BaseException as exc:  # never leave a caller waiting
            err = exc if isinstance(exc, Exception) else Cancelled("the write stopped")
            for _, fut in batch + self._queue:
                if not fut.done():
                    fut.set_exception(err)
            self._queue = []
            raise

    async def _send(
        self, requests: list[sbs.UpdateSubagentSessionRequest]
    ) -> list[tp.SubagentSession | MeshError]:
        stub = self.clients.subagents
        if len(requests) > 1:
            try:
                resp = await rpc(
                    stub.UpdateSubagentSessions(sbs.UpdateSubagentSessionsRequest(updates=requests))
                )
                return list(resp.subagents)
            except MeshError:
                pass  # all or none: each on its own, so that only the failing row fails

        async def one(request: sbs.UpdateSubagentSessionRequest) -> tp.SubagentSession | MeshError:
            try:
                return (await rpc(stub.UpdateSubagentSession(request))).subagent
            except MeshError as err:
                return err

        return list(await asyncio.gather(*(one(r) for r in requests)))


class SubagentBatch:
    """One delegate call: rows, events, concurrency, failure isolation, cancellation."""

    def __init__(self, ctx: ToolContext, plans: list[_Plan], title: str) -> None:
        self.ctx = ctx
        self.plans = plans
        self.title = title
        self.cfg = ctx.agent.effective_subagent_config
        self.rows: list[tp.SubagentSession] = []
        self.turns: list[ms.TurnMessages] = []  # each row's turn, stored with it
        self.outputs: list[dict[str, Any]] = []
        self.writer = RowWriter(ctx.clients)
        self._opened: set[int] = set()  # rows whose buffer may exist
        self._started: set[int] = set()  # rows whose turn went to the turn engine (it settles them)

    async def _update(self, i: int, paths: list[str], **values: Any) -> None:
        row = tp.SubagentSession(id=self.rows[i].id)
        for key, value in values.items():
            if isinstance(value, ev.Usage):
                getattr(row, key).CopyFrom(value)
            elif key == "result_payload":
                row.result_payload.CopyFrom(events.struct(value))
            else:
                setattr(row, key, value)
        self.rows[i] = await self.writer.update(
            sbs.UpdateSubagentSessionRequest(subagent=row, update_mask=field_mask_pb2.FieldMask(paths=paths))
        )
        self._emit_update(i)

    async def _create_buffers(self) -> None:
        """Every row's buffer, born with its turn's `start`, in one call (before anyone learns the
        rows: a reader of a card always finds its buffer)."""
        parent = str(self.ctx.anchor_message_id)
        requests = []
        for i, (row, turn) in enumerate(zip(self.rows, self.turns, strict=True)):
            self._opened.add(i)
            slug = self.plans[i].agent.slug
            start = turn_start(row.child_trace_id, turn.user_message.id, turn.assistant_message.id, slug)
            meta = {"agent": slug, "kind": "subagent", "parentMessageId": parent}
            requests.append(ss.CreateStreamRequest(key=subagent_key(row.id), metadata=meta, events=[start]))
        await rpc(self.ctx.clients.stream.BatchCreateStreams(ss.BatchCreateStreamsRequest(requests=requests)))

    def _emit_update(self, i: int) -> None:
        self.ctx.sink.emit(
            ev.Event(
                subagent_update=ev.SubagentUpdate(
                    parent_message_id=self.ctx.anchor_message_id, subagent=events.item_from_row(self.rows[i])
                )
            )
        )

    async def run(self) -> ToolOutcome:
        ctx = self.ctx
        started = time.monotonic()
        ctx.sink.emit(
            ev.Event(
                subagent_batch_start=ev.SubagentBatchStart(
                    parent_message_id=ctx.anchor_message_id,
                    title=self.title,
                    total=len(self.plans),
                    tool_call_id=ctx.tool_call_id,
                )
            )
        )
        ctx.state.subagent_batches[ctx.tool_call_id] = {}  # holds its place among the turn's batches
        resp = await rpc(
            ctx.clients.subagents.CreateSubagentSessions(
                sbs.CreateSubagentSessionsRequest(
                    subagents=[
                        tp.SubagentSession(
                            trace_id=ctx.trace_id,
                            parent_message_id=ctx.anchor_message_id,
                            parent_tool_call_id=ctx.tool_call_id,
                            parent_agent=ctx.agent.slug,
                            source_type=plan.source,  # type: ignore[arg-type]
                            preset_agent=plan.agent.slug if plan.source == ev.SUBAGENT_SOURCE_PRESET else "",
                            name=plan.name,
                            goal=plan.goal,
                            context=plan.context,
                            model=plan.agent.model,
                            tool_names=plan.tool_names or [],
                            sort_order=i,
                            batch_title=self.title,
                        )
                        for i, plan in enumerate(self.plans)
                    ],
                    turns=[self._turn(plan) for plan in self.plans],
                )
            )
        )
        self.rows, self.turns = list(resp.subagents), list(resp.turns)
        try:
            await self._create_buffers()
        except BaseException as exc:  # no row ran, and none will: each ends here (nothing leases them)
            cancelled = isinstance(exc, asyncio.CancelledError)
            err = Cancelled("cancelled before it ran") if cancelled else as_mesh_error(exc)
            await to_the_end(asyncio.gather(*(self._settle_unbegun(i, err) for i in range(len(self.rows)))))
            raise
        for i in range(len(self.rows)):
            self._emit_update(i)
        slots = asyncio.Semaphore(self.cfg.max_concurrent)
        tasks = [asyncio.create_task(self._one(i, slots)) for i in range(len(self.plans))]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await to_the_end(asyncio.gather(*tasks, return_exceptions=True))  # every row settled first
            raise
        finally:
            # The anchor's metadata.subagents: the same builder restores it from the rows.
            batch = events.build_batches(self.rows)
            ctx.state.subagent_batches[ctx.tool_call_id] = to_json(batch[0]) if batch else {}
        summary = events.summarize(r.status for r in self.rows)
        ctx.sink.emit(
            ev.Event(
                subagent_done=ev.SubagentDone(
                    parent_message_id=ctx.anchor_message_id, summary=summary, tool_call_id=ctx.tool_call_id
                )
            )
        )
        meta = {
            "durationMs": int((time.monotonic() - started) * 1000),
            "subagentIds": [r.id for r in self.rows],
            "parentMessageId": ctx.anchor_message_id,
        }
        counts = {
            "total": summary.total,
            "completed": summary.completed,
            "failed": summary.failed,
            "cancelled": summary.cancelled,
        }
        ok = summary.completed > 0
        return ToolOutcome({"ok": ok, "results": self.outputs, "summary": counts}, ok=ok, metadata=meta)

    def _turn(self, plan: _Plan) -> ms.TurnMessages:
        """A subagent's turn, stored with its row: the goal (and context) as the user message."""
        text = plan.goal if not plan.context else f"{plan.goal}\n\nContext:\n{plan.context}"
        user, placeholder = turn_messages(
            "",
            text,
            source=tp.MESSAGE_SOURCE_SUBAGENT,
            caller_agent=self.ctx.agent.slug,
            caller_session_id=self.ctx.trace_id,
            model=plan.agent.model,
        )
        return ms.TurnMessages(user_message=user, assistant_message=placeholder)

    async def _one(self, i: int, slots: asyncio.Semaphore) -> None:
        plan = self.plans[i]
        sub_id = self.rows[i].id
        out: dict[str, Any] = {"id": sub_id, "name": plan.name, "goal": plan.goal}
        self.outputs.append(out)
        placeholder = self.turns[i].assistant_message.id
        try:
            # queued or running: the row, its buffer and its placeholder
            with self.ctx.leases.hold(subagent=sub_id, stream=subagent_key(sub_id), message=placeholder):
                async with slots:
                    await self._execute(i, plan, out)
        except asyncio.CancelledError:
            out.update(status="cancelled", error="cancelled")
            # All of it, also when a second cancel comes meanwhile (the batch's gather cancels its
            # tasks, then the batch does, as the supervisor's turn is cancelled).
            await to_the_end(self._settle_cancelled(i))
            raise

    async def _settle_cancelled(self, i: int) -> None:
        """A row cancelled: a turn that never started ends here; a started one is settled by the turn
        engine, its RunTurn call cancelled."""
        if i not in self._started:
            await self._settle_unbegun(i, Cancelled("cancelled before it ran"))
        elif self.rows[i].status in (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING):
            with contextlib.suppress(MeshError):
                await self._update(
                    i, ["status", "error"], status=ev.SUBAGENT_STATUS_CANCELLED, error="cancelled"
                )

    async def _settle_unbegun(self, i: int, err: MeshError) -> None:
        """A row whose turn never went to the turn engine ends with `err`: its placeholder and its
        buffer first, then the row (whoever reads the row ended finds them settled)."""
        cancelled = isinstance(err, Cancelled)
        message = tp.Message(
            id=self.turns[i].assistant_message.id,
            status=tp.MESSAGE_STATUS_CANCELLED if cancelled else tp.MESSAGE_STATUS_FAILED,
        )
        message.metadata.update({"error": {"code": err.code_name, "message": err.message}})
        with contextlib.suppress(MeshError):
            await rpc(
                self.ctx.clients.messages.UpdateMessage(
                    ms.UpdateMessageRequest(
                        message=message, update_mask=field_mask_pb2.FieldMask(paths=["status", "metadata"])
                    )
                )
            )
        if i in self._opened:
            await close_buffer(self.ctx, subagent_key(self.rows[i].id), err)
        if self.rows[i].status in (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING):
            status = ev.SUBAGENT_STATUS_CANCELLED if cancelled else ev.SUBAGENT_STATUS_FAILED
            error = "cancelled" if cancelled else f"{err.code_name}: {err.message}"
            with contextlib.suppress(MeshError):
                await self._update(i, ["status", "error"], status=status, error=error)

    async def _execute(self, i: int, plan: _Plan, out: dict[str, Any]) -> None:
        row = self.rows[i]
        key = subagent_key(row.id)
        # The row turns running while the child's turn starts: its model request waits on no write
        # of the batch's bookkeeping.
        running = asyncio.create_task(self._update(i, ["status"], status=ev.SUBAGENT_STATUS_RUNNING))
        self._started.add(i)
        try:
            outcome = await self._run(plan, row, key, self.turns[i])
        except BaseException:
            with contextlib.suppress(MeshError):
                await to_the_end(running)  # settled before the caller marks the row cancelled
            raise
        await running  # its failure fails the batch, as when it ran first
        if outcome.ok:
            assert outcome.result is not None
            r = outcome.result
            await self._update(
                i,
                ["status", "summary", "result_payload", "token_usage", "model"],
                status=ev.SUBAGENT_STATUS_COMPLETED,
                summary=r.content,
                result_payload={
                    "content": r.content,
                    "finishReason": enum_to_str(ev.FinishReason.DESCRIPTOR, r.finish_reason),
                },
                token_usage=r.usage,
                model=r.model,
            )
            out.update(status="completed", summary=r.content)
        else:
            err = outcome.error or Internal("the subagent failed")
            cancelled = isinstance(err, Cancelled)
            status = ev.SUBAGENT_STATUS_CANCELLED if cancelled else ev.SUBAGENT_STATUS_FAILED
            message = f"{err.code_name}: {err.message}"
            await self._update(i, ["status", "error"], status=status, error=message)
            out.update(status="cancelled" if cancelled else "failed", error=message)

    async def _run(
        self, plan: _Plan, row: tp.SubagentSession, key: str, turn: ms.TurnMessages
    ) -> ChildOutcome:
        ctx = self.ctx
        prompt = plan.agent.system_prompt + GUIDANCE.format(parent=ctx.agent.name, goal=plan.goal)
        overrides = rt.RunOverrides(system_prompt=prompt, model=plan.agent.model, max_steps=plan.max_steps)
        if plan.tool_names is not None:
            overrides.tool_names.names.extend(plan.tool_names)
        return await run_child(
            ctx,
            orc.RunTurnRequest(
                trace_id=row.child_trace_id,
                agent=plan.agent.slug,
                user_text=turn.user_message.content,
                stream_key=key,
                stream_created=True,
                role=SUBAGENT,
                depth=ctx.depth,
                source=tp.MESSAGE_SOURCE_SUBAGENT,
                caller_agent=ctx.agent.slug,
                caller_session_id=ctx.trace_id,
                timeout_ms=min(self.cfg.timeout_ms, plan.agent.limits.timeout_ms),  # its own, only its own
                overrides=overrides,
                resolved_agent=plan.agent,  # read once for the batch
                empty_trace=True,  # the row's new hidden trace
                begun=turn,  # stored with the row, its `start` in the buffer
            ),
        )


async def _delegate(ctx: ToolContext, tasks: list[Any], title: str) -> ToolOutcome:
    if not ctx.agent.effective_subagent_config.enabled:
        return ToolOutcome.failed(InvalidArgument("subagents are disabled for this agent"))
    if not tasks or len(tasks) > MAX_TASKS:
        return ToolOutcome.failed(InvalidArgument(f"give between 1 and {MAX_TASKS} tasks"))
    plans, problems = [], []
    for i, task in enumerate(tasks):
        try:
            plans.append(await _plan(ctx, task))
        except MeshError as err:
            problems.append(f"task {i + 1}: {err.message}" if len(tasks) > 1 else err.message)
    if problems:  # fail fast: nothing is created for a batch that cannot run as asked
        return ToolOutcome.failed(InvalidArgument("; ".join(problems)))
    return await SubagentBatch(ctx, plans, title).run()


async def delegate_task(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    goal = str(args.get("goal") or "").strip()
    return await _delegate(ctx, [args], goal[:80] or "Subtask")


async def delegate_parallel(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    tasks = args.get("tasks")
    if not isinstance(tasks, list):
        return ToolOutcome.failed(InvalidArgument("tasks must be a list"))
    return await _delegate(ctx, tasks, f"{len(tasks)} parallel subtasks")
