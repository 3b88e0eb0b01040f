"""Calling an A2A agent of another mesh or organisation, with the official a2a-sdk client.

`RemoteAgent(url, token)` is one remote agent: `url` is its card's URL (or the agent's base URL, the
card then at `<url>/.well-known/agent-card.json`), `token` the Bearer credential its card asks for.
`call(text, ...)` discovers the card, streams the task when the agent streams (else one SendMessage),
reports each text chunk and the remote task as they come, and returns a `RemoteReply`; every failure is
a MeshError of the one table: the card unreachable or the agent gone mid-reply `Unavailable`, a refused
credential `Unauthenticated`, the deadline `DeadlineExceeded`, the remote task failed `RemoteFailed`,
canceled `Cancelled`. Cancelling the call sends CancelTask to the remote agent.

Given a push inbox (`a2a_push.PushInbox`, docs/a2a.md#push-notifications-of-remote-tasks) and an agent
whose card says `pushNotifications`, the message is sent without a stream (SendMessage returning at
once, with the inbox's push config) and the task is followed through its notifications and GetTask;
a remote that refuses the config before taking the task is called over the stream instead. Both ways
feed the same loop (`_follow`): the task's text, states and usage are read alike.

`call_remote_agent(base_url, slug, token, text)` is the short form for another agentmesh gateway (a
registered peer): its agent `slug` answers at `{base_url}/a2a/{slug}`.

Only the card's own origin is contacted: interfaces of the card that name another host are ignored
(a card cannot send our credential elsewhere), and redirects are not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import grpc
import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.auth import AuthInterceptor
from a2a.client.auth.credentials import CredentialService
from a2a.client.card_resolver import A2ACardResolver
from a2a.client.client import Client
from a2a.client.errors import A2AClientError, A2AClientTimeoutError
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH, TransportProtocol
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    InvalidParamsError,
    InvalidRequestError,
    PushNotificationNotSupportedError,
    TaskNotFoundError,
)

from agentmesh.libs import telemetry
from agentmesh.libs.a2a import DEPTH_KEY, FINAL_A2A_STATES, TRACEPARENT_KEY, USAGE_KEY, agent_url
from agentmesh.libs.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    MeshError,
    NotFound,
    RemoteFailed,
    Unauthenticated,
    Unavailable,
)

if TYPE_CHECKING:
    from agentmesh.services.agent_runtime.a2a_push import PushInbox

OnText = Callable[[str], Awaitable[None] | None]
OnTask = Callable[[str, str], Awaitable[None] | None]  # (remote task id, remote context id)
CANCEL_TIMEOUT_S = 5.0
log = logging.getLogger(__name__)


@dataclass
class RemoteReply:
    text: str
    task_id: str
    context_id: str
    agent_name: str
    host: str  # host[:port] of the remote agent: where its trace (context) lives
    input_tokens: int = 0
    output_tokens: int = 0
    states: list[int] = field(default_factory=list)
    pushed: bool = False  # followed through push notifications (no stream held open)


class _Token(CredentialService):
    def __init__(self, token: str) -> None:
        self.token = token

    async def get_credentials(
        self, security_scheme_name: str, context: ClientCallContext | None
    ) -> str | None:
        return self.token or None


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url if "://" in url else f"grpc://{url}")
    return (parts.hostname or "").lower(), str(parts.port or "")


def _error(exc: BaseException, what: str) -> MeshError:
    """An a2a-sdk client failure as one of our errors (by its cause: HTTP status, network, gRPC code)."""
    if isinstance(exc, MeshError):
        return exc
    if isinstance(exc, A2AClientTimeoutError | TimeoutError | httpx.TimeoutException):
        return DeadlineExceeded(f"{what}: no answer in time")
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, httpx.HTTPStatusError):
            status = cause.response.status_code
            if status in (401, 403):
                return Unauthenticated(f"{what}: the remote agent refused our credentials (HTTP {status})")
            if status == 404:
                return NotFound(f"{what}: no such agent (HTTP 404)")
            return Unavailable(f"{what}: HTTP {status}")
        if isinstance(cause, httpx.RequestError):
            return Unavailable(f"{what}: unreachable ({type(cause).__name__})")
        if isinstance(cause, grpc.aio.AioRpcError):
            if cause.code() == grpc.StatusCode.UNAUTHENTICATED:
                return Unauthenticated(f"{what}: the remote agent refused our credentials")
            if cause.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return DeadlineExceeded(f"{what}: no answer in time")
            return Unavailable(f"{what}: {cause.code().name} {cause.details()}")
        cause = cause.__cause__
    text = str(exc)
    if "UNAUTHENTICATED" in text or "HTTP Error 401" in text:
        return Unauthenticated(f"{what}: the remote agent refused our credentials")
    if isinstance(exc, A2AError) and not isinstance(exc, A2AClientError):  # the remote's own answer
        if isinstance(exc, TaskNotFoundError):
            return NotFound(f"{what}: {text}")
        if isinstance(exc, InvalidParamsError | InvalidRequestError | ContentTypeNotSupportedError):
            return InvalidArgument(f"{what}: {text}")
        return RemoteFailed(f"{what}: {text or type(exc).__name__}")
    return Unavailable(f"{what}: {text or type(exc).__name__}")


CARD_TTL_S = 30.0
_cards: dict[tuple[str, str], tuple[float, a2a.AgentCard]] = {}
_http: dict[int, httpx.AsyncClient] = {}


def _client() -> httpx.AsyncClient:
    """One HTTP client per event loop for every remote agent (its connections pooled; building a
    client costs tens of milliseconds). Timeouts are per call; redirects are never followed."""
    loop = id(asyncio.get_running_loop())
    http = _http.get(loop)
    if http is None or http.is_closed:
        http = _http[loop] = httpx.AsyncClient(timeout=60.0, follow_redirects=False)
    return http


class RemoteAgent:
    def __init__(
        self, url: str, token: str = "", *, timeout_s: float = 60.0, push: PushInbox | None = None
    ) -> None:
        base = url.split("?", 1)[0].rstrip("/")
        if base.endswith(AGENT_CARD_WELL_KNOWN_PATH):
            base = base[: -len(AGENT_CARD_WELL_KNOWN_PATH)]
        self.url = url
        self.base = base
        self.token = token
        self.timeout_s = timeout_s
        self.host, self.port = _origin(base)
        self.card: a2a.AgentCard | None = None
        self.push = push

    @property
    def authority(self) -> str:
        """host[:port] of the agent (the home of the traces it keeps)."""
        return f"{self.host}:{self.port}" if self.port else self.host

    async def discover(self, http: httpx.AsyncClient) -> a2a.AgentCard:
        """The agent's card, with only the interfaces at the card's own origin (kept CARD_TTL_S)."""
        key = (self.base, self.token)
        hit = _cards.get(key)
        if hit is not None and hit[0] > time.monotonic():
            self.card = a2a.AgentCard()
            self.card.CopyFrom(hit[1])
            return self.card
        kwargs: dict[str, object] = {"timeout": min(self.timeout_s, 10.0)}
        if self.token:
            kwargs["headers"] = {"Authorization": f"Bearer {self.token}"}
        try:
            card = await A2ACardResolver(http, self.base).get_agent_card(http_kwargs=kwargs)
        except Exception as exc:
            raise _error(exc, f"agent card at {self.base}") from exc
        same = [i for i in card.supported_interfaces if _origin(i.url)[0] == self.host]
        if not same:
            raise Unavailable(f"agent card at {self.base} names no interface on {self.host}")
        del card.supported_interfaces[:]
        card.supported_interfaces.extend(same)
        if len(_cards) > 1000:
            _cards.clear()
        _cards[key] = (time.monotonic() + CARD_TTL_S, card)
        self.card = card
        return card

    async def resolve(self) -> a2a.AgentCard:
        """The card (fetched once)."""
        if self.card is None:
            await self.discover(_client())
        assert self.card is not None
        return self.card

    async def call(
        self,
        text: str,
        *,
        on_text: OnText | None = None,
        on_task: OnTask | None = None,
        context_id: str = "",
        depth: int = 0,
    ) -> RemoteReply:
        """Sends `text` as a new task (in `context_id`'s conversation when given) and follows it to its
        end; cancelling this call cancels the remote task."""
        http = _client()
        card = self.card or await self.discover(http)
        push = self.push if self.push is not None and card.capabilities.push_notifications else None
        reply = RemoteReply("", "", "", card.name, self.authority)
        message = _message(text, context_id, depth)
        if push is not None:
            try:
                await self._run(http, card, message, reply, on_text, on_task, push)
                return reply
            except _PushRefused as refused:
                log.info("push refused, streaming", extra={"agent": card.name, "reason": str(refused)})
        await self._run(http, card, message, reply, on_text, on_task, None)
        return reply

    async def _run(
        self,
        http: httpx.AsyncClient,
        card: a2a.AgentCard,
        message: a2a.Message,
        reply: RemoteReply,
        on_text: OnText | None,
        on_task: OnTask | None,
        push: PushInbox | None,
    ) -> None:
        config = ClientConfig(
            httpx_client=http,
            streaming=push is None,
            polling=push is not None,  # SendMessage answers once the task is taken
            supported_protocol_bindings=[TransportProtocol.JSONRPC, TransportProtocol.GRPC],
            use_client_preference=True,
            grpc_channel_factory=grpc.aio.insecure_channel,
        )
        client = ClientFactory(config).create(card, interceptors=[AuthInterceptor(_Token(self.token))])
        try:
            if push is not None:
                await push.open()
            await asyncio.wait_for(
                self._follow(client, message, reply, on_text, on_task, push), self.timeout_s
            )
        except asyncio.CancelledError:
            await self._cancel(client, reply)
            raise
        except TimeoutError as exc:
            await self._cancel(client, reply)
            raise DeadlineExceeded(f"{card.name}: no answer within {self.timeout_s:g} s") from exc
        finally:
            if push is not None:
                await push.close()
            with contextlib.suppress(Exception):
                await client.close()

    async def _responses(
        self, client: Client, message: a2a.Message, push: PushInbox | None, context: ClientCallContext
    ) -> AsyncGenerator[a2a.StreamResponse, None]:
        """The remote task's events: its stream, or (with push) SendMessage's answer, then its
        notifications and GetTask's answers."""
        request = a2a.SendMessageRequest(message=message)
        if push is None:
            async for response in client.send_message(request, context=context):
                yield response
            return
        request.configuration.task_push_notification_config.CopyFrom(push.config())
        task_id = ""
        try:
            async for response in client.send_message(request, context=context):
                task_id = _ids_and_status(response)[0]
                yield response
        except (InvalidParamsError, PushNotificationNotSupportedError) as exc:
            if not task_id:  # refused before a task was taken: nothing runs there
                raise _PushRefused(str(exc)) from exc
            raise
        if not task_id:
            return

        async def get_task() -> a2a.Task:
            return await client.get_task(a2a.GetTaskRequest(id=task_id), context=context)

        async for response in push.responses(get_task):
            if _ids_and_status(response)[0] in ("", task_id):  # another task's: not for this call
                yield response

    async def _follow(
        self,
        client: Client,
        message: a2a.Message,
        reply: RemoteReply,
        on_text: OnText | None,
        on_task: OnTask | None,
        push: PushInbox | None,
    ) -> None:
        headers = telemetry.headers()
        context = ClientCallContext(service_parameters=dict(headers), timeout=self.timeout_s)
        chunks: list[str] = []
        final: a2a.TaskStatus | None = None
        name = reply.agent_name

        async def add(text: str) -> None:
            chunks.append(text)
            if on_text is not None:
                await _maybe(on_text(text))

        responses = self._responses(client, message, push, context)
        try:
            async for response in responses:
                task_id, ctx_id, status = _ids_and_status(response)
                if task_id and not reply.task_id:
                    reply.task_id, reply.context_id = task_id, ctx_id
                    reply.pushed = push is not None
                    if on_task is not None:
                        await _maybe(on_task(task_id, ctx_id))
                if response.HasField("artifact_update"):
                    for part in response.artifact_update.artifact.parts:
                        if part.text:
                            await add(part.text)
                    _usage(response.artifact_update.metadata, reply)
                if response.HasField("task"):  # the reply so far is in its artifacts: what is new of it
                    so_far, whole = "".join(chunks), _artifact_text(response.task)
                    if len(whole) > len(so_far) and whole.startswith(so_far):
                        await add(whole[len(so_far) :])
                    _usage(response.task.metadata, reply)
                if response.HasField("message"):  # a message-only answer
                    for part in response.message.parts:
                        if part.text:
                            await add(part.text)
                    final = a2a.TaskStatus(state=a2a.TASK_STATE_COMPLETED)
                if status is not None:
                    if not reply.states or reply.states[-1] != status.state or push is None:
                        reply.states.append(status.state)
                    if response.HasField("status_update"):
                        _usage(response.status_update.metadata, reply)
                    if status.state in FINAL_A2A_STATES:
                        final = status
                if final is not None:
                    break
        except (MeshError, _PushRefused):
            raise
        except Exception as exc:
            raise _error(exc, name) from exc
        finally:
            await responses.aclose()
        reply.text = "".join(chunks)
        if final is None:
            raise Unavailable(f"{name} went away before its task ended")
        if final.state == a2a.TASK_STATE_CANCELED:
            raise Cancelled(f"{name} canceled the task: {_status_text(final)}")
        if final.state != a2a.TASK_STATE_COMPLETED:
            raise RemoteFailed(f"{name} failed: {_status_text(final) or a2a.TaskState.Name(final.state)}")

    async def _cancel(self, client: Client, reply: RemoteReply) -> None:
        """Best effort, bounded: the remote task is told to stop."""
        if not reply.task_id:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.shield(client.cancel_task(a2a.CancelTaskRequest(id=reply.task_id))), CANCEL_TIMEOUT_S
            )


async def call_remote_agent(
    base_url: str,
    slug: str,
    token: str,
    text: str,
    *,
    on_text: OnText | None = None,
    on_task: OnTask | None = None,
    context_id: str = "",
    depth: int = 0,
    timeout_s: float = 60.0,
) -> RemoteReply:
    """Agent `slug` of the agentmesh gateway at `base_url` (a registered peer), called over A2A with
    `token` as Bearer: its reply, or a MeshError (see the module)."""
    agent = RemoteAgent(agent_url(base_url, slug), token, timeout_s=timeout_s)
    return await agent.call(text, on_text=on_text, on_task=on_task, context_id=context_id, depth=depth)


class _PushRefused(Exception):
    """The remote agent refused our push config before it took the task."""


def _message(text: str, context_id: str, depth: int) -> a2a.Message:
    message = a2a.Message(
        message_id=uuid.uuid4().hex,
        role=a2a.ROLE_USER,
        parts=[a2a.Part(text=text)],
        context_id=context_id,
    )
    message.metadata.update({DEPTH_KEY: depth})
    headers = telemetry.headers()
    if TRACEPARENT_KEY in headers:
        message.metadata.update({TRACEPARENT_KEY: headers[TRACEPARENT_KEY]})
    return message


def _artifact_text(task: a2a.Task) -> str:
    return "".join(part.text for artifact in task.artifacts for part in artifact.parts if part.text)


def _ids_and_status(response: a2a.StreamResponse) -> tuple[str, str, a2a.TaskStatus | None]:
    if response.HasField("task"):
        return response.task.id, response.task.context_id, response.task.status
    if response.HasField("status_update"):
        update = response.status_update
        return update.task_id, update.context_id, update.status
    if response.HasField("artifact_update"):
        return response.artifact_update.task_id, response.artifact_update.context_id, None
    return "", "", None


def _usage(metadata: object, reply: RemoteReply) -> None:
    fields = getattr(metadata, "fields", {})
    if USAGE_KEY not in fields:
        return
    usage = fields[USAGE_KEY].struct_value.fields
    reply.input_tokens = int(usage["inputTokens"].number_value) if "inputTokens" in usage else 0
    reply.output_tokens = int(usage["outputTokens"].number_value) if "outputTokens" in usage else 0


def _status_text(status: a2a.TaskStatus) -> str:
    return " ".join(p.text for p in status.message.parts if p.text)


async def _maybe(result: Awaitable[None] | None) -> None:
    if result is not None:
        await result
