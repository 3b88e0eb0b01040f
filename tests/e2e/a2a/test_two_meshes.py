"""Two meshes calling each other's agents over A2A: mesh A (SQLite + memory) and mesh B (PostgreSQL +
Redis), each with the other's `echo` in its catalog as a remote agent whose key is an environment
variable. A call from either side streams, persists on both sides (the callee's trace lives at the
callee, owned by the user of the key it was called with), and a follow-up with the returned
location-bearing traceId continues the remote trace. `call_remote_agent` (the entry point peers use)
reaches an agent of the other mesh directly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentmesh.libs import identity
from agentmesh.libs.ids import TraceRef
from agentmesh.services.agent_runtime.a2a_client import call_remote_agent
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.e2e.a2a.test_client import RULES, _panel_until, _start_chat, tool_result
from tests.mesh import Mesh, Ports, chat, start_mesh

CATALOG = Path(__file__).parent / "catalog.yaml"
CONTINUE = {
    "system": r"\[general\]",
    "user": r"continue (?P<trace>\S+) (?P<rest>.*)",
    "after_tool": False,
    "tool_calls": [
        {
            "name": "agent-invoke",
            "arguments": {"agentSlug": "peer-echo", "input": "{rest}", "continueFrom": "{trace}"},
        }
    ],
}
ECHO = {"system": r"\[echo\]", "text": "echo: {user}"}
SLOW_ECHO = {
    "system": r"\[echo\]",
    "user": "^slow ",
    "text": "slowly one two three four five six",
    "tokens_per_second": 20,
}
TWO_RULES: dict[str, Any] = {**RULES, "rules": [CONTINUE, SLOW_ECHO, ECHO, *RULES["rules"]]}


def catalog_with_peer(tmp: Path, peer_url: str, env: str) -> Path:
    catalog = yaml.safe_load(CATALOG.read_text())
    catalog["agents"].append(
        {
            "slug": "peer-echo",
            "name": "Peer Echo",
            "remote": {"cardUrl": f"{peer_url}/a2a/echo", "credentialEnv": env},
        }
    )
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


@pytest.fixture(scope="module")
async def meshes(
    tmp_path_factory: pytest.TempPathFactory, pg_url: str, redis_url: str
) -> AsyncIterator[tuple[Mesh, Mesh]]:
    ports = Ports()
    port_a, port_b = ports.take(), ports.take()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    tmp_a, tmp_b = tmp_path_factory.mktemp("mesh-a"), tmp_path_factory.mktemp("mesh-b")
    a = await start_mesh(
        tmp_a, rules=TWO_RULES, catalog=catalog_with_peer(tmp_a, url_b, "A2A_KEY_AT_B"), gateway_port=port_a
    )
    b = await start_mesh(
        tmp_b,
        rules=TWO_RULES,
        catalog=catalog_with_peer(tmp_b, url_a, "A2A_KEY_AT_A"),
        gateway_port=port_b,
        database_url=pg_url,
        stream_backend="redis",
        redis_url=redis_url,
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("A2A_KEY_AT_B", await b.new_user("org-a"))  # mesh B's key for the organisation of mesh A
    mp.setenv("A2A_KEY_AT_A", await a.new_user("org-b"))
    yield a, b
    mp.undo()
    await a.stop()
    await b.stop()
    ports.release()


async def _task_at(callee: Mesh, user: str, trace_id: str) -> list[tp.Message]:
    assert callee.clients is not None
    with identity.acting_as(user):
        return list(
            (await callee.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=trace_id))).messages
        )


@pytest.mark.parametrize("direction", ["a-calls-b", "b-calls-a"])
async def test_meshes_call_each_other(meshes: tuple[Mesh, Mesh], direction: str) -> None:
    caller, callee = meshes if direction == "a-calls-b" else meshes[::-1]
    user_at_callee = "org-a" if direction == "a-calls-b" else "org-b"
    result = tool_result(await chat(caller, "general", "invoke peer-echo: ping"))
    assert result["ok"] is True and result["output"] == "echo: ping", result
    ref = TraceRef.parse(result["traceId"])
    assert callee.url.endswith(f":{ref.port}")
    messages = await _task_at(callee, user_at_callee, ref.id)  # the callee's trace, its caller's user
    assert [(m.role, m.source, m.content) for m in messages] == [
        (tp.MESSAGE_ROLE_USER, tp.MESSAGE_SOURCE_A2A, "ping"),
        (tp.MESSAGE_ROLE_ASSISTANT, tp.MESSAGE_SOURCE_A2A, "echo: ping"),
    ]
    assert caller.clients is not None
    with identity.acting_as(caller.user):  # our copy of the exchange, with the usage the callee reported
        copy = (
            await caller.clients.messages.ListMessages(
                ms.ListMessagesRequest(trace_id=result["localTraceId"])
            )
        ).messages
    assert copy[-1].content == "echo: ping" and copy[-1].usage.output_tokens > 0
    assert copy[-1].metadata["remoteContextId"] == ref.id
    again = tool_result(await chat(caller, "general", f"continue {result['traceId']} pong"))
    assert again["ok"] is True and again["traceId"] == result["traceId"]
    assert len(await _task_at(callee, user_at_callee, ref.id)) == 4  # the same remote trace went on


async def test_call_remote_agent_entry_point(meshes: tuple[Mesh, Mesh]) -> None:
    _, b = meshes
    chunks: list[str] = []
    reply = await call_remote_agent(b.url, "echo", b.api_key, "direct", on_text=chunks.append)
    assert reply.text == "".join(chunks) == "echo: direct"
    assert reply.agent_name == "Echo Agent" and reply.task_id and reply.context_id
    with pytest.raises(Exception) as refused:
        await call_remote_agent(b.url, "echo", "am_not-a-key", "direct")
    assert type(refused.value).__name__ == "Unauthenticated"


async def test_remote_text_reaches_the_callers_panel_before_the_turn_ends(meshes: tuple[Mesh, Mesh]) -> None:
    """Mesh B's echo streams at 20 tokens a second: mesh A's side panel (a2a:<task> at A) shows its
    text while A's turn is still running."""
    a, _ = meshes
    turn, _, task_id = await _start_chat(a, "invoke peer-echo: slow please")
    seen = await asyncio.wait_for(_panel_until(a, task_id, "slowly"), 10)
    assert "slowly" in seen and not turn.done()
    result = tool_result(await turn)
    assert result["ok"] is True and result["output"] == "slowly one two three four five six"


async def test_continue_from_an_unknown_remote_trace(meshes: tuple[Mesh, Mesh]) -> None:
    a, b = meshes
    port = b.url.rsplit(":", 1)[1]
    result = tool_result(await chat(a, "general", f"continue agent://127.0.0.1:{port}/no-such-trace hi"))
    assert result["ok"] is False and result["code"] == "invalid_argument", result
    assert "unknown contextId" in result["error"]
    elsewhere = tool_result(await chat(a, "general", "continue agent://other.example/some-trace hi"))
    assert elsewhere["ok"] is False and elsewhere["code"] == "invalid_argument"  # not this agent's home
