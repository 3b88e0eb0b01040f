"""Every id grammar of the mesh, in one place: local ids, stream keys and trace references.

- A local id (trace, task, subagent): 1-64 characters of [A-Za-z0-9_.-], not starting with "." or "-".
- An agent's slug: 1-100 characters of [a-z0-9_-], not starting with "_" or "-".
- A message id: a random positive integer below 2**53 (exact in JavaScript), so that ids say
  nothing about how many messages exist and the owner of a turn names its messages before storing
  them (docs/design/turns.md).
- A stream key: `trace:<trace id>`, `a2a:<task id>` or `subagent:<subagent id>`.
- A trace reference says where a trace lives (docs/requirements.md#trace-ids):
  `abc-123` (here), `agent://host[:port]/abc-123` (on the mesh at that address), or
  `@alias/abc-123` (on a peer registered under that alias).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
import uuid
from dataclasses import dataclass

from agentmesh.libs.errors import InvalidArgument

MAX_ID = 64
MAX_MESSAGE_ID = 2**53  # exclusive: message ids are exact as JSON numbers
MAX_REF = 300
LOCAL_ID_PATTERN = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"  # also what the gateway's OpenAPI document states
SLUG_PATTERN = r"[a-z0-9][a-z0-9_-]{0,99}"  # an agent's slug (services/trace/agents.py, the gateway)
_LOCAL = re.compile(LOCAL_ID_PATTERN)
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
SCHEME = "agent://"


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for an error message, at most about `limit` characters however it escapes."""
    quoted = repr(text[:limit])
    return quoted if len(quoted) <= limit else quoted[: limit - 3] + "..."


def new_id() -> str:
    """A fresh random id (a UUID): traces, tasks."""
    return str(uuid.uuid4())


def new_message_id() -> int:
    """A fresh random message id in [1, 2**53)."""
    return secrets.randbelow(MAX_MESSAGE_ID - 1) + 1


def new_token_id() -> str:
    """A fresh random id that cannot be enumerated, shorter than a UUID: subagents."""
    return secrets.token_hex(12)


def is_local_id(value: str) -> bool:
    return bool(_LOCAL.fullmatch(value))


def check_local_id(value: str, what: str = "id") -> str:
    if not is_local_id(value):
        raise InvalidArgument(f"{what} must be 1-{MAX_ID} characters of [A-Za-z0-9_.-]: {shown(value, 80)}")
    return value


# ---- stream keys -----------------------------------------------------------------------------------

STREAM_KINDS = ("trace", "a2a", "subagent", "push")


@dataclass(frozen=True)
class StreamKey:
    kind: str  # trace | a2a | subagent
    id: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


def trace_key(trace_id: str) -> str:
    return f"trace:{trace_id}"


def a2a_key(task_id: str) -> str:
    return f"a2a:{task_id}"


def subagent_key(subagent_id: str) -> str:
    return f"subagent:{subagent_id}"


def push_key(receiver_id: str) -> str:
    """The buffer of a remote task's push notifications (docs/a2a.md#push-notifications-of-remote-tasks)."""
    return f"push:{receiver_id}"


def parse_stream_key(key: str) -> StreamKey:
    """`trace|a2a|subagent|push:<local id>`, or InvalidArgument."""
    kind, sep, ident = key.partition(":")
    if not sep or kind not in STREAM_KINDS:
        raise InvalidArgument(
            f"invalid stream key {shown(key, 80)}: expected trace:<id>, a2a:<id>, subagent:<id> or push:<id>"
        )
    if not is_local_id(ident):
        raise InvalidArgument(
            f"invalid stream key {shown(key, 80)}: the id must be 1-{MAX_ID} of [A-Za-z0-9_.-]"
        )
    return StreamKey(kind, ident)


# ---- trace references ------------------------------------------------------------------------------


def _host(text: str) -> str:
    """A DNS name, an IPv4 address or a bracketed IPv6 address, lower-cased; InvalidArgument otherwise."""
    if text.startswith("["):
        if not text.endswith("]"):
            raise InvalidArgument("an IPv6 host must be in brackets")
        try:
            return f"[{ipaddress.IPv6Address(text[1:-1]).compressed}]"
        except ValueError as exc:
            raise InvalidArgument(f"invalid IPv6 host {shown(text, 60)}") from exc
    if not text or len(text) > 253:
        raise InvalidArgument("the host must be 1-253 characters")
    labels = text.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidArgument(f"invalid host {shown(text, 60)}")
    if all(label.isdigit() for label in labels):
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError as exc:
            raise InvalidArgument(f"invalid IPv4 host {shown(text, 60)}") from exc
    return text.lower()


@dataclass(frozen=True)
class TraceRef:
    """Where a trace lives and its id there. Exactly one of: local (no host, no alias), `host` (with an
    optional port), `alias` (a registered peer)."""

    id: str
    host: str = ""
    port: int = 0
    alias: str = ""

    def __post_init__(self) -> None:
        check_local_id(self.id, "trace id")
        if self.host and self.alias:
            raise InvalidArgument("a trace reference names a host or an alias, not both")
        if self.port and not self.host:
            raise InvalidArgument("a port needs a host")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument("the port must be 1-65535")
        if self.alias and not _ALIAS.fullmatch(self.alias):
            raise InvalidArgument(f"invalid peer alias {shown(self.alias, 60)}")
        if self.host and _host(self.host) != self.host:
            raise InvalidArgument(f"invalid host {shown(self.host, 60)}")

    @property
    def is_local(self) -> bool:
        return not self.host and not self.alias

    @property
    def authority(self) -> str:
        """`host[:port]` of a full reference ("" otherwise)."""
        if not self.host:
            return ""
        return f"{self.host}:{self.port}" if self.port else self.host

    def __str__(self) -> str:
        if self.host:
            return f"{SCHEME}{self.authority}/{self.id}"
        if self.alias:
            return f"@{self.alias}/{self.id}"
        return self.id

    @classmethod
    def parse(cls, text: str) -> TraceRef:
        """Parses any of the three forms; InvalidArgument (with the reason) for anything else."""
        if not isinstance(text, str) or not text:
            raise InvalidArgument("a trace id is required")
        if len(text) > MAX_REF:
            raise InvalidArgument(f"a trace id is at most {MAX_REF} characters")
        if text.startswith(SCHEME):
            authority, sep, ident = text[len(SCHEME) :].partition("/")
            if not sep:
                raise InvalidArgument("agent:// ids need a path: agent://host[:port]/id")
            if "@" in authority:
                raise InvalidArgument("agent:// ids may not carry user information")
            host, port = authority, 0
            if not authority.endswith("]") and ":" in authority:
                host, _, port_text = authority.rpartition(":")
                if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
                    raise InvalidArgument(f"invalid port {shown(port_text, 10)}")
                port = int(port_text)
                if not 1 <= port <= 65535:
                    raise InvalidArgument("the port must be 1-65535")
            if not is_local_id(ident):
                raise InvalidArgument(f"invalid trace id {shown(ident, 80)} after the host")
            return cls(ident, host=_host(host), port=port)
        if text.startswith("@"):
            alias, sep, ident = text[1:].partition("/")
            if not sep or not _ALIAS.fullmatch(alias):
                raise InvalidArgument("@alias ids look like @peer-name/id")
            if not is_local_id(ident):
                raise InvalidArgument(f"invalid trace id {shown(ident, 80)} after the alias")
            return cls(ident, alias=alias)
        if not is_local_id(text):
            raise InvalidArgument(
                f"invalid trace id {shown(text, 80)}: expected id, agent://host[:port]/id or @alias/id"
            )
        return cls(text)
