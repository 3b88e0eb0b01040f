"""One turn in one session, the same for a chat turn, an agent-invoke callee and a subagent:

create the live buffer -> save the user message -> pre-create the assistant placeholder (the
anchor) -> `start` -> AgentRuntimeService.RunAgent streams the run (its events are already in the
buffer) -> write content, thinking, model, usage and metadata back onto the placeholder ->
`finish` -> close the buffer with `done`. A failure marks the placeholder failed and closes the
buffer with an `error` event; a cancellation marks it cancelled and closes with code `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.v1 import agent_runtime_service_pb2 as rt
from agentmesh.v1 import events_pb2 as ev
from agentmesh.v1 import stream_service_pb2 as ss
from agentmesh.v1 import trace_pb2 as tp
from agentmesh.v1 import trace_service_pb2 as ts
from libs import events
from libs.clients import Clients
from libs.errors import Cancelled, DeadlineExceeded, Internal, MeshError, call, from_rpc_error

log = logging.getLogger(__name__)
OnEvent = Callable[[ev.Event], Awaitable[None] | None]


def error_code(err: MeshError) -> str:
    """The `error` event code of a failure: cancelled, timeout, model_error, not_found, ..."""
    if isinstance(err, Cancelled):
        return "cancelled"
    if isinstance(err, DeadlineExceeded) or err.reason in ("MODEL_TIMEOUT", "DEADLINE_EXCEEDED"):
        return "timeout"
    return err.reason.lower()


@dataclass
class TurnSpec:
    owner: str
    session_id: str
    agent: str
    user_text: str
    stream_key: str
    role: int = rt.RUN_ROLE_SUPERVISOR
    depth: int = 0
    source: int = tp.MESSAGE_SOURCE_USER
    a2a_task_id: str = ""
    caller_agent: str = ""
    caller_session_id: str = ""
    system_prompt: str = ""
    tool_names: list[str] | None = None
    model: str = ""
    max_output_tokens: int = 0
    max_steps: int = 0
    timeout_ms: int = 0
    stream_metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class TurnOutcome:
    user_message: tp.Message | None = None
    assistant_message: tp.Message | None = None
    result: rt.RunResult | None = None
    error: MeshError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None


class TurnRunner:
    def __init__(self, clients: Clients, grace_s: float = 5.0) -> None:
        self.clients = clients
        self.grace_s = grace_s

    async def _append(self, key: str, event: ev.Event, on_event: OnEvent | None) -> None:
        resp = await self.clients.stream.AppendEvents(ss.AppendEventsRequest(key=key, events=[event]))
        event.offset = resp.offsets[0]
        await _call(on_event, event)

    async def _close(self, key: str, outcome: ev.Event, on_event: OnEvent | None) -> None:
        req = ss.CloseStreamRequest(key=key)
        if outcome.HasField("error"):
            req.error.CopyFrom(outcome.error)
        else:
            req.done.CopyFrom(ev.Done())
        resp = await self.clients.stream.CloseStream(req)
        if resp.closed:
            outcome.offset = resp.offset
            await _call(on_event, outcome)

    def _message(self, spec: TurnSpec, role: int, content: str, status: int) -> tp.Message:
        return tp.Message(
            session_id=spec.session_id,
            role=role,  # type: ignore[arg-type]
            content=content,
            status=status,  # type: ignore[arg-type]
            source=spec.source,  # type: ignore[arg-type]
            a2a_task_id=spec.a2a_task_id,
            caller_agent=spec.caller_agent,
            caller_session_id=spec.caller_session_id,
            model=spec.model if role == tp.MESSAGE_ROLE_ASSISTANT else "",
        )

    async def run(self, spec: TurnSpec, on_event: OnEvent | None = None) -> TurnOutcome:
        """Runs the turn; returns its outcome (failures are in `outcome.error`); re-raises cancellation.

        Errors before the user message is saved (unknown session, a turn already streaming) raise.
        """
        out = TurnOutcome()
        await call(
            self.clients.stream.CreateStream(
                ss.CreateStreamRequest(key=spec.stream_key, owner=spec.owner, metadata=spec.stream_metadata)
            )
        )
        try:
            user = await self.clients.trace.AppendMessage(
                ts.AppendMessageRequest(
                    owner=spec.owner,
                    message=self._message(
                        spec, tp.MESSAGE_ROLE_USER, spec.user_text, tp.MESSAGE_STATUS_COMPLETED
                    ),
                )
            )
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            await asyncio.shield(self._fail(spec, out, err, None))  # never leave the buffer open
            raise err from exc
        except asyncio.CancelledError:
            await asyncio.shield(self._fail(spec, out, Cancelled("the run was cancelled"), None))
            raise
        out.user_message = user.message
        try:
            placeholder = await self.clients.trace.AppendMessage(
                ts.AppendMessageRequest(
                    owner=spec.owner,
                    message=self._message(spec, tp.MESSAGE_ROLE_ASSISTANT, "", tp.MESSAGE_STATUS_PENDING),
                )
            )
            out.assistant_message = placeholder.message
            start = ev.Event(
                start=ev.Start(
                    session_id=spec.session_id,
                    user_message_id=user.message.id,
                    assistant_message_id=placeholder.message.id,
                    agent=spec.agent,
                )
            )
            await self._append(spec.stream_key, start, on_event)
            out.result = await self._run_agent(spec, user.message, placeholder.message, on_event)
            await self._write_back(spec, out)
            finish = ev.Event(
                finish=ev.Finish(
                    finish_reason=out.result.finish_reason, usage=out.result.usage, model=out.result.model
                )
            )
            await self._append(spec.stream_key, finish, on_event)
            await self._close(spec.stream_key, events.done(), on_event)
        except asyncio.CancelledError:
            await asyncio.shield(self._fail(spec, out, Cancelled("the run was cancelled"), on_event))
            raise
        except grpc.aio.AioRpcError as exc:
            await asyncio.shield(self._fail(spec, out, from_rpc_error(exc), on_event))
        except MeshError as err:
            await asyncio.shield(self._fail(spec, out, err, on_event))
        return out

    async def _run_agent(
        self, spec: TurnSpec, user: tp.Message, anchor: tp.Message, on_event: OnEvent | None
    ) -> rt.RunResult:
        request = rt.RunAgentRequest(
            owner=spec.owner,
            agent=spec.agent,
            role=spec.role,  # type: ignore[arg-type]
            session_id=spec.session_id,
            history_head_sequence=user.sequence,
            anchor_message_id=anchor.id,
            stream_key=spec.stream_key,
            depth=spec.depth,
            timeout_ms=spec.timeout_ms,
            system_prompt=spec.system_prompt,
            tool_names=spec.tool_names or [],
            restrict_tools=spec.tool_names is not None,
            model=spec.model,
            max_output_tokens=spec.max_output_tokens,
            max_steps=spec.max_steps,
        )
        deadline = (spec.timeout_ms / 1000 + self.grace_s) if spec.timeout_ms else None
        rpc = self.clients.runtime.RunAgent(request, timeout=deadline)
        result: rt.RunResult | None = None
        try:
            async for resp in rpc:
                for event in resp.events:
                    await _call(on_event, event)
                if resp.HasField("result"):
                    result = resp.result
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                err = DeadlineExceeded(f"agent {spec.agent} did not finish within {spec.timeout_ms} ms")
            raise err from exc
        finally:
            rpc.cancel()
        if result is None:
            raise Internal(f"agent {spec.agent} ended without a result")
        return result

    async def _write_back(self, spec: TurnSpec, out: TurnOutcome) -> None:
        assert out.assistant_message is not None and out.result is not None
        r = out.result
        msg = tp.Message(
            id=out.assistant_message.id,
            content=r.content,
            thinking=r.thinking,
            model=r.model,
            usage=r.usage,
            status=tp.MESSAGE_STATUS_COMPLETED,
        )
        msg.metadata.CopyFrom(r.metadata)
        resp = await self.clients.trace.UpdateMessage(
            ts.UpdateMessageRequest(
                owner=spec.owner,
                message=msg,
                update_mask=field_mask_pb2.FieldMask(
                    paths=["content", "thinking", "model", "usage", "metadata", "status"]
                ),
            )
        )
        out.assistant_message = resp.message

    async def _fail(self, spec: TurnSpec, out: TurnOutcome, err: MeshError, on_event: OnEvent | None) -> None:
        out.error = err
        code = error_code(err)
        log.info("turn failed", extra={"session": spec.session_id, "code": code, "error": err.message})
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, MeshError, asyncio.TimeoutError):
            async with asyncio.timeout(self.grace_s):
                if out.assistant_message is not None:
                    status = tp.MESSAGE_STATUS_CANCELLED if code == "cancelled" else tp.MESSAGE_STATUS_FAILED
                    msg = tp.Message(id=out.assistant_message.id, status=status)  # type: ignore[arg-type]
                    msg.metadata.update({"error": {"code": code, "message": err.message}})
                    resp = await self.clients.trace.UpdateMessage(
                        ts.UpdateMessageRequest(
                            owner=spec.owner,
                            message=msg,
                            update_mask=field_mask_pb2.FieldMask(paths=["status", "metadata"]),
                        )
                    )
                    out.assistant_message = resp.message
                await self._close(spec.stream_key, events.error(code, err.message), on_event)


async def _call(fn: OnEvent | None, event: ev.Event) -> None:
    if fn is None:
        return
    result = fn(event)
    if result is not None:
        await result
