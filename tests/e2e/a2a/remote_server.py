"""An A2A agent of "another organisation", built in the test with the a2a-sdk's own server classes:
DefaultRequestHandler, InMemoryTaskStore, the Starlette JSON-RPC and agent card routes, and a streaming
AgentExecutor whose behaviour the message picks. Bearer auth with one key."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as a2a
from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentmesh.libs import embedded_http

KEY = "remote-secret-key"


@dataclass
class Remote:
    """What the test sees of the remote agent: its calls and gates it opens."""

    requests: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    traceparents: list[str] = field(default_factory=list)  # from message metadata
    traceparent_headers: list[str] = field(default_factory=list)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    started: dict[str, asyncio.Event] = field(default_factory=dict)
    server: Any = None
    url: str = ""

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def started_event(self, name: str) -> asyncio.Event:
        return self.started.setdefault(name, asyncio.Event())


class ScriptedExecutor(AgentExecutor):
    """`hello X`: streams "remote says: X" in three chunks; `fail`: fails; `self-cancel`: cancels
    itself; `wait NAME`: one chunk, then waits for the test's gate NAME; `die`: one chunk, then hangs
    (the test kills the server)."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        text = context.get_user_input()
        metadata = context.message.metadata if context.message is not None else None
        traceparent = metadata["traceparent"] if metadata is not None and "traceparent" in metadata else ""
        if traceparent:
            self.remote.traceparents.append(traceparent)
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await event_queue.enqueue_event(
            a2a.Task(
                id=context.task_id,
                context_id=context.context_id,
                status=a2a.TaskStatus(state=a2a.TASK_STATE_SUBMITTED),
                history=[context.message] if context.message else [],
            )
        )
        await updater.start_work()

        async def chunk(piece: str, first: bool = False) -> None:
            await updater.add_artifact([a2a.Part(text=piece)], artifact_id="reply", append=not first)

        if text.startswith("hello"):
            words = f"remote says: {text[6:]}".split(" ")
            for i, word in enumerate(words):
                await chunk(word + ("" if i == len(words) - 1 else " "), first=i == 0)
            await updater.complete()
        elif text.startswith("fail"):
            await chunk("partial", first=True)
            await updater.failed(updater.new_agent_message([a2a.Part(text="the remote broke")]))
        elif text.startswith("self-cancel"):
            await updater.cancel()
        elif text.startswith("wait"):
            name = text.split()[1]
            await chunk(f"waiting for {name}", first=True)
            self.remote.started_event(name).set()
            await self.remote.gate(name).wait()
            await chunk(" and done")
            await updater.complete()
        elif text.startswith("die"):
            await chunk("about to die", first=True)
            self.remote.started_event("die").set()
            await asyncio.Event().wait()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.remote.cancelled.append(context.task_id or "")
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.cancel()


class Bearer(BaseHTTPMiddleware):
    def __init__(self, app: Any, remote: Remote) -> None:
        super().__init__(app)
        self.remote = remote

    async def dispatch(self, request: Request, call_next: Any) -> Response:
        self.remote.requests.append(f"{request.method} {request.url.path}")
        if request.method == "POST" and request.headers.get("traceparent"):
            self.remote.traceparent_headers.append(request.headers["traceparent"])
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return await call_next(request)  # type: ignore[no-any-return]


async def start_remote(port: int) -> Remote:
    """Serves on `port` (reserved by the test: the card names it)."""
    remote = Remote()
    url = f"http://127.0.0.1:{port}"
    card = a2a.AgentCard(
        name="Partner Agent",
        description="an agent of another organisation",
        version="1",
        supported_interfaces=[
            a2a.AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=a2a.AgentCapabilities(streaming=True),
        security_schemes={
            "bearer": a2a.SecurityScheme(
                http_auth_security_scheme=a2a.HTTPAuthSecurityScheme(scheme="Bearer")
            )
        },
        security_requirements=[a2a.SecurityRequirement(schemes={"bearer": a2a.StringList()})],
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[a2a.AgentSkill(id="partner", name="partner", description="partner", tags=["test"])],
    )
    handler = DefaultRequestHandler(ScriptedExecutor(remote), InMemoryTaskStore(), card)
    app = Starlette(routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/")])
    app.add_middleware(Bearer, remote=remote)
    remote.server = await embedded_http.serve(app, port=port)
    remote.url = url
    return remote
