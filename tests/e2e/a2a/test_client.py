"""agent-invoke of a remote A2A agent (a server built here with the a2a-sdk's own classes): discovery,
streaming into a2a:<task> live, persistence, the location-bearing traceId, agentUrl limited to the
catalog, and every failure as a tool error while the caller's turn goes on (remote failure, refused
key, unreachable card, a server that dies mid-stream), cancel both ways; on both backend pairs."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from agentmesh.libs import identity
from agentmesh.libs.ids import TraceRef
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.e2e.a2a.remote_server import KEY, Remote, start_remote
from tests.mesh import BACKENDS, Mesh, Ports, chat, sse_events, wait_until

CATALOG = Path(__file__).parent / "catalog.yaml"
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": r"invoke-url (?P<url>\S+) (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentUrl": "{url}", "input": "{rest}"}}],
        },
        {
            "system": r"\[general\]",
            "user": r"invoke (?P<slug>[\w-]+): (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "{slug}", "input": "{rest}"}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "Result: {tool_results}"},
        {
            "system": r"\[impatient\]",
            "after_tool": False,
            "tool_calls": [
                {"name": "agent-invoke", "arguments": {"agentSlug": "remote-echo", "input": "{user}"}}
            ],
        },
        {"system": r"\[impatient\]", "after_tool": True, "text": "Result: {tool_results}"},
    ],
    "default": {"text": "default reply"},
}


@pytest.fixture(scope="module")
async def remote() -> AsyncIterator[Remote]:
    ports = Ports()
    server = await start_remote(ports.take())
    yield server
    await server.server.stop()
    ports.release()


@pytest.fixture(scope="module")
def doomed_port() -> Iterator[int]:
    """Where a remote agent process that the test kills serves."""
    ports = Ports()
    yield ports.take()
    ports.release()


pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES)


@pytest.fixture(scope="module")
def mesh_options(
    tmp_path_factory: pytest.TempPathFactory, remote: Remote, doomed_port: int
) -> Iterator[dict[str, Any]]:
    """The test catalog with remote agents: the partner, the partner with a wrong key, a card nobody
    serves, and one whose server the test kills."""
    tmp = tmp_path_factory.mktemp("a2a-client")
    ports = Ports()
    gone = ports.take()  # reserved, never served: an unreachable card
    catalog = yaml.safe_load(CATALOG.read_text())
    catalog["agents"] += [
        {
            "slug": "remote-echo",
            "name": "Partner",
            "remote": {"cardUrl": remote.url, "credentialEnv": "A2A_TEST_KEY"},
        },
        {
            "slug": "remote-nokey",
            "name": "Partner (wrong key)",
            "remote": {
                "cardUrl": f"{remote.url}/.well-known/agent-card.json",
                "credentialEnv": "A2A_TEST_WRONG",
            },
        },
        {"slug": "remote-gone", "name": "Gone", "remote": {"cardUrl": f"http://127.0.0.1:{gone}"}},
        {
            "slug": "remote-doomed",
            "name": "Doomed",
            "remote": {"cardUrl": f"http://127.0.0.1:{doomed_port}", "credentialEnv": "A2A_TEST_KEY"},
        },
    ]
    (tmp / "catalog.yaml").write_text(yaml.safe_dump(catalog))
    mp = pytest.MonkeyPatch()
    mp.setenv("A2A_TEST_KEY", KEY)
    mp.setenv("A2A_TEST_WRONG", "not-the-key")
    yield {"catalog": tmp / "catalog.yaml"}
    mp.undo()
    ports.release()


def tool_result(events: list[dict[str, Any]]) -> dict[str, Any]:
    (out,) = [e for e in events if e["type"] == "tool-output-available"]
    return out["output"]  # type: ignore[no-any-return]


async def messages_of(mesh: Mesh, trace_id: str) -> list[tp.Message]:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        resp = await mesh.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=trace_id))
    return list(resp.messages)


async def task_row(mesh: Mesh, task_id: str) -> tp.A2ATask:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        return (await mesh.clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=task_id))).task


async def test_remote_agent_streams_and_persists(mesh: Mesh, remote: Remote) -> None:
    events = await chat(mesh, "general", "invoke remote-echo: hello world")
    started = next(e for e in events if e["type"] == "a2a-task-started")
    assert started["calleeAgentName"] == "Partner"  # the catalog's name of the remote agent
    result = tool_result(events)
    assert result["ok"] is True and result["output"] == "remote says: world"
    ref = TraceRef.parse(result["traceId"])
    assert ref.host == "127.0.0.1" and f":{ref.port}" in remote.url and ref.id
    assert events[-1]["type"] in ("done", "finish") or any(e["type"] == "done" for e in events)
    text = "".join(e["textDelta"] for e in events if e["type"] == "text-delta")
    assert "remote says: world" in text  # the caller's turn went on with the result
    task = await task_row(mesh, result["taskId"])
    assert task.state == tp.TASK_STATE_COMPLETED and task.callee_agent == "remote-echo"
    assert result["localTraceId"] == task.trace_id  # what the web UI's "open" shows
    messages = await messages_of(mesh, task.trace_id)
    assert [(m.role, m.source, m.a2a_task_id) for m in messages] == [
        (tp.MESSAGE_ROLE_USER, tp.MESSAGE_SOURCE_A2A, task.id),
        (tp.MESSAGE_ROLE_ASSISTANT, tp.MESSAGE_SOURCE_A2A, task.id),
    ]
    meta = json.loads(json.dumps(dict(messages[1].metadata)))
    assert messages[1].content == "remote says: world"
    assert meta["remoteContextId"] == ref.id and meta["remoteTaskId"]
    async with mesh.http() as http, http.stream("GET", f"/api/agents/a2a/stream?taskId={task.id}") as resp:
        buffered = [e async for e in sse_events(resp)]
    assert "".join(e.get("textDelta", "") for e in buffered) == "remote says: world"
    assert buffered[-1]["type"] == "done"


async def test_agent_url_only_from_the_catalog(mesh: Mesh, remote: Remote) -> None:
    ok = tool_result(
        await chat(mesh, "general", f"invoke-url {remote.url}/.well-known/agent-card.json hello url")
    )
    assert ok["ok"] is True and ok["output"] == "remote says: url"
    before = len(remote.requests)
    refused = tool_result(await chat(mesh, "general", "invoke-url http://127.0.0.1:9/evil hello"))
    assert refused["ok"] is False and refused["code"] == "permission_denied"
    assert len(remote.requests) == before  # nothing was contacted


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("invoke remote-echo: fail now", "remote_failed"),
        ("invoke remote-nokey: hello", "unauthenticated"),
        ("invoke remote-gone: hello", "unavailable"),
        ("invoke remote-echo: self-cancel", "cancelled"),
    ],
)
async def test_remote_failures_are_tool_errors(mesh: Mesh, message: str, code: str) -> None:
    events = await chat(mesh, "general", message)
    result = tool_result(events)
    assert result["ok"] is False and result["code"] == code, result
    assert any(e["type"] == "done" for e in events)  # the caller's turn went on to its end
    if result.get("taskId"):
        task = await task_row(mesh, result["taskId"])
        want = tp.TASK_STATE_CANCELED if code == "cancelled" else tp.TASK_STATE_FAILED
        assert task.state == want


async def _panel_until(mesh: Mesh, task_id: str, text: str) -> str:
    """Reads a2a:<task> as the side panel does until `text` arrives."""
    seen = ""
    async with mesh.http() as http, http.stream("GET", f"/api/agents/a2a/stream?taskId={task_id}") as resp:
        async for event in sse_events(resp):
            seen += event.get("textDelta", "")
            if text in seen:
                return seen
    return seen


async def _start_chat(mesh: Mesh, message: str) -> tuple[asyncio.Task[list[dict[str, Any]]], str, str]:
    """A turn running in the background; its session and the agent-invoke task id once started."""
    turn = asyncio.create_task(chat(mesh, "general", message))
    assert mesh.clients is not None

    async def started() -> tuple[str, str] | None:
        assert mesh.clients is not None
        with identity.acting_as(mesh.user):
            traces = (await mesh.clients.trace.ListTraces(ts.ListTracesRequest())).traces
            for trace in traces:
                tasks = (
                    await mesh.clients.tasks.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=trace.id))
                ).tasks
                for task in tasks:
                    if task.state == tp.TASK_STATE_WORKING:
                        return trace.id, task.id
        return None

    session, task_id = await wait_until(started, what="the remote call to start")
    return turn, session, task_id


async def test_remote_text_reaches_the_panel_before_the_turn_ends(mesh: Mesh, remote: Remote) -> None:
    gate = f"live-{mesh.settings.stream.backend}"
    turn, _, task_id = await _start_chat(mesh, f"invoke remote-echo: wait {gate}")
    seen = await asyncio.wait_for(_panel_until(mesh, task_id, f"waiting for {gate}"), 10)
    assert not turn.done()  # the remote agent is still working: the text came live
    assert f"waiting for {gate}" in seen
    remote.gate(gate).set()
    result = tool_result(await turn)
    assert result["ok"] is True and result["output"] == f"waiting for {gate} and done"


async def test_our_cancel_cancels_the_remote_task(mesh: Mesh, remote: Remote) -> None:
    gate = f"cancel-{mesh.settings.stream.backend}"
    turn, session, task_id = await _start_chat(mesh, f"invoke remote-echo: wait {gate}")
    await remote.started_event(gate).wait()
    before = len(remote.cancelled)
    async with mesh.http() as http:
        assert (await http.post(f"/api/sessions/{session}/cancel")).status_code == 200
    await turn
    await wait_until(lambda: len(remote.cancelled) > before, what="CancelTask at the remote")
    await wait_until(lambda: _state(mesh, task_id, tp.TASK_STATE_CANCELED), what="our task settled canceled")


async def _state(mesh: Mesh, task_id: str, state: int) -> bool:
    return (await task_row(mesh, task_id)).state == state


async def test_a_remote_that_dies_mid_stream(mesh: Mesh, doomed_port: int) -> None:
    """The remote agent's process is SIGKILLed after its first chunk: the tool fails `unavailable`
    with what streamed kept, the caller's turn goes on, our task and buffer end."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.e2e.a2a.remote_main", str(doomed_port), cwd=Path(__file__).parents[3]
    )
    try:
        async with httpx.AsyncClient() as http:

            async def up() -> bool:
                try:
                    card = f"http://127.0.0.1:{doomed_port}/.well-known/agent-card.json"
                    return (
                        await http.get(card, headers={"Authorization": f"Bearer {KEY}"})
                    ).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(up, what="the remote process")
        turn, _, task_id = await _start_chat(mesh, "invoke remote-doomed: die")
        await asyncio.wait_for(_panel_until(mesh, task_id, "about to die"), 10)
        proc.kill()
        result = tool_result(await turn)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert result["ok"] is False and result["code"] == "unavailable", result
    assert result["output"] == "about to die"
    task = await task_row(mesh, task_id)
    assert task.state == tp.TASK_STATE_FAILED
    messages = await messages_of(mesh, task.trace_id)
    assert messages[-1].status == tp.MESSAGE_STATUS_FAILED and messages[-1].content == "about to die"


async def test_a_remote_past_the_deadline_is_a_timeout_and_is_cancelled(mesh: Mesh, remote: Remote) -> None:
    """impatient gives a callee 1 s (invoke.timeoutMs); the remote agent waits for a gate never opened."""
    gate = f"never-{mesh.settings.stream.backend}"
    before = len(remote.cancelled)
    events = await chat(mesh, "impatient", f"wait {gate}")
    result = tool_result(events)
    assert result["ok"] is False and result["code"] == "timeout", result
    assert result["output"] == f"waiting for {gate}"  # what streamed before the deadline is kept
    assert any(e["type"] == "done" for e in events)
    await wait_until(lambda: len(remote.cancelled) > before, what="CancelTask at the remote")
    assert (await task_row(mesh, result["taskId"])).state == tp.TASK_STATE_FAILED
