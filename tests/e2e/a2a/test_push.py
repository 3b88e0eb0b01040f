"""Push notifications of the tasks our agents serve (docs/a2a.md, "Push notifications"), driven by the
official a2a-sdk client against a real mesh, delivered to a real loopback HTTP receiver: the config
methods (set, get, list, delete; another user's task answers like a missing one), the notifications of
a slowed task (working, then completed, with the client's token and a JWT the receiver verifies against
the gateway's JWKS), over JSON-RPC and gRPC, a config set at another gateway replica than the one
running the task, retries while the receiver answers 503 or is down, and the allow-list: a URL it does
not name is refused naming the setting, and an internal service (the canary) is never contacted, also
not through a redirect. On SQLite + memory and PostgreSQL + Redis."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import TransportProtocol
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from agentmesh.gateway.app import create_app
from agentmesh.gateway.server import http_limits
from agentmesh.libs import embedded_http
from agentmesh.libs.config import A2ASettings
from tests.e2e.a2a.clients import sdk_client, text_message
from tests.mesh import ANY_PORT, BACKENDS, Mesh, wait_until

CATALOG = Path(__file__).parent / "catalog.yaml"
RULES: dict[str, Any] = {
    "rules": [
        {"system": r"\[echo\]", "text": "echo: {user}"},
        # slowed: the task is still working when the test sets its config
        {
            "system": r"\[streamer\]",
            "text": "one two three four five six seven eight",
            "tokens_per_second": 10,
        },
    ],
    "default": {"text": "default reply"},
}
TOKEN = "client-token-123"

pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=CATALOG)


@dataclass
class Receiver:
    """A loopback HTTP server that records every POST: the push receiver (at /hooks/...), and the same
    kind of server standing for an internal service the gateway must never call (the canary)."""

    server: Any = None
    url: str = ""
    got: list[dict[str, Any]] = field(default_factory=list)
    arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    refuse: int = 0  # answer this many POSTs with 503 first (a receiver that is down for a while)
    redirect_to: str = ""

    async def hook(self, request: Request) -> Response:
        body = await request.body()
        async with self.arrived:
            self.got.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
            self.arrived.notify_all()
        if request.url.path.endswith("/flaky") and self.refuse > 0:
            self.refuse -= 1
            return JSONResponse({"error": "down"}, status_code=503)
        if request.url.path.endswith("/moved"):
            return RedirectResponse(self.redirect_to, status_code=307)
        return JSONResponse({"ok": True})

    async def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
        async with asyncio.timeout(timeout), self.arrived:
            await self.arrived.wait_for(lambda: predicate(self.got))
            return list(self.got)


async def start_receiver() -> Receiver:
    receiver = Receiver()
    app = Starlette(routes=[Route("/{path:path}", receiver.hook, methods=["POST"])])
    receiver.server = await embedded_http.serve(app, port=0)
    receiver.url = f"http://127.0.0.1:{receiver.server.port}"
    return receiver


@pytest.fixture(scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    r = await start_receiver()
    yield r
    await r.server.stop()


@pytest.fixture(scope="module")
async def canary() -> AsyncIterator[Receiver]:
    r = await start_receiver()
    yield r
    await r.server.stop()


@pytest.fixture(scope="module")
def down_port() -> int:
    """A loopback port where nothing listens until a test starts a receiver there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mesh_options(receiver: Receiver, down_port: int) -> dict[str, Any]:
    """Only the receiver's /hooks/ (and the receiver that is down for a while) are allowed."""
    return {
        "a2a": A2ASettings(
            grpc_listen=ANY_PORT,
            push_allowed_urls=[f"{receiver.url}/hooks/", f"http://127.0.0.1:{down_port}/"],
            push_backoff_s=0.05,
            push_retries=7,  # 0.05 s doubling: a budget of 6.35 s
        )
    }


def states(got: list[dict[str, Any]], path: str) -> list[str]:
    return [json.loads(g["body"])["task"]["status"]["state"] for g in got if g["path"] == path]


async def verify_jwt(mesh: Mesh, hit: dict[str, Any], audience: str) -> dict[str, Any]:
    """The notification's JWT checked as a receiver does: the key from the gateway's JWKS (by kid), the
    signature, audience, issuer, and the hash of the body it came with."""
    async with httpx.AsyncClient() as http:
        jwks = (await http.get(f"{mesh.url}/.well-known/jwks.json")).json()
    token = hit["headers"]["authorization"].removeprefix("Bearer ")
    kid = jwt.get_unverified_header(token)["kid"]
    key = jwt.PyJWKSet.from_dict(jwks)[kid].key
    claims = jwt.decode(token, key, algorithms=["RS256"], audience=audience, issuer=mesh.url)
    assert claims["request_body_sha256"] == hashlib.sha256(hit["body"]).hexdigest()
    return claims


async def test_card_says_push_and_jwks_is_served(mesh: Mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        card = (await http.get("/a2a/echo/.well-known/agent-card.json")).json()
        jwks = await http.get("/.well-known/jwks.json")
        wrong_method = await http.post("/.well-known/jwks.json")
    assert card["capabilities"]["pushNotifications"] is True
    assert jwks.status_code == 200
    (key,) = jwks.json()["keys"]
    assert key["kty"] == "RSA" and key["alg"] == "RS256" and key["kid"] and "d" not in key
    assert wrong_method.status_code == 405


async def test_slowed_task_pushes_working_then_completed(mesh: Mesh, receiver: Receiver, unique: str) -> None:
    path = f"/hooks/slow-{unique}"
    url = receiver.url + path
    client = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key)
    stream = client.send_message(text_message("count"))
    first = await anext(stream)
    task_id = first.task.id
    config = await client.create_task_push_notification_config(
        a2a.TaskPushNotificationConfig(task_id=task_id, id="c1", url=url, token=TOKEN)
    )
    assert (config.task_id, config.id, config.url) == (task_id, "c1", url)
    got = await client.get_task_push_notification_config(
        a2a.GetTaskPushNotificationConfigRequest(task_id=task_id, id="c1")
    )
    assert got.url == url and got.token == TOKEN
    listed = await client.list_task_push_notification_configs(
        a2a.ListTaskPushNotificationConfigsRequest(task_id=task_id)
    )
    assert [c.id for c in listed.configs] == ["c1"]
    rest = [r async for r in stream]  # the client may as well go: the pushes follow the task
    assert rest[-1].status_update.status.state == a2a.TASK_STATE_COMPLETED
    hits = await receiver.wait_for(lambda got: "TASK_STATE_COMPLETED" in states(got, path))
    assert states(hits, path) == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
    mine = [h for h in hits if h["path"] == path]
    for hit in mine:
        assert hit["headers"]["x-a2a-notification-token"] == TOKEN
        claims = await verify_jwt(mesh, hit, url)
        assert claims["task_id"] == task_id
    done = json.loads(mine[-1]["body"])["task"]
    assert done["id"] == task_id and done["contextId"] == first.task.context_id
    assert done["artifacts"][0]["parts"][0]["text"] == "one two three four five six seven eight"
    await client.delete_task_push_notification_config(
        a2a.DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="c1")
    )
    listed = await client.list_task_push_notification_configs(
        a2a.ListTaskPushNotificationConfigsRequest(task_id=task_id)
    )
    assert not listed.configs
    await client.close()


async def test_config_in_send_message_and_a_receiver_down_for_a_while(
    mesh: Mesh, receiver: Receiver, unique: str
) -> None:
    receiver.refuse = 3  # 503 three times, then it takes them (within the retry budget)
    path = f"/hooks/{unique}/flaky"
    url = receiver.url + path
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, streaming=False)
    request = text_message("push me")
    request.configuration.task_push_notification_config.CopyFrom(
        a2a.TaskPushNotificationConfig(url=url, token=TOKEN)
    )
    (answer,) = [r async for r in client.send_message(request)]
    assert answer.task.status.state == a2a.TASK_STATE_COMPLETED
    hits = await receiver.wait_for(lambda got: "TASK_STATE_COMPLETED" in states(got, path))
    # every notification arrives, in order, the refused attempts before them
    assert states(hits, path) == ["TASK_STATE_WORKING"] * 4 + ["TASK_STATE_COMPLETED"]
    assert receiver.refuse == 0
    await client.close()


async def test_another_users_task_answers_like_a_missing_one(mesh: Mesh, receiver: Receiver) -> None:
    alice = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key)
    done = [r async for r in alice.send_message(text_message("mine"))]
    task_id = done[0].task.id
    await alice.create_task_push_notification_config(
        a2a.TaskPushNotificationConfig(task_id=task_id, id="a", url=f"{receiver.url}/hooks/alice")
    )
    await alice.close()
    bob = await sdk_client(f"{mesh.url}/a2a/echo", await mesh.new_user("bob-push"))
    errors = []
    for tid in (task_id, "no-such-task"):
        for call in (
            bob.create_task_push_notification_config(
                a2a.TaskPushNotificationConfig(task_id=tid, id="b", url=f"{receiver.url}/hooks/bob")
            ),
            bob.get_task_push_notification_config(
                a2a.GetTaskPushNotificationConfigRequest(task_id=tid, id="a")
            ),
            bob.list_task_push_notification_configs(a2a.ListTaskPushNotificationConfigsRequest(task_id=tid)),
            bob.delete_task_push_notification_config(
                a2a.DeleteTaskPushNotificationConfigRequest(task_id=tid, id="a")
            ),
        ):
            with pytest.raises(Exception) as err:
                await call
            errors.append(str(err.value).replace(tid, "ID"))
    assert errors[:4] == errors[4:] and all("not found" in e.lower() for e in errors)
    await bob.close()
    assert not [g for g in receiver.got if g["path"] == "/hooks/bob"]


async def test_only_allowed_urls_are_called(
    mesh: Mesh, receiver: Receiver, canary: Receiver, unique: str
) -> None:
    path = f"/hooks/{unique}/moved"
    client = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key)
    stream = client.send_message(text_message("count"))
    task_id = (await anext(stream)).task.id
    refused = []
    for url in (
        f"{canary.url}/hooks/x",  # another port: the internal service
        f"{receiver.url}/elsewhere",  # the right server, a path the list does not name
        f"http://user:pw@127.0.0.1:{receiver.server.port}/hooks/x",
        "file:///etc/passwd",
    ):
        with pytest.raises(Exception) as err:
            await client.create_task_push_notification_config(
                a2a.TaskPushNotificationConfig(task_id=task_id, id="x", url=url)
            )
        refused.append(str(err.value))
    assert all("AGENTMESH_A2A__PUSH_ALLOWED_URLS" in e for e in refused), refused
    # an allowed URL that redirects to the canary: the redirect is not followed (nor retried)
    receiver.redirect_to = f"{canary.url}/internal"
    await client.create_task_push_notification_config(
        a2a.TaskPushNotificationConfig(task_id=task_id, id="m", url=receiver.url + path)
    )
    await client.create_task_push_notification_config(
        a2a.TaskPushNotificationConfig(task_id=task_id, id="gone", url=f"{receiver.url}/hooks/{unique}/gone")
    )
    await client.delete_task_push_notification_config(
        a2a.DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="gone")
    )
    listed = await client.list_task_push_notification_configs(
        a2a.ListTaskPushNotificationConfigsRequest(task_id=task_id)
    )
    assert [c.id for c in listed.configs] == ["m"]
    [r async for r in stream]
    await receiver.wait_for(lambda got: "TASK_STATE_COMPLETED" in states(got, path))
    assert states(receiver.got, path) == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
    assert canary.got == []  # never contacted
    # a config deleted while the task works gets nothing after (a working sent before may have arrived)
    assert "TASK_STATE_COMPLETED" not in states(receiver.got, f"/hooks/{unique}/gone")

    async def forgotten() -> bool:  # the task ended and was pushed: its configs are dropped
        request = a2a.ListTaskPushNotificationConfigsRequest(task_id=task_id)
        return not (await client.list_task_push_notification_configs(request)).configs

    await wait_until(forgotten)
    await client.close()


async def test_a_refused_send_message_config_starts_no_turn(mesh: Mesh, canary: Receiver) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, streaming=False)
    before = await client.list_tasks(a2a.ListTasksRequest(page_size=100))
    request = text_message("never")
    request.configuration.task_push_notification_config.CopyFrom(
        a2a.TaskPushNotificationConfig(url=f"{canary.url}/hooks/x")
    )
    with pytest.raises(Exception) as err:
        [r async for r in client.send_message(request)]
    assert "AGENTMESH_A2A__PUSH_ALLOWED_URLS" in str(err.value)
    after = await client.list_tasks(a2a.ListTasksRequest(page_size=100))
    await client.close()
    assert [t.id for t in after.tasks] == [t.id for t in before.tasks]  # no task, no turn was started
    assert canary.got == []


async def test_grpc_binding(mesh: Mesh, receiver: Receiver, unique: str) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key, TransportProtocol.GRPC)
    stream = client.send_message(text_message("count"))
    task_id = (await anext(stream)).task.id
    path = f"/hooks/{unique}/grpc"
    await client.create_task_push_notification_config(
        a2a.TaskPushNotificationConfig(task_id=task_id, id="g", url=receiver.url + path, token=TOKEN)
    )
    with pytest.raises(Exception) as refused:
        await client.create_task_push_notification_config(
            a2a.TaskPushNotificationConfig(task_id=task_id, id="x", url="http://169.254.169.254/latest")
        )
    assert "AGENTMESH_A2A__PUSH_ALLOWED_URLS" in str(refused.value)
    [r async for r in stream]
    hits = await receiver.wait_for(lambda got: "TASK_STATE_COMPLETED" in states(got, path))
    assert states(hits, path) == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
    # gRPC calls have no Host: the JWT's issuer is the gateway's configured address
    hit = next(h for h in hits if h["path"] == path)
    assert hit["headers"]["x-a2a-notification-token"] == TOKEN
    await client.close()


async def test_a_receiver_that_is_down_gets_it_once_back(
    mesh: Mesh, down_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agentmesh.gateway.a2a.push")
    url = f"http://127.0.0.1:{down_port}/late"
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, streaming=False)
    request = text_message("while you were out")
    request.configuration.task_push_notification_config.CopyFrom(a2a.TaskPushNotificationConfig(url=url))
    (answer,) = [r async for r in client.send_message(request)]
    await client.close()
    task_id = answer.task.id
    # the receiver is down (connection refused): the gateway retries...
    await wait_until(
        lambda: any(
            r.getMessage() == "push notification retried" and getattr(r, "task_id", "") == task_id
            for r in caplog.records
        )
    )
    back = Receiver()
    app = Starlette(routes=[Route("/{path:path}", back.hook, methods=["POST"])])
    back.server = await embedded_http.serve(app, port=down_port)  # ...and it comes back
    try:
        hits = await back.wait_for(lambda got: "TASK_STATE_COMPLETED" in states(got, "/late"))
    finally:
        await back.server.stop()
    assert states(hits, "/late") == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
    await verify_jwt(mesh, hits[-1], url)


async def test_a_config_set_at_another_replica(mesh: Mesh, receiver: Receiver, unique: str) -> None:
    """The task runs on one gateway, its config is set at another: that one follows the task's buffer
    and pushes, signed with its own key (its own JWKS)."""
    other = await embedded_http.serve(create_app(mesh.settings), **http_limits())
    other_url = f"http://127.0.0.1:{other.port}"
    try:
        runner = await sdk_client(f"{mesh.url}/a2a/streamer", mesh.api_key)
        stream = runner.send_message(text_message("count"))
        task_id = (await anext(stream)).task.id
        path = f"/hooks/{unique}/replica"
        setter = await sdk_client(f"{other_url}/a2a/streamer", mesh.api_key)
        await setter.create_task_push_notification_config(
            a2a.TaskPushNotificationConfig(task_id=task_id, id="r", url=receiver.url + path, token=TOKEN)
        )
        await setter.close()
        [r async for r in stream]
        await runner.close()
        hits = await receiver.wait_for(lambda got: "TASK_STATE_COMPLETED" in states(got, path))
        assert states(hits, path) == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]
        last = [h for h in hits if h["path"] == path][-1]
        async with httpx.AsyncClient() as http:
            jwks = (await http.get(f"{other_url}/.well-known/jwks.json")).json()
        token = last["headers"]["authorization"].removeprefix("Bearer ")
        key = jwt.PyJWKSet.from_dict(jwks)[jwt.get_unverified_header(token)["kid"]].key
        claims = jwt.decode(token, key, algorithms=["RS256"], audience=receiver.url + path, issuer=other_url)
        assert claims["task_id"] == task_id
    finally:
        await other.stop()
