"""One agent run: the model loop with tools, over a trace's main path, streaming into a sink."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from google.protobuf import json_format

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, telemetry
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import DeadlineExceeded, InvalidArgument, MeshError, PermissionDenied, rpc
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import RuntimeMetrics
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime import background
from agentmesh.services.agent_runtime.directory import AgentDirectory
from agentmesh.services.agent_runtime.llm import LLM, ToolCall
from agentmesh.services.agent_runtime.remotes import RemoteRuns
from agentmesh.services.agent_runtime.sink import EventSink
from agentmesh.services.agent_runtime.tools import RunState, ToolContext, ToolOutcome, ToolRegistry
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)
HISTORY_LIMIT = 1000
DEADLINE_MARGIN_S = 0.5  # a run ends this long before its call's deadline, so that it can say why


def history_to_openai(messages: list[tp.Message]) -> list[dict[str, Any]]:
    """Stored messages -> Chat Completions messages; an assistant message's metadata.toolCalls
    becomes assistant tool_calls + tool results before its final text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == tp.MESSAGE_ROLE_USER:
            out.append({"role": "user", "content": m.content})
        elif m.role == tp.MESSAGE_ROLE_SYSTEM:
            out.append({"role": "system", "content": m.content})
        elif m.role == tp.MESSAGE_ROLE_ASSISTANT:
            meta = json_format.MessageToDict(m.metadata) if m.HasField("metadata") else {}
            if isinstance(meta.get(background.NOTE_KEY), str):  # what the turn was told, after its input
                out.append({"role": "system", "content": meta[background.NOTE_KEY]})
            calls = meta.get("toolCalls") or []
            steps: dict[int, list[dict[str, Any]]] = {}
            for call in calls:
                steps.setdefault(int(call.get("step", 0)), []).append(call)
            for step in sorted(steps):
                group = steps[step]
                out.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": c["id"],
                                "type": "function",
                                "function": {"name": c["name"], "arguments": json.dumps(c.get("input", {}))},
                            }
                            for c in group
                        ],
                    }
                )
                for c in group:
                    out.append(
                        {"role": "tool", "tool_call_id": c["id"], "content": tool_text(c.get("output"))}
                    )
            if m.content:
                out.append({"role": "assistant", "content": m.content})
    return out


def role_name(role: int) -> str:
    """supervisor, subagent, a2a_callee (a metric label; unset is the supervisor)."""
    try:
        return rt.RunRole.Name(role or rt.RUN_ROLE_SUPERVISOR).removeprefix("RUN_ROLE_").lower()  # type: ignore[arg-type]
    except ValueError:
        return "unknown"


def tool_text(output: Any) -> str:
    return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)


class AgentRunner:
    def __init__(
        self,
        settings: MeshSettings,
        clients: Clients,
        llm: LLM,
        registry: ToolRegistry,
        leases: LeaseKeeper,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.llm = llm
        self.registry = registry
        self.leases = leases
        self.metrics = metrics or llm.metrics
        self.remotes = RemoteRuns(clients)

    async def history(self, req: rt.RunAgentRequest, state: RunState | None = None) -> list[dict[str, Any]]:
        """The trace's main path up to `history_head_sequence`, then the turn's input: at most
        HISTORY_LIMIT messages, the newest. A supervisor's turn (given its `state`) then gets the
        system note of its background children that ended unseen (background.py)."""
        messages: list[tp.Message] = []
        if req.trace_id and req.history_head_sequence and HISTORY_LIMIT > 1:
            limit = HISTORY_LIMIT - 1
            request = ms.ListMessagesRequest(
                trace_id=req.trace_id,
                mode=ms.PATH_MODE_MAIN_PATH,
                head_sequence=req.history_head_sequence,
                limit=limit,
            )
            resp = await rpc(self.clients.messages.ListMessages(request))
            if resp.total > len(resp.messages):  # a long trace: the model gets its newest messages
                request.offset = resp.total - limit
                resp = await rpc(self.clients.messages.ListMessages(request))
            messages = list(resp.messages)
        note, seen = "", list[str]()
        if state is not None and messages:
            note, seen = await background.note(self.clients, req.trace_id, messages)
        messages.append(tp.Message(role=tp.MESSAGE_ROLE_USER, content=req.input))
        out = history_to_openai(messages)
        if note and state is not None:
            out.append({"role": "system", "content": note})
            state.background_note = note
            state.background_seen.update(seen)
        return out

    async def run(
        self, req: rt.RunAgentRequest, sink: EventSink, time_left_s: float | None = None
    ) -> rt.RunResult:
        """The run, within the call's deadline (`time_left_s`; it ends a moment before, so that it says
        why) or else the agent's own limit."""
        role = role_name(req.role)
        outcome = "internal"
        self.metrics.running.inc()
        slug = req.agent.slug
        with telemetry.span(f"run {slug}", agent=slug, role=role, trace_id=req.trace_id) as span:
            try:
                result = await self._run(req, sink, time_left_s)
                outcome = "ok"
                return result
            except MeshError as err:
                outcome = err.code_name
                raise
            except asyncio.CancelledError:
                outcome = "cancelled"
                raise
            finally:
                self.metrics.running.dec()
                self.metrics.runs.labels(role, outcome).inc()
                if outcome != "ok":
                    telemetry.fail(span, outcome)

    async def _run(self, req: rt.RunAgentRequest, sink: EventSink, time_left_s: float | None) -> rt.RunResult:
        if req.depth < 0:
            raise InvalidArgument("depth must not be negative")
        agent = req.agent
        limit_s = agent.limits.timeout_ms / 1000 if agent.limits.timeout_ms else None
        if time_left_s is not None:
            limit_s = max(0.0, time_left_s - DEADLINE_MARGIN_S)
        try:
            async with asyncio.timeout(limit_s):
                if agent.HasField("remote"):
                    return await self.remotes.run(req, sink)
                agents = AgentDirectory(self.clients)
                agents.remember(agent)
                role = req.role or rt.RUN_ROLE_SUPERVISOR
                state = RunState()
                history = await self.history(req, state if role == rt.RUN_ROLE_SUPERVISOR else None)
                return await self._loop(req, agent, role, sink, agents, history, state)
        except TimeoutError as exc:
            shown = int((limit_s or 0) * 1000 + (DEADLINE_MARGIN_S * 1000 if time_left_s else 0))
            raise DeadlineExceeded(f"agent {agent.slug} did not finish within {shown} ms") from exc

    async def _loop(
        self,
        req: rt.RunAgentRequest,
        agent: ap.Agent,
        role: int,
        sink: EventSink,
        agents: AgentDirectory,
        history: list[dict[str, Any]],
        state: RunState,
    ) -> rt.RunResult:
        o = req.overrides
        allow = list(o.tool_names.names) if o.HasField("tool_names") else None
        tools = self.registry.resolve(agent, role, allow)
        schemas = self.registry.schemas(list(tools))
        model = o.model or agent.model
        max_tokens = o.max_output_tokens or agent.limits.max_output_tokens
        max_steps = o.max_steps or agent.limits.max_steps
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": o.system_prompt or agent.system_prompt},
            *history,
        ]
        content, thinking, finish = "", "", int(ev.FINISH_REASON_STOP)
        used_in = used_out = 0
        tool_records: list[dict[str, Any]] = []
        for step_no in range(max_steps):
            step = await self.llm.step(
                model=model,
                messages=messages,
                tools=schemas,
                max_tokens=max_tokens,
                on_text=lambda t: sink.emit(events.text_delta(t)),
                on_reasoning=lambda t: sink.emit(events.reasoning_delta(t)),
            )
            if sink.failure is not None:
                raise sink.failure
            used_in += step.input_tokens
            used_out += step.output_tokens
            model = step.model or model
            content += step.content
            thinking += step.reasoning
            finish = step.finish_reason
            if not step.tool_calls:
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": step.content or None,
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in step.tool_calls
                    ],
                }
            )
            outcomes = await asyncio.gather(
                *(
                    self._call_tool(req, agent, role, call, tools, sink, state, agents)
                    for call in step.tool_calls
                )
            )
            stop = False
            for call, (args, outcome) in zip(step.tool_calls, outcomes, strict=True):
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": tool_text(outcome.output)}
                )
                tool_records.append(
                    {
                        "id": call.id,
                        "name": call.name,
                        "input": args,
                        "output": outcome.output,
                        "ok": outcome.ok,
                        "metadata": outcome.metadata,
                        "step": step_no,
                    }
                )
                stop = stop or outcome.stop_run
            if stop:
                finish = ev.FINISH_REASON_TOOL_STOP
                break
        else:
            finish = ev.FINISH_REASON_MAX_STEPS
        await sink.flush()
        # Which version of the agent produced the reply (agents change while the mesh runs).
        metadata: dict[str, Any] = {"agentVersion": agent.version} if agent.version else {}
        if tool_records:
            metadata["toolCalls"] = tool_records
        if state.subagent_batches:
            metadata["subagents"] = [b for b in state.subagent_batches.values() if b]
        if state.background_note:
            metadata[background.NOTE_KEY] = state.background_note
        if state.background_seen:
            metadata[background.SEEN_KEY] = sorted(state.background_seen)
        result = rt.RunResult(
            content=content,
            thinking=thinking,
            model=model,
            usage=ev.Usage(input_tokens=used_in, output_tokens=used_out),
            finish_reason=finish,  # type: ignore[arg-type]
        )
        result.metadata.CopyFrom(events.struct(metadata))
        return result

    async def _call_tool(
        self,
        req: rt.RunAgentRequest,
        agent: ap.Agent,
        role: int,
        call: ToolCall,
        tools: dict[str, Any],
        sink: EventSink,
        state: RunState,
        agents: AgentDirectory,
    ) -> tuple[Any, ToolOutcome]:
        try:
            args = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            args = {"_raw": call.arguments}
        sink.emit(
            ev.Event(
                tool_input_available=ev.ToolInputAvailable(
                    tool_call_id=call.id, tool_name=call.name, input=events.value(args)
                )
            )
        )
        with telemetry.span(f"tool {call.name}", tool=call.name, tool_call_id=call.id) as span:
            outcome = await self._run_tool(req, agent, role, call, args, tools, sink, state, agents)
            if not outcome.ok:
                code = outcome.output.get("code") if isinstance(outcome.output, dict) else None
                telemetry.fail(span, str(code or "failed"))
        sink.emit(
            ev.Event(
                tool_output_available=ev.ToolOutputAvailable(
                    tool_call_id=call.id,
                    tool_name=call.name,
                    output=events.value(outcome.output),
                    metadata=events.struct(outcome.metadata),
                    ok=outcome.ok,
                )
            )
        )
        return args, outcome

    async def _run_tool(
        self,
        req: rt.RunAgentRequest,
        agent: ap.Agent,
        role: int,
        call: ToolCall,
        args: Any,
        tools: dict[str, Any],
        sink: EventSink,
        state: RunState,
        agents: AgentDirectory,
    ) -> ToolOutcome:
        started = time.monotonic()
        handler = tools.get(call.name)
        if handler is None:
            outcome = ToolOutcome.failed(
                PermissionDenied(f"tool {call.name!r} is not available to this agent")
            )
        elif not isinstance(args, dict) or "_raw" in args:
            outcome = ToolOutcome.failed(InvalidArgument("tool arguments must be a JSON object"))
        else:
            ctx = ToolContext(
                agent=agent,
                role=role,
                trace_id=req.trace_id,
                anchor_message_id=req.anchor_message_id,
                depth=req.depth,
                tool_call_id=call.id,
                sink=sink,
                clients=self.clients,
                settings=self.settings,
                agents=agents,
                state=state,
                leases=self.leases,
            )
            try:
                outcome = await handler(ctx, args)
            except MeshError as err:
                outcome = ToolOutcome.failed(err)
        outcome.metadata.setdefault("durationMs", int((time.monotonic() - started) * 1000))
        tool = call.name if handler is not None else "unknown"  # a label never named by the model
        self.metrics.tool_calls.labels(tool, str(outcome.ok).lower()).inc()
        return outcome
