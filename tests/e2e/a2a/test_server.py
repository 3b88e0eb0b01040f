"""Our agents as A2A servers, driven by the official a2a-sdk client over JSON-RPC and gRPC (and its
v0.3 compatibility mode): discovery, send, stream, get, list, cancel (the whole tree), resubscribe after
a dropped connection with no gap and no duplicate, auth failures, another user's task; on SQLite +
memory and PostgreSQL + Redis."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.auth import AuthInterceptor
from a2a.client.card_resolver import A2ACardResolver
from a2a.compat.v0_3.grpc_transport import CompatGrpcTransport
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import TransportProtocol

from agentmesh.libs import identity
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.e2e.a2a.clients import Key, sdk_client, state_of, text_message, text_of
from tests.mesh import BACKENDS, Mesh, wait_until

CATALOG = Path(__file__).parent / "catalog.yaml"
RULES: dict[str, Any] = {
    "rules": [
        {"system": r"\[echo\]", "text": "echo: {user}"},
        {
            "system": r"\[streamer\]",
            "text": "one two three four five six seven eight",
            "tokens_per_second": 20,
        },
        {"system": r"\[worker\]", "fault": "stall"},
        {
            "system": r"\[boss\]",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "worker", "input": "{user}"}}],
        },
        {"system": r"\[boss\]", "after_tool": True, "text": "boss done: {tool_results}"},
    ],
    "default": {"text": "default reply"},
}


pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=CATALOG)


async def task_row(mesh: Mesh, task_id: str) -> tp.A2ATask:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        return (await mesh.clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=task_id))).task


async def messages_of(mesh: Mesh, trace_id: str) -> list[tp.Message]:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        resp = await mesh.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=trace_id))
    return list(resp.messages)


async def test_card_discovery(mesh: Mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        card = (await http.get("/a2a/echo/.well-known/agent-card.json")).json()
        default = await http.get("/.well-known/agent-card.json")
        hidden = await http.get("/a2a/hidden/.well-known/agent-card.json")
        unknown = await http.get("/a2a/nobody/.well-known/agent-card.json")
    assert card["name"] == "Echo Agent" and card["capabilities"]["streaming"] is True
    bindings = {(i["protocolBinding"], i["protocolVersion"]) for i in card["supportedInterfaces"]}
    assert bindings == {("JSONRPC", "1.0"), ("GRPC", "1.0"), ("JSONRPC", "0.3")}
    assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert default.json()["name"] == "General Assistant"
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json() == {
        **unknown.json(),
        "error": {**unknown.json()["error"], "message": hidden.json()["error"]["message"]},
    }


@pytest.mark.parametrize("binding", [TransportProtocol.JSONRPC, TransportProtocol.GRPC])
async def test_stream_persists_a_hidden_a2a_trace(mesh: Mesh, binding: str) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, binding)
    responses = [r async for r in client.send_message(text_message("hello there"))]
    await client.close()
    assert text_of(responses) == "echo: hello there"
    assert state_of(responses[-1]) == a2a.TASK_STATE_COMPLETED
    first = responses[0].task
    task = await task_row(mesh, first.id)
    assert task.trace_id == first.context_id and task.state == tp.TASK_STATE_COMPLETED
    assert task.callee_agent == "echo" and not task.caller_trace_id
    messages = await messages_of(mesh, task.trace_id)
    assert [(m.role, m.source, m.a2a_task_id) for m in messages] == [
        (tp.MESSAGE_ROLE_USER, tp.MESSAGE_SOURCE_A2A, first.id),
        (tp.MESSAGE_ROLE_ASSISTANT, tp.MESSAGE_SOURCE_A2A, first.id),
    ]
    assert messages[1].content == "echo: hello there"
    offsets = [r.artifact_update.metadata["offset"] for r in responses if r.HasField("artifact_update")]
    assert offsets and all(offsets)


async def test_follow_up_continues_the_trace_and_get_list(mesh: Mesh) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key)
    first = [r async for r in client.send_message(text_message("one"))]
    context_id = first[0].task.context_id
    second = [r async for r in client.send_message(text_message("two", context_id=context_id))]
    assert second[0].task.context_id == context_id and second[0].task.id != first[0].task.id
    assert len(await messages_of(mesh, context_id)) == 4  # one trace: both turns
    got = await client.get_task(a2a.GetTaskRequest(id=second[0].task.id))
    assert got.status.state == a2a.TASK_STATE_COMPLETED
    assert got.artifacts[0].parts[0].text == "echo: two"
    listed = await client.list_tasks(a2a.ListTasksRequest(context_id=context_id))
    assert [t.id for t in listed.tasks] == [second[0].task.id, first[0].task.id]  # newest first
    page = await client.list_tasks(a2a.ListTasksRequest(context_id=context_id, page_size=1))
    assert len(page.tasks) == 1 and page.next_page_token
    await client.close()
    blocking = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, streaming=False)  # SendMessage
    (answer,) = [r async for r in blocking.send_message(text_message("three", context_id=context_id))]
    assert answer.task.status.state == a2a.TASK_STATE_COMPLETED
    assert "".join(p.text for p in answer.task.artifacts[0].parts) == "echo: three"
    await blocking.close()
    other = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key)
    with pytest.raises(Exception) as missing:  # a task of another agent is not this agent's
        await other.get_task(a2a.GetTaskRequest(id=first[0].task.id))
    assert "not found" in str(missing.value).lower()
    await other.close()


async def test_another_users_task_answers_like_a_missing_one(mesh: Mesh) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key)
    done = [r async for r in client.send_message(text_message("mine"))]
    await client.close()
    bob = await sdk_client(f"{mesh.url}/a2a/echo", await mesh.new_user("bob-a2a"))
    errors = []
    for task_id in (done[0].task.id, "no-such-task"):
        for call in (
            bob.get_task(a2a.GetTaskRequest(id=task_id)),
            bob.cancel_task(a2a.CancelTaskRequest(id=task_id)),
        ):
            with pytest.raises(Exception) as err:
                await call
            errors.append(str(err.value).replace(task_id, "ID"))
    assert errors[0] == errors[2] and errors[1] == errors[3]
    listed = await bob.list_tasks(a2a.ListTasksRequest())
    assert not listed.tasks
    with pytest.raises(Exception) as refused:  # nor can bob continue alice's trace
        [r async for r in bob.send_message(text_message("hi", context_id=done[0].task.context_id))]
    assert "unknown contextId" in str(refused.value)
    await bob.close()


async def test_auth_failures(mesh: Mesh) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        missing = await http.post("/a2a/echo", json=body)
        wrong = await http.post("/a2a/echo", json=body, headers={"Authorization": "Bearer am_wrong"})
        hidden = await http.post(
            "/a2a/hidden", json=body, headers={"Authorization": f"Bearer {mesh.api_key}"}
        )
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["reason"] == wrong.json()["error"]["reason"] == "UNAUTHENTICATED"
    assert hidden.status_code == 404 and hidden.json()["error"]["reason"] == "NOT_FOUND"
    for binding in (TransportProtocol.JSONRPC, TransportProtocol.GRPC):
        client = await sdk_client(f"{mesh.url}/a2a/echo", "am_wrong", binding)
        with pytest.raises(Exception) as err:
            await client.get_task(a2a.GetTaskRequest(id="x"))
        assert (
            "401" in str(err.value)
            or "UNAUTHENTICATED" in repr(err.value)
            or "nauthenticated" in str(err.value)
        )
        await client.close()


async def test_v0_3_clients(mesh: Mesh) -> None:
    # The SDK's v0.3 compatibility transport, chosen by the card's 0.3 interface.
    resolver = A2ACardResolver(httpx.AsyncClient(), f"{mesh.url}/a2a/echo")
    card = await resolver.get_agent_card()
    legacy = [i for i in card.supported_interfaces if i.protocol_version == "0.3"]
    del card.supported_interfaces[:]
    card.supported_interfaces.extend(legacy)
    factory = ClientFactory(ClientConfig(httpx_client=httpx.AsyncClient(timeout=30)))
    client = factory.create(card, interceptors=[AuthInterceptor(Key(mesh.api_key))])
    # (the SDK keeps the transport it chose private: read it to see which one that is)
    assert type(client._transport).__name__ == "CompatJsonRpcTransport"  # type: ignore[attr-defined]
    responses = [r async for r in client.send_message(text_message("legacy"))]
    assert text_of(responses) == "echo: legacy" and state_of(responses[-1]) == a2a.TASK_STATE_COMPLETED
    got = await client.get_task(a2a.GetTaskRequest(id=responses[0].task.id))
    assert got.status.state == a2a.TASK_STATE_COMPLETED
    await client.close()
    # v0.3 over gRPC (v0.3 requests name no tenant: the default agent answers).
    grpc_url = next(
        i.url for i in (await resolver.get_agent_card()).supported_interfaces if i.protocol_binding == "GRPC"
    )
    legacy_grpc = a2a.AgentCard()
    legacy_grpc.CopyFrom(card)
    del legacy_grpc.supported_interfaces[:]
    legacy_grpc.supported_interfaces.append(
        a2a.AgentInterface(url=grpc_url, protocol_binding="GRPC", protocol_version="0.3")
    )
    grpc_factory = ClientFactory(
        ClientConfig(supported_protocol_bindings=["GRPC"], grpc_channel_factory=grpc.aio.insecure_channel)
    )
    # (registered by hand: whether the factory finds the compat transport depends on the SDK's import order)
    grpc_factory.register("GRPC", CompatGrpcTransport.create)
    client = grpc_factory.create(legacy_grpc, interceptors=[AuthInterceptor(Key(mesh.api_key))])
    assert isinstance(client._transport, CompatGrpcTransport)  # type: ignore[attr-defined]
    responses = [r async for r in client.send_message(text_message("legacy grpc"))]
    assert text_of(responses) == "default reply" and state_of(responses[-1]) == a2a.TASK_STATE_COMPLETED
    await client.close()
    # And the v0.3 method names on the wire.
    async with httpx.AsyncClient(
        base_url=mesh.url, headers={"Authorization": f"Bearer {mesh.api_key}"}
    ) as http:
        card_json = (await http.get("/a2a/echo/.well-known/agent-card.json")).json()
        assert card_json["protocolVersion"] and card_json["url"].endswith(
            "/a2a/echo"
        )  # what 0.3 clients read
        sent = await http.post(
            "/a2a/echo",
            json={
                "jsonrpc": "2.0",
                "id": 7,
                "method": "message/send",
                "params": {
                    "message": {
                        "role": "user",
                        "parts": [{"kind": "text", "text": "old"}],
                        "messageId": "m1",
                        "kind": "message",
                    }
                },
            },
        )
        result = sent.json()["result"]
        assert result["status"]["state"] == "completed", sent.json()
        fetched = await http.post(
            "/a2a/echo",
            json={"jsonrpc": "2.0", "id": 8, "method": "tasks/get", "params": {"id": result["id"]}},
        )
        assert fetched.json()["result"]["id"] == result["id"]


async def test_cancel_cancels_the_whole_tree(mesh: Mesh) -> None:
    assert mesh.clients is not None
    client = await sdk_client(f"{mesh.url}/a2a/boss", mesh.api_key)
    stream = client.send_message(text_message("work hard"))
    first = await anext(stream)
    task = first.task

    # boss calls worker (agent-invoke), whose model stalls: wait for that nested task to run.
    async def nested() -> list[tp.A2ATask]:
        assert mesh.clients is not None
        with identity.acting_as(mesh.user):
            resp = await mesh.clients.tasks.ListA2ATasks(
                tks.ListA2ATasksRequest(caller_trace_id=task.context_id)
            )
        return [t for t in resp.tasks if t.state == tp.TASK_STATE_WORKING]

    (child,) = await wait_until(nested, what="the nested agent-invoke task")
    canceled = await client.cancel_task(a2a.CancelTaskRequest(id=task.id))
    assert canceled.status.state == a2a.TASK_STATE_CANCELED
    rest = [r async for r in stream]
    assert state_of(rest[-1]) == a2a.TASK_STATE_CANCELED
    await wait_until(
        lambda: _state_is(mesh, child.id, tp.TASK_STATE_CANCELED), what="the nested task canceled too"
    )
    with pytest.raises(Exception) as again:
        await client.cancel_task(a2a.CancelTaskRequest(id=task.id))
    assert "cancel" in str(again.value).lower()
    await client.close()


async def _state_is(mesh: Mesh, task_id: str, state: int) -> bool:
    return (await task_row(mesh, task_id)).state == state


@pytest.mark.parametrize("binding", [TransportProtocol.JSONRPC, TransportProtocol.GRPC])
async def test_resubscribe_after_a_dropped_connection_loses_and_repeats_nothing(
    mesh: Mesh, binding: str
) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key, binding)
    # (an async generator, which the Client's signature does not say: aclose drops the connection)
    stream = cast(AsyncGenerator[a2a.StreamResponse, None], client.send_message(text_message("count")))
    seen: list[a2a.StreamResponse] = []
    async for response in stream:
        seen.append(response)
        if len([r for r in seen if r.HasField("artifact_update")]) == 2:
            break
    await stream.aclose()  # the connection drops mid-reply; the task goes on
    task_id = seen[0].task.id
    last = [r for r in seen if r.HasField("artifact_update")][-1].artifact_update.metadata["offset"]
    context = ClientCallContext(service_parameters={"Last-Event-ID": last})
    rest = [r async for r in client.subscribe(a2a.SubscribeToTaskRequest(id=task_id), context=context)]
    assert state_of(rest[-1]) == a2a.TASK_STATE_COMPLETED
    assert text_of(seen) + text_of(rest) == "one two three four five six seven eight"
    offsets = [r.artifact_update.metadata["offset"] for r in seen + rest if r.HasField("artifact_update")]
    assert len(offsets) == len(set(offsets))
    # A finished task refuses a subscription from the start (nothing more will happen to it).
    await wait_until(
        lambda: _state_is(mesh, task_id, tp.TASK_STATE_COMPLETED), what="the task stored completed"
    )
    with pytest.raises(Exception) as ended:
        [r async for r in client.subscribe(a2a.SubscribeToTaskRequest(id=task_id))]
    assert "terminal" in str(ended.value).lower()
    await client.close()


async def test_http_rules_of_the_a2a_routes(mesh: Mesh) -> None:
    async with mesh.http() as http:
        wrong_method = await http.get("/a2a/echo")
        card_post = await http.post("/a2a/echo/.well-known/agent-card.json")
        bad_slug = await http.post("/a2a/NOT_A_SLUG", json={})
        not_json = await http.post(
            "/a2a/echo", content=b"{nope", headers={"content-type": "application/json"}
        )
        # Only the catalog names remote agents: a user's agent cannot send the runtime anywhere.
        remote = await http.post(
            "/api/agents", json={"slug": "mine", "name": "Mine", "remote": {"cardUrl": "http://evil.example"}}
        )
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["code"] == 405
    assert card_post.status_code == 405 and card_post.headers["allow"] == "GET, HEAD"
    assert bad_slug.status_code == 422 and bad_slug.json()["error"]["reason"] == "INVALID_ARGUMENT"
    assert not_json.status_code == 200 and not_json.json()["error"]["code"] == -32700  # JSON-RPC's own
    assert remote.status_code == 422 and "remote" in remote.json()["error"]["message"]


async def test_slowed_model_streams_to_the_a2a_client_before_the_task_ends(mesh: Mesh) -> None:
    """streamer's model sends 20 tokens a second: the first chunk reaches the SDK client while the
    task is still working."""
    client = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key)
    stream = client.send_message(text_message("live"))
    task_id = ""
    async for response in stream:
        if response.HasField("task"):
            task_id = response.task.id
        if response.HasField("artifact_update"):
            break
    assert (await task_row(mesh, task_id)).state == tp.TASK_STATE_WORKING
    rest = [r async for r in stream]
    assert state_of(rest[-1]) == a2a.TASK_STATE_COMPLETED
    await client.close()
