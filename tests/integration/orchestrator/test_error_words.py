"""User-facing errors name the cause in words, with the transport's details only in the log (issue 39,
point 5): a stopped model server is `model_unreachable` (it was `timeout`), a stopped service is
`unavailable` without gRPC's words (`ipv4:127.0.0.1:50313 ... Connection refused` reached users and
was stored in the assistant message); failed requests log a line each at most, never a traceback."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from agentmesh.libs import identity
from agentmesh.libs.clients import MessageAppender
from agentmesh.libs.errors import MeshError
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.mesh import BACKENDS, TEST_CATALOG, Mesh, chat

RULES = {"rules": [{"user": "^nul please$", "text": "a\x00b"}], "default": {"text": "ok"}}
pytestmark = pytest.mark.mesh(catalog=TEST_CATALOG, rules=RULES, scope="function", backends=BACKENDS)
TRANSPORT_WORDS = ("ipv4:", "ipv6:", "127.0.0.1", "Connection refused", "Connect call failed", "Error(")


async def stored_error(mesh: Mesh, trace_id: str) -> dict[str, str]:
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{trace_id}/messages")).json()["messages"]
    assert messages[-1]["status"] == "failed", messages[-1]
    return dict(messages[-1]["metadata"]["error"])


async def test_a_stopped_model_server_is_model_unreachable(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    await mesh.mock.stop()
    with caplog.at_level(logging.INFO):
        events = await chat(mesh, "general", "hello")
    end = events[-1]
    assert (end["type"], end["code"]) == ("error", "model_unreachable"), end
    assert not any(word in end["message"] for word in TRANSPORT_WORDS), end
    assert await stored_error(mesh, events[0]["traceId"]) == {
        "code": "model_unreachable",
        "message": end["message"],
    }
    unreachable = [r for r in caplog.records if r.getMessage() == "model server unreachable"]
    assert len(unreachable) == 1 and "Connect" in str(
        getattr(unreachable[0], "error", "")
    )  # the details: logged
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a model server that is down"


async def test_a_stopped_service_is_unavailable_without_its_address(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    await mesh.servers["agent-runtime"].stop(0)
    with caplog.at_level(logging.INFO):
        events = await chat(mesh, "general", "hello")
    end = events[-1]
    assert (end["type"], end["code"]) == ("error", "unavailable"), end
    assert end["message"] == "a service of the mesh is unavailable; try again shortly"
    assert await stored_error(mesh, events[0]["traceId"]) == {
        "code": "unavailable",
        "message": end["message"],
    }
    assert any("rpc failed: UNAVAILABLE" in r.getMessage() for r in caplog.records)  # the details: logged


async def test_ten_concurrent_appends_to_random_ids_log_no_traceback(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """Over HTTP and over gRPC (the appender every writer of the mesh uses): a 404 / NOT_FOUND each, and
    at most a line per request, none with a traceback."""
    assert mesh.clients is not None
    appender = MessageAppender(mesh.clients.messages)
    with caplog.at_level(logging.INFO):
        async with mesh.http() as http:
            answers = await asyncio.gather(
                *(
                    http.post(
                        f"/api/traces/{uuid.uuid4()}/messages",
                        json={"messages": [{"role": "user", "content": "x"}]},
                    )
                    for _ in range(10)
                )
            )
        with identity.acting_as(mesh.user):
            grpc_answers = await asyncio.gather(
                *(
                    appender.append(
                        tp.Message(trace_id=str(uuid.uuid4()), role=tp.MESSAGE_ROLE_USER, content="x")
                    )
                    for _ in range(10)
                ),
                return_exceptions=True,
            )
        await appender.aclose()
    assert [r.status_code for r in answers] == [404] * 10
    assert all(isinstance(a, MeshError) and a.reason == "NOT_FOUND" for a in grpc_answers), grpc_answers
    assert not [r for r in caplog.records if r.exc_info]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) <= 20


async def test_a_model_reply_with_nul_is_stored_on_both_databases(mesh: Mesh) -> None:
    """The trace service refuses U+0000 on both databases (PostgreSQL cannot store it); a model that
    sends one has it replaced by U+FFFD, and its turn completes alike on both."""
    events = await chat(mesh, "general", "nul please")
    kinds = [e["type"] for e in events]
    assert "finish" in kinds and "error" not in kinds, events[-3:]
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{events[0]['traceId']}/messages")).json()["messages"]
    assert (messages[-1]["status"], messages[-1]["content"]) == ("completed", "a\ufffdb")
