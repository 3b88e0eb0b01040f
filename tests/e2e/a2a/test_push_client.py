"""Our A2A client taking push notifications instead of holding a stream (docs/a2a.md#push-notifications-
of-remote-tasks): mesh A (PostgreSQL + Redis) calls mesh B's echo (SQLite + memory, its model slowed),
whose card says pushNotifications because its allow-list names A's receiver. The receiver is a second
gateway replica of A (its own port), so a test can take it down while A's chat gateway serves on. The
call completes with the whole reply while B has no stream open and holds A's push config; A's side
panel gets the text before A's turn ends; a receiver down for a while still gets the notification
from B's retries; with no notification at all, GetTask ends the wait; SendMessage answers before B's
task ends, and a receiver URL B refuses falls back to the stream; a wrong token, a JWT of another key,
for another URL, of another body or issued too long ago is refused with a 401 JSON error."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from a2a.types import a2a_pb2 as a2a

from agentmesh.gateway.a2a.push_signing import PushSigner
from agentmesh.gateway.app import create_app
from agentmesh.gateway.server import http_limits
from agentmesh.libs import embedded_http, identity
from agentmesh.libs.config import A2ASettings
from agentmesh.services.agent_runtime.a2a_client import RemoteAgent
from agentmesh.services.agent_runtime.a2a_push import PushInbox
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from tests.e2e.a2a.clients import sdk_client
from tests.e2e.a2a.test_client import RULES, _start_chat, tool_result
from tests.e2e.a2a.test_two_meshes import catalog_with_peer
from tests.mesh import ANY_PORT, Mesh, Ports, sse_events, start_mesh, wait_until

REPLY = "pushed one two three four five six seven eight nine"
PUSH_RULES: dict[str, Any] = {
    **RULES,
    "rules": [
        # A's own answer after the tool is slowed too: the panel's text must beat the turn's end.
        {"system": r"\[general\]", "after_tool": True, "text": "noted that answer", "tokens_per_second": 6},
        {"system": r"\[echo\]", "user": "^slow ", "text": REPLY, "tokens_per_second": 10},
        {"system": r"\[echo\]", "text": "echo: {user}"},
        *RULES["rules"],
    ],
}
POLL_S = 12.0  # A's GetTask interval: the pushed tests end well before it


class Meshes:
    def __init__(self, a: Mesh, b: Mesh, receiver_port: int) -> None:
        self.a, self.b, self.receiver_port = a, b, receiver_port
        self.receiver: embedded_http.EmbeddedServer | None = None

    @property
    def receiver_url(self) -> str:
        return f"http://127.0.0.1:{self.receiver_port}/a2a/push"

    async def receiver_up(self) -> None:
        """A's second gateway replica: where B's notifications go."""
        self.receiver = await embedded_http.serve(
            create_app(self.a.settings), port=self.receiver_port, **http_limits()
        )

    async def receiver_down(self) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
            self.receiver = None


@pytest.fixture(scope="module")
async def meshes(
    tmp_path_factory: pytest.TempPathFactory, pg_url: str, redis_url: str
) -> AsyncIterator[Meshes]:
    ports = Ports()
    port_b, receiver_port = ports.take(), ports.take()
    receiver_url = f"http://127.0.0.1:{receiver_port}/a2a/push"
    tmp_a, tmp_b = tmp_path_factory.mktemp("push-a"), tmp_path_factory.mktemp("push-b")
    b = await start_mesh(
        tmp_b,
        rules=PUSH_RULES,
        catalog=Path(__file__).parent / "catalog.yaml",
        gateway_port=port_b,
        a2a=A2ASettings(
            grpc_listen=ANY_PORT, push_allowed_urls=[f"{receiver_url}/"], push_backoff_s=0.05, push_retries=8
        ),
    )
    a = await start_mesh(
        tmp_a,
        rules=PUSH_RULES,
        catalog=catalog_with_peer(tmp_a, b.url, "PUSH_KEY_AT_B"),
        database_url=pg_url,
        stream_backend="redis",
        redis_url=redis_url,
        a2a=A2ASettings(
            grpc_listen=ANY_PORT, push_receive=True, push_receiver_url=receiver_url, push_poll_s=POLL_S
        ),
    )
    ports.release()
    mp = pytest.MonkeyPatch()
    mp.setenv("PUSH_KEY_AT_B", await b.new_user("org-a"))
    both = Meshes(a, b, receiver_port)
    await both.receiver_up()
    yield both
    mp.undo()
    await both.receiver_down()
    await a.stop()
    await b.stop()


async def _remote_task(b: Mesh) -> a2a.Task:
    """The task B runs for A (org-a's), once it works."""
    client = await sdk_client(f"{b.url}/a2a/echo", os.environ["PUSH_KEY_AT_B"])
    try:

        async def working() -> a2a.Task | None:
            tasks = (await client.list_tasks(a2a.ListTasksRequest(page_size=50))).tasks
            return next((t for t in tasks if t.status.state == a2a.TASK_STATE_WORKING), None)

        task: a2a.Task = await wait_until(working, what="B's task for A")
        listed = await client.list_task_push_notification_configs(
            a2a.ListTaskPushNotificationConfigsRequest(task_id=task.id)
        )
        task.metadata.update({"pushUrls": [c.url for c in listed.configs]})
        return task
    finally:
        await client.close()


async def _open_streams(mesh: Mesh) -> float:
    async with mesh.http() as http:
        text = (await http.get("/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("agentmesh_http_open_streams "))
    return float(line.split()[1])


async def _panel(mesh: Mesh, task_id: str, text: str) -> float:
    """Reads a2a:<task> at A as the side panel does; the monotonic time `text` arrived."""
    seen = ""
    async with mesh.http() as http, http.stream("GET", f"/api/agents/a2a/stream?taskId={task_id}") as resp:
        async for event in sse_events(resp):
            seen += event.get("textDelta", "")
            if text in seen:
                return time.monotonic()
    raise AssertionError(f"the panel ended without {text!r}: {seen!r}")


async def test_invoke_takes_push_notifications_and_holds_no_stream(meshes: Meshes) -> None:
    a, b = meshes.a, meshes.b
    turn, _, task_id = await _start_chat(a, "invoke peer-echo: slow please")
    panel = asyncio.create_task(_panel(a, task_id, REPLY))
    remote = await _remote_task(b)
    # B runs the task with A's push config and no stream open to anyone (SendMessage returned at once)
    assert list(remote.metadata["pushUrls"]) and all(
        u.startswith(meshes.receiver_url + "/") for u in remote.metadata["pushUrls"]
    )
    assert remote.status.state == a2a.TASK_STATE_WORKING and await _open_streams(b) == 0
    text_at = await asyncio.wait_for(panel, 15)
    assert not turn.done()  # the reply reached the panel while A's turn still runs
    events = await turn
    result = tool_result(events)
    assert result["ok"] is True and result["output"] == REPLY, result
    assert time.monotonic() > text_at
    assert a.clients is not None
    with identity.acting_as(a.user):  # our copy of the exchange: pushed, with B's usage
        copy = (
            await a.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=result["localTraceId"]))
        ).messages
    assert copy[-1].content == REPLY and copy[-1].metadata["remotePush"] is True
    assert copy[-1].usage.output_tokens > 0


async def test_send_message_returns_before_the_task_ends_and_a_refused_config_streams(meshes: Meshes) -> None:
    """The client side alone: SendMessage answers once B took the task (B still works on it when our
    on_task runs), the reply comes by push; a receiver URL B's allow-list refuses falls back to the
    stream, with the same reply."""
    a, b = meshes.a, meshes.b
    assert a.clients is not None
    key = os.environ["PUSH_KEY_AT_B"]
    seen: list[int] = []

    async def on_task(task_id: str, _: str) -> None:
        client = await sdk_client(f"{b.url}/a2a/echo", key)
        try:
            seen.append((await client.get_task(a2a.GetTaskRequest(id=task_id))).status.state)
        finally:
            await client.close()

    inbox = PushInbox(a.clients, meshes.receiver_url, f"{b.url}/a2a/echo")
    with identity.acting_as(a.user):  # the inbox's buffer is the calling user's
        pushed = await RemoteAgent(f"{b.url}/a2a/echo", key, push=inbox).call(
            "slow and direct", on_task=on_task
        )
        elsewhere = PushInbox(a.clients, "http://127.0.0.1:9/not-allowed", f"{b.url}/a2a/echo")
        streamed = await RemoteAgent(f"{b.url}/a2a/echo", key, push=elsewhere).call(
            "slow and streamed", on_task=on_task
        )
    assert pushed.pushed and pushed.text == REPLY and pushed.states[-1] == a2a.TASK_STATE_COMPLETED
    assert not streamed.pushed and streamed.text == REPLY
    assert seen == [a2a.TASK_STATE_WORKING] * 2  # both answered before B's task ended
    with identity.acting_as(""):  # the inbox's buffer went with the call
        info = await a.clients.stream.GetStreamInfo(ss.GetStreamInfoRequest(key=inbox.key))
    assert inbox.notifications >= 1 and not info.exists


async def test_a_receiver_down_for_a_while_gets_it_once_back(meshes: Meshes) -> None:
    a, b = meshes.a, meshes.b
    await meshes.receiver_down()
    started = time.monotonic()
    try:
        turn, _, _ = await _start_chat(a, "invoke peer-echo: slow while you are out")
        remote = await _remote_task(b)

        async def completed() -> bool:
            client = await sdk_client(f"{b.url}/a2a/echo", os.environ["PUSH_KEY_AT_B"])
            try:
                task = await client.get_task(a2a.GetTaskRequest(id=remote.id))
            finally:
                await client.close()
            return task.status.state == a2a.TASK_STATE_COMPLETED

        await wait_until(completed, what="B's task to end while A's receiver is down")
        assert not turn.done()  # A waits: nothing reached it
    finally:
        await meshes.receiver_up()
    result = tool_result(await asyncio.wait_for(turn, 15))
    assert result["ok"] is True and result["output"] == REPLY, result
    assert time.monotonic() - started < POLL_S  # B's retried notification ended it, not A's GetTask


async def test_no_notification_at_all_getask_ends_the_wait(
    meshes: Meshes, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = meshes.a
    monkeypatch.setattr(a.settings.a2a, "push_poll_s", 0.5)
    await meshes.receiver_down()
    try:
        result = tool_result(await asyncio.wait_for(_chat_result(a, "invoke peer-echo: slow and lost"), 15))
    finally:
        await meshes.receiver_up()
    assert result["ok"] is True and result["output"] == REPLY, result


async def _chat_result(mesh: Mesh, message: str) -> list[dict[str, Any]]:
    turn, _, _ = await _start_chat(mesh, message)
    return await turn


async def test_receiver_refuses_a_wrong_token_or_signature(meshes: Meshes) -> None:
    a, b = meshes.a, meshes.b
    assert a.clients is not None
    inbox = PushInbox(a.clients, meshes.receiver_url, f"{b.url}/a2a/echo")
    body = json.dumps({"task": {"id": "t1", "contextId": "c1", "status": {"state": "TASK_STATE_WORKING"}}})
    b_signer = b.gateway.config.app.state.a2a.handler.push.signer  # type: ignore[union-attr]
    stranger = PushSigner()

    def jwt_of(signer: PushSigner, audience: str, data: str = body) -> str:
        return signer.sign(issuer=b.url, audience=audience, task_id="t1", body=data.encode())

    def stale_jwt() -> str:  # B's key, our URL, the right body, but issued an hour ago (still unexpired)
        now = int(time.time())
        claims = {"iss": b.url, "aud": inbox.url, "iat": now - 3600, "exp": now + 300, "task_id": "t1"}
        return jwt.encode(claims, b_signer.key, algorithm="RS256", headers={"kid": b_signer.jwk["kid"]})

    with identity.acting_as(a.user):
        await inbox.open()
    try:
        async with httpx.AsyncClient() as http:

            async def post(headers: dict[str, str], url: str = inbox.url) -> httpx.Response:
                return await http.post(
                    url, content=body, headers={"Content-Type": "application/json", **headers}
                )

            token = {"X-A2A-Notification-Token": inbox.token}
            refused = [
                await post({}),
                await post({"X-A2A-Notification-Token": "guess"}),
                await post({**token, "Authorization": f"Bearer {jwt_of(stranger, inbox.url)}"}),
                await post({**token, "Authorization": f"Bearer {jwt_of(b_signer, 'http://elsewhere/x')}"}),
                await post({**token, "Authorization": f"Bearer {jwt_of(b_signer, inbox.url, '{}')}"}),
                await post({**token, "Authorization": f"Bearer {stale_jwt()}"}),
            ]
            missing = await post(token, f"{meshes.receiver_url}/no-such-receiver")
            not_json = await http.post(inbox.url, content=b'{"foo": 1}', headers=token)
            deep = await http.post(inbox.url, content=b'{"task":' * 2000 + b"1" + b"}" * 2000, headers=token)
            taken = await post({**token, "Authorization": f"Bearer {jwt_of(b_signer, inbox.url)}"})
        assert [r.status_code for r in refused] == [401] * 6, [r.text for r in refused]
        reasons = [r.json()["error"]["reason"] for r in refused]
        assert reasons == ["UNAUTHENTICATED"] * 6, [r.json() for r in refused]
        assert missing.status_code == 404 and missing.json()["error"]["reason"] == "NOT_FOUND"
        assert "too old" in refused[-1].json()["error"]["message"]
        assert not_json.status_code == 422 and not_json.json()["error"]["reason"] == "INVALID_ARGUMENT"
        assert deep.status_code == 422 and "nested deeper" in deep.json()["error"]["message"], deep.text
        assert taken.status_code == 200, taken.text

        async def get_task() -> a2a.Task:
            raise AssertionError("the notification came first")

        with identity.acting_as(a.user):
            first = await anext(inbox.responses(get_task))
        assert first.task.id == "t1" and inbox.notifications == 1  # only the good one was handed over
    finally:
        with identity.acting_as(a.user):
            await inbox.close()
