"""Push notifications of a remote task we called (docs/a2a.md#push-notifications-of-remote-tasks): the
client half. Instead of holding a stream open to the remote agent, the runtime gives it a push config
naming our gateway's receiver (`POST {receiver}/<id>`, gateway/a2a/push_receiver.py) with a fresh
secret token, and waits for the notifications the receiver hands over through the stream service: the
buffer `push:<id>`, created here with what the receiver checks (the token's hash, the URL it answers
at, the remote's JWKS) and followed until the task ends. With no notification for a while the task is
read with GetTask, so a missed notification never hangs a turn (the caller's deadline bounds it all).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlsplit

from a2a.types import a2a_pb2 as a2a

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.a2a import PUSH_AUDIENCE, PUSH_JWKS_URL, PUSH_TOKEN_SHA256, parse_push_notification
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Cancelled, MeshError, rpc
from agentmesh.libs.ids import push_key
from agentmesh.stream.v1 import stream_service_pb2 as ss

log = logging.getLogger(__name__)
JWKS_PATH = "/.well-known/jwks.json"  # where an agentmesh gateway serves its keys (push_signing.py)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def jwks_url(agent_base: str) -> str:
    """The JWKS of the agent at `agent_base`: at its origin's /.well-known/jwks.json."""
    parts = urlsplit(agent_base)
    return f"{parts.scheme}://{parts.netloc}{JWKS_PATH}"


class PushInbox:
    """The notifications of one remote task, at our receiver. `config()` is what the remote is given;
    `responses(get_task)` yields every notification (and a GetTask after each quiet `poll_s`) until the
    reader stops; `close()` drops the buffer."""

    def __init__(self, clients: Clients, receiver_url: str, remote_base: str) -> None:
        self.clients = clients
        self.id = uuid.uuid4().hex
        self.token = secrets.token_urlsafe(32)
        self.url = f"{receiver_url.rstrip('/')}/{self.id}"
        self.key = push_key(self.id)
        self.jwks_url = jwks_url(remote_base)
        settings = clients.settings
        self.poll_s = min(settings.a2a.push_poll_s, settings.stream.lease_s / 2)  # renews the buffer too
        self.timeout_s = settings.rpc_timeout_s
        self.notifications = 0

    def config(self) -> a2a.TaskPushNotificationConfig:
        return a2a.TaskPushNotificationConfig(id="agentmesh", url=self.url, token=self.token)

    async def open(self) -> None:
        """The buffer the receiver appends to (also after it was closed: replaced)."""
        metadata = {
            PUSH_TOKEN_SHA256: token_digest(self.token),
            PUSH_AUDIENCE: self.url,
            PUSH_JWKS_URL: self.jwks_url,
        }
        create = ss.CreateStreamRequest(key=self.key, metadata=metadata)
        await rpc(self.clients.stream.CreateStream(create, timeout=self.timeout_s))

    async def responses(
        self, get_task: Callable[[], Awaitable[a2a.Task]]
    ) -> AsyncIterator[a2a.StreamResponse]:
        offset = ""
        while True:
            follow = self.clients.follows.follow(self.key, offset, int(self.poll_s * 1000))
            try:
                async for event in follow:
                    if event.HasField("remote_push_notification"):
                        offset = event.offset
                        try:
                            response = parse_push_notification(event.remote_push_notification.body_json)
                        except ValueError:
                            continue  # the receiver checked it; nothing to take from it
                        self.notifications += 1
                        yield response
                    elif event.HasField("error"):  # quiet for poll_s (idle timeout), or the buffer ended
                        if event.error.code != ev.ERROR_CODE_IDLE_TIMEOUT:
                            await self.open()
                            offset = ""
                        break
            except Cancelled:
                raise
            except MeshError as err:  # the buffer is gone (lease, restart): a fresh one, then a poll
                log.info("push inbox reopened", extra={"key": self.key, "reason": err.reason})
                await self.open()
                offset = ""
            finally:
                follow.cancel()
            renew = ss.RenewStreamsRequest(keys=[self.key])
            with identity.acting_as(""):  # leases are the mesh's own business (as the sink's)
                await rpc(self.clients.stream.RenewStreams(renew, timeout=self.timeout_s))
            yield a2a.StreamResponse(task=await get_task())

    async def close(self) -> None:
        """Best effort: the buffer goes (a late notification then finds no receiver: 404)."""
        try:
            drop = ss.DeleteStreamsRequest(keys=[self.key])
            await rpc(self.clients.stream.DeleteStreams(drop, timeout=self.timeout_s))
        except MeshError:
            pass
