"""Push notifications of the tasks we serve (docs/a2a.md, "Push notifications"), with the a2a-sdk's
parts: its request handler's push config methods (set, get, list, delete: owner-scoped, because our
TaskStore answers another user's task like a missing one), our PushNotificationConfigStore
(`push_config.py`) and our PushNotificationSender (`PushDelivery`).

A task with a config is followed here, on the gateway that took the config (`PushDispatch`): from its
buffer `a2a:<task id>`, so the task is pushed whichever replica or call runs it, also after the client
that started it went away. Each change of the task's state is one POST of the task (a StreamResponse
holding it: its status and the reply so far) to every config of the task, in order, each retried with
backoff while the receiver is down or answers 5xx/408/429, signed with a JWT (`push_signing.py`) and
with the config's token in `X-A2A-Notification-Token`. Only allow-listed URLs are called; redirects are
not followed; each POST is bounded in time and in the answer read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import httpx
from a2a.server.context import ServerCallContext
from a2a.server.tasks import PushNotificationSender
from a2a.server.tasks.push_notification_sender import PushNotificationEvent
from a2a.types import a2a_pb2 as a2a
from a2a.utils.proto_utils import to_stream_response
from google.protobuf.json_format import MessageToDict

from agentmesh.gateway.a2a.calls import header
from agentmesh.gateway.a2a.events import to_a2a
from agentmesh.gateway.a2a.push_config import MeshPushConfigStore, check_config, url_allowed
from agentmesh.gateway.a2a.push_signing import PushSigner
from agentmesh.gateway.a2a.store import MeshTaskStore
from agentmesh.libs import events
from agentmesh.libs.a2a import RESPONSE_ARTIFACT, USAGE_KEY, to_a2a_state
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import NotFound
from agentmesh.libs.ids import a2a_key
from agentmesh.libs.retry import with_backoff

log = logging.getLogger(__name__)
TOKEN_HEADER = "X-A2A-Notification-Token"  # the A2A specification's header for the client's token
MAX_ANSWER_BYTES = 64 * 1024  # what is read of a receiver's answer (its status is what counts)
RETRY_STATUS = {408, 429}


class _NotYet(Exception):
    """A push the receiver did not take this time but may take later (no answer, 5xx, 408, 429)."""


class PushDelivery(PushNotificationSender):
    """POSTs an event to every config of its task (the SDK's sender interface)."""

    def __init__(
        self,
        configs: MeshPushConfigStore,
        signer: PushSigner,
        settings: MeshSettings,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.configs = configs
        self.signer = signer
        self.settings = settings.a2a
        self.issuers: dict[str, str] = {}  # task id -> the base URL the config was set at (the JWT's iss)
        self.default_issuer = settings.a2a.public_url.rstrip("/") or (
            f"http://{settings.gateway_host}:{settings.gateway_port}"
        )
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.settings.push_timeout_s),
            follow_redirects=False,
            trust_env=False,  # no proxy from the environment: only the allowed URL is dialled
            headers={"User-Agent": "agentmesh-a2a-push"},
            transport=transport,
        )

    async def send_notification(self, task_id: str, event: PushNotificationEvent) -> None:
        configs = await self.configs.get_info_for_dispatch(task_id)
        if not configs:
            return
        body = json.dumps(MessageToDict(to_stream_response(event)), separators=(",", ":")).encode()
        await asyncio.gather(*(self.deliver(task_id, config, body) for config in configs))

    async def deliver(self, task_id: str, config: a2a.TaskPushNotificationConfig, body: bytes) -> bool:
        """One notification to one receiver, retried with backoff; True once it took it (2xx)."""
        url = config.url
        if not url_allowed(url, self.settings.push_allowed_urls):  # never dialled, whatever was stored
            log.warning("push url not allowed", extra={"task_id": task_id})
            return False

        async def attempt() -> str:
            outcome = await self._post(url, self._headers(task_id, config, body), body)
            if outcome == "retry":
                raise _NotYet
            return outcome

        def retrying(_: _NotYet, delay_s: float) -> None:
            log.info("push notification retried", extra={"task_id": task_id, "delay_s": delay_s})

        try:
            outcome = await with_backoff(
                attempt,
                retry_on=_NotYet,
                retries=self.settings.push_retries,
                delay_s=self.settings.push_backoff_s,
                max_delay_s=self.settings.push_max_backoff_s,
                on_retry=retrying,
            )
        except _NotYet:
            outcome = "retry"
        if outcome == "ok":
            return True
        log.warning("push notification not delivered", extra={"task_id": task_id, "outcome": outcome})
        return False

    def _headers(self, task_id: str, config: a2a.TaskPushNotificationConfig, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if config.token:
            headers[TOKEN_HEADER] = config.token
        auth = config.authentication
        if config.HasField("authentication") and auth.scheme and auth.credentials:
            headers["Authorization"] = f"{auth.scheme} {auth.credentials}"  # the receiver's own scheme
        else:
            issuer = self.issuers.get(task_id, self.default_issuer)
            jwt = self.signer.sign(issuer=issuer, audience=config.url, task_id=task_id, body=body)
            headers["Authorization"] = f"Bearer {jwt}"
        return headers

    async def _post(self, url: str, headers: dict[str, str], body: bytes) -> str:
        """ "ok" (2xx), "retry" (no answer, 5xx, 408, 429) or "final" (any other answer, a redirect too)."""
        try:
            async with asyncio.timeout(self.settings.push_timeout_s):
                async with self.http.stream("POST", url, content=body, headers=headers) as resp:
                    status, read = resp.status_code, 0
                    async for chunk in resp.aiter_raw():
                        read += len(chunk)
                        if read > MAX_ANSWER_BYTES:
                            break
        except (httpx.HTTPError, TimeoutError, OSError):
            return "retry"
        if 200 <= status < 300:
            return "ok"
        if status >= 500 or status in RETRY_STATUS:
            return "retry"
        return "final"

    async def aclose(self) -> None:
        await self.http.aclose()


class PushDispatch:
    """Follows each task with a config on this gateway and pushes its changes of state."""

    def __init__(self, clients: Clients, store: MeshTaskStore, delivery: PushDelivery, idle_ms: int) -> None:
        self.clients = clients
        self.store = store
        self.delivery = delivery
        self.idle_ms = idle_ms
        self.running: dict[str, asyncio.Task[None]] = {}

    def watch(self, task_id: str) -> None:
        """Follows `task_id` (as the calling user: the task copies the caller's identity) unless this
        gateway does already."""
        if task_id in self.running:
            return
        task = asyncio.create_task(self._follow(task_id), name=f"a2a-push:{task_id}")
        self.running[task_id] = task
        task.add_done_callback(lambda _: self._ended(task_id))

    def _ended(self, task_id: str) -> None:
        self.running.pop(task_id, None)
        self.delivery.configs.forget(task_id)
        self.delivery.issuers.pop(task_id, None)

    async def _follow(self, task_id: str) -> None:
        try:
            row = await self.store.row(task_id, None)
            if row is None:
                return
            await self._push_changes(row.id, row.trace_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("push dispatch failed", extra={"task_id": task_id})

    async def _push_changes(self, task_id: str, trace_id: str) -> None:
        task = a2a.Task(id=task_id, context_id=trace_id)
        reply: list[str] = []
        last = a2a.TASK_STATE_UNSPECIFIED
        follow = self.clients.follows.follow(a2a_key(task_id), "", self.idle_ms)
        try:
            async for event in follow:
                out = to_a2a(event, task_id, trace_id)
                if isinstance(out, a2a.TaskArtifactUpdateEvent):
                    reply.extend(p.text for p in out.artifact.parts)
                elif isinstance(out, a2a.TaskStatusUpdateEvent):
                    if USAGE_KEY in out.metadata.fields:  # the finish's usage: in the task from then on
                        task.metadata.fields[USAGE_KEY].CopyFrom(out.metadata.fields[USAGE_KEY])
                    if out.status.state != last:
                        last = out.status.state
                        task.status.CopyFrom(out.status)
                        await self.delivery.send_notification(task_id, _with_reply(task, reply))
                if events.is_terminal(event):
                    return
        except NotFound:
            # The buffer is gone (expired): the task as stored, if that is news.
            row = await self.store.row(task_id, None)
            if row is not None and to_a2a_state(row.state) != last:
                stored = await self.store.to_a2a(row, with_messages=True)
                await self.delivery.send_notification(task_id, stored)
        finally:
            follow.cancel()

    async def aclose(self) -> None:
        running = list(self.running.values())
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(BaseException):
                await task
        await self.delivery.aclose()


def _with_reply(task: a2a.Task, reply: list[str]) -> a2a.Task:
    out = a2a.Task()
    out.CopyFrom(task)
    if reply:
        out.artifacts.append(
            a2a.Artifact(
                artifact_id=RESPONSE_ARTIFACT, name="response", parts=[a2a.Part(text="".join(reply))]
            )
        )
    return out


def issuer_of(context: ServerCallContext | None, settings: MeshSettings, fallback: str) -> str:
    """The base URL the client reached us at (the JWKS is under it): the public URL when set, else the
    JSON-RPC request's Host."""
    if settings.a2a.public_url:
        return settings.a2a.public_url.rstrip("/")
    host = header(context, "host") if context is not None and "headers" in context.state else ""
    return f"http://{host}" if host and "/" not in host else fallback


class PushParts:
    """What a request handler needs for push: the config store, the sender, the dispatch, the signer."""

    def __init__(
        self,
        clients: Clients,
        store: MeshTaskStore,
        settings: MeshSettings,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.signer = PushSigner(settings.a2a.push_signing_key_file)
        self.configs = MeshPushConfigStore(settings.a2a.push_allowed_urls, on_set=self.stored)
        self.delivery = PushDelivery(self.configs, self.signer, settings, transport)
        self.dispatch = PushDispatch(clients, store, self.delivery, int(settings.turn_timeout_s * 1000))

    def check_send(self, params: a2a.SendMessageRequest) -> None:
        """A SendMessage's push config is checked before its turn starts (a refused one starts nothing)."""
        if params.configuration.HasField("task_push_notification_config"):
            check_config(
                params.configuration.task_push_notification_config, self.settings.a2a.push_allowed_urls
            )

    def stored(self, task_id: str, context: ServerCallContext | None) -> None:
        """A config of `task_id` was stored: follow the task here."""
        self.delivery.issuers[task_id] = issuer_of(context, self.settings, self.delivery.default_issuer)
        self.dispatch.watch(task_id)


class PushMethods:
    """Mixed into the request handler (before DefaultRequestHandler): a SendMessage's push config is
    checked before its turn starts; closing the handler stops the dispatch."""

    push: PushParts

    async def _setup_active_task(
        self, params: a2a.SendMessageRequest, call_context: ServerCallContext
    ) -> Any:
        self.push.check_send(params)
        return await super()._setup_active_task(params, call_context)  # type: ignore[misc]

    async def aclose(self) -> None:
        await self.push.dispatch.aclose()
        await super().aclose()  # type: ignore[misc]
