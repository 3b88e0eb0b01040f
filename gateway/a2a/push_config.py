"""Push notification configs of the tasks we serve (docs/a2a.md, "Push notifications"): the a2a-sdk's
in-memory PushNotificationConfigStore, per gateway process, with the owner taken from the verified
caller (the user of the API key), and every URL checked against AGENTMESH_A2A__PUSH_ALLOWED_URLS before
it is stored. A stored config starts the task's dispatch on this gateway (`on_set`); the task's configs
are dropped when its dispatch ends with the task (`forget`), so memory holds those of running tasks."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from a2a.server.context import ServerCallContext
from a2a.server.tasks import InMemoryPushNotificationConfigStore
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import InvalidParamsError

from agentmesh.libs import identity

SETTING = "AGENTMESH_A2A__PUSH_ALLOWED_URLS"
MAX_URL_CHARS = 2048
MAX_TOKEN_CHARS = 1024
MAX_CONFIGS_PER_TASK = 10
DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin_path(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path) of an http(s) URL without credentials, or None. A path with dot
    segments (also percent-encoded) or backslashes is refused: the HTTP client or the receiver would
    resolve it to another path than the one checked."""
    if "\\" in url or any(ord(c) < 33 for c in url):
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname or parts.username or parts.password:
        return None
    path = parts.path or "/"
    if any(segment in (".", "..") for segment in unquote(path).split("/")):
        return None
    return scheme, parts.hostname.lower(), port or DEFAULT_PORTS[scheme], path


def url_allowed(url: str, allowed: list[str]) -> bool:
    """Whether `url` is one the allow-list names: the same scheme, host and port as an entry, and its
    path the entry's or under it (by whole segments: `/hooks` allows `/hooks/x`, not `/hooksx`)."""
    target = _origin_path(url)
    if target is None:
        return False
    path = target[3]
    for entry in allowed:
        prefix = _origin_path(entry)
        if prefix is None or prefix[:3] != target[:3]:
            continue
        base = prefix[3].rstrip("/")
        if path == prefix[3] or path == base or path.startswith(base + "/"):
            return True
    return False


def check_config(config: a2a.TaskPushNotificationConfig, allowed: list[str]) -> None:
    """InvalidParamsError for a config this gateway will not call: a URL the allow-list does not name,
    or fields over their bounds."""
    url = config.url
    if not url:
        raise InvalidParamsError(message="the push notification config has no url")
    if len(url) > MAX_URL_CHARS:
        raise InvalidParamsError(
            message=f"the push notification url is longer than {MAX_URL_CHARS} characters"
        )
    if len(config.token) > MAX_TOKEN_CHARS:
        raise InvalidParamsError(
            message=f"the push notification token is longer than {MAX_TOKEN_CHARS} characters"
        )
    if not allowed:
        raise InvalidParamsError(message=f"push notifications are off: {SETTING} allows no URL")
    if not url_allowed(url, allowed):
        raise InvalidParamsError(message=f"push notification url {url[:200]!r} is not allowed by {SETTING}")


def caller(context: ServerCallContext) -> str:
    """The owner of a config: the verified user of the call (never a field of the request)."""
    principal = identity.current()
    return principal.user if principal is not None else ""


class MeshPushConfigStore(InMemoryPushNotificationConfigStore):
    def __init__(
        self, allowed: list[str], on_set: Callable[[str, ServerCallContext], None] | None = None
    ) -> None:
        super().__init__(owner_resolver=caller)
        self.allowed = allowed
        self.on_set = on_set

    def forget(self, task_id: str) -> None:
        """Drops every config of `task_id` (its dispatch ended: the task did), whoever set it."""
        with self.lock:
            for owner, tasks in list(self._push_notification_infos.items()):
                tasks.pop(task_id, None)
                if not tasks:
                    del self._push_notification_infos[owner]

    async def set_info(
        self, task_id: str, notification_config: a2a.TaskPushNotificationConfig, context: ServerCallContext
    ) -> a2a.TaskPushNotificationConfig:
        check_config(notification_config, self.allowed)
        mine = await self.get_info(task_id, context)
        replaces = notification_config.id in {c.id for c in mine} or (
            not notification_config.id and task_id in {c.id for c in mine}
        )
        if len(mine) >= MAX_CONFIGS_PER_TASK and not replaces:
            raise InvalidParamsError(
                message=f"a task takes at most {MAX_CONFIGS_PER_TASK} push notification configs"
            )
        stored = await super().set_info(task_id, notification_config, context)
        if self.on_set is not None:
            self.on_set(task_id, context)
        return stored
