"""The peer file's schema (docs/federation.md#the-peer-registry): pydantic models that forbid unknown
keys, so that a misspelt key, an unsupported URL or a key in the file stops the start with the file,
the path of the field and what is expected, instead of loading as "no peers" or "no shared database".

Every shape of docs/requirements.md#peer-registry and #shared-database-mode loads:

    peers: {alias: {url, credential, type, users}}        # or `agents:`, the same mapping
    trace_store: {type: database, url: postgresql://...}  # the flat form: the shared database
    trace_store:
      internal: {type: database, url: postgresql://...}
      external: {type: remote, agents: [{alias?, url, credential, type}]}   # alias: the URL's host

`credential` (also `credential_env`, `api_key_env`) is the NAME of an environment variable; the key
itself never goes in the file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from agentmesh.libs.errors import FailedPrecondition, InvalidArgument
from agentmesh.libs.ids import TraceRef

PEER_TYPES = ("terminal", "cloud", "org")
DEFAULT_PORTS = {"http": 80, "https": 443}
# The databases the trace service speaks (SQLAlchemy's async drivers): the shared database is SQL.
DATABASE_SCHEMES = ("postgresql", "postgres", "postgresql+asyncpg", "sqlite+aiosqlite")
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KEY_IN_FILE = "a key never goes in the file; name its environment variable in `credential`"


class PeerConfigError(ValueError):
    """The peer file is malformed (raised at start: a mesh with a bad registry does not start)."""


@dataclass(frozen=True)
class Peer:
    alias: str
    url: str  # scheme://host[:port], no path, no user information
    credential: str = field(default="", repr=True)  # the environment variable's NAME
    type: str = "cloud"
    # The users of this mesh who may reach the peer (its credential acts for all of them there); empty:
    # every user.
    users: tuple[str, ...] = ()

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @property
    def host(self) -> str:
        return (urlsplit(self.url).hostname or "").lower()

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or DEFAULT_PORTS[parts.scheme]

    def api_key(self, environ: Mapping[str, str] | None = None) -> str:
        """The key, read from the environment at the moment of the call; FailedPrecondition when unset."""
        import os

        env = os.environ if environ is None else environ
        if not self.credential:
            return ""
        value = env.get(self.credential, "")
        if not value:
            raise FailedPrecondition(
                f"peer {self.alias!r}: its credential variable {self.credential} is not set"
            )
        return value

    def ref(self, trace_id: str) -> TraceRef:
        """The location-bearing id of a trace of this peer (the short form)."""
        return TraceRef(trace_id, alias=self.alias)

    def as_json(self) -> dict[str, str]:
        """What `agentmesh peers list` shows: never the secret."""
        return {"alias": self.alias, "url": self.url, "credential": self.credential, "type": self.type}


@dataclass(frozen=True)
class StoreConfig:
    """`trace_store`'s database: the organisation's shared one (docs/requirements.md#shared-database-mode)."""

    internal_url: str = ""


def peer_url(url: str) -> str:
    """A peer's URL in its one spelling; ValueError saying what is expected otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS:
        raise ValueError(f"unsupported scheme {parts.scheme or '(none)'!r}: expected http:// or https://")
    if parts.username is not None or parts.password is not None:
        raise ValueError("expected no user information in the URL (the key goes in `credential`)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("expected scheme://host[:port] only: no path, query or fragment")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError("expected a port between 0 and 65535") from exc
    if not parts.hostname:
        raise ValueError("expected a host")
    host = parts.hostname.lower()
    shown_host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown_host}" + (f":{port}" if port else "")


def check_alias(alias: str) -> str:
    if not _ALIAS.fullmatch(alias):
        raise ValueError(
            f"alias {alias[:70]!r}: expected 1-63 characters of [A-Za-z0-9_.-], not starting with . - or _"
        )
    try:
        TraceRef("x", alias=alias)  # the same alias grammar as the ids
    except InvalidArgument as exc:
        raise ValueError(f"alias {alias!r}: {exc.message}") from exc
    return alias


class Strict(BaseModel):
    """A mapping of the file: an unknown key is an error that lists the keys expected there."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)
    also: ClassVar[tuple[str, ...]] = ()  # other accepted spellings of the fields

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "api_key" in data:
                raise ValueError(KEY_IN_FILE)
            known = set(cls.model_fields) | set(cls.also)
            unknown = sorted(str(k) for k in data if k not in known)
            if unknown:
                raise ValueError(
                    f"unknown key {unknown[0]!r}: expected one of {', '.join(sorted(cls.model_fields))}"
                )
        return data


class PeerSpec(Strict):
    also = ("credential_env", "api_key_env")

    url: str
    credential: str = Field(
        default="", validation_alias=AliasChoices("credential", "credential_env", "api_key_env")
    )
    type: Literal["terminal", "cloud", "org"] = "cloud"
    users: list[str] = Field(default_factory=list)
    alias: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return peer_url(url)

    @field_validator("credential")
    @classmethod
    def _credential(cls, name: str) -> str:
        if name and not _ENV_NAME.fullmatch(name):
            raise ValueError("expected the NAME of an environment variable (letters, digits, _)")
        return name

    @field_validator("users")
    @classmethod
    def _users(cls, users: list[str]) -> list[str]:
        if not all(users):
            raise ValueError("expected a list of user names")
        return users

    def peer(self, alias: str) -> Peer:
        return Peer(check_alias(alias), self.url, self.credential, self.type, tuple(self.users))


def database_url(url: str) -> str:
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in DATABASE_SCHEMES:
        raise ValueError(
            f"unsupported database scheme {scheme or '(none)'!r}: expected one of "
            + ", ".join(f"{s}://" for s in DATABASE_SCHEMES)
        )
    return url


class DatabaseSpec(Strict):
    type: Literal["database"] = "database"
    url: str

    _url = field_validator("url")(database_url)


class ExternalSpec(Strict):
    type: Literal["remote"] = "remote"
    agents: list[PeerSpec] = Field(default_factory=list)


class TraceStoreSpec(Strict):
    """`{type: database, url}` (the flat form) or `{internal, external}`."""

    type: Literal["database"] | None = None
    url: str | None = None
    internal: DatabaseSpec | None = None
    external: ExternalSpec | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        return None if url is None else database_url(url)

    @model_validator(mode="after")
    def _one_form(self) -> TraceStoreSpec:
        flat = self.type is not None or self.url is not None
        if flat and (self.internal is not None or self.external is not None):
            raise ValueError("expected either {type: database, url} or {internal, external}, not both")
        if flat and self.url is None:
            raise ValueError("expected url: the shared database's URL")
        return self

    @property
    def database(self) -> str:
        if self.url is not None:
            return self.url
        return self.internal.url if self.internal is not None else ""


class PeerFileSpec(Strict):
    peers: dict[str, PeerSpec] | None = None
    agents: dict[str, PeerSpec] | None = None
    trace_store: TraceStoreSpec | None = None


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _explain(exc: ValidationError) -> list[str]:
    lines = []
    for e in exc.errors(include_url=False):
        message = str(e["msg"]).removeprefix("Value error, ")
        if e["type"] == "missing":
            message = "required, missing"
        elif e["type"] == "extra_forbidden":
            message = "unknown key"
        elif message.startswith("Input should be"):
            message = "expected " + message.removeprefix("Input should be ")
        lines.append(f"{_where(tuple(e['loc']))}: {message}")
    return lines


def read(data: Any, source: str = "the peer file") -> tuple[list[Peer], StoreConfig]:
    """The peers and the shared database of a parsed peer file; PeerConfigError naming `source`, the
    path of each bad field and what is expected there."""
    if data is None:
        return [], StoreConfig()
    if not isinstance(data, dict):
        raise PeerConfigError(f"{source}: (top level): expected a mapping")
    try:
        spec = PeerFileSpec.model_validate(data)
        peers: list[Peer] = []
        for section, name in ((spec.peers, "peers"), (spec.agents, "agents")):
            for alias, p in (section or {}).items():
                peers.append(_peer(p, alias, f"{name}.{alias}"))
        store = StoreConfig()
        if spec.trace_store is not None:
            store = StoreConfig(internal_url=spec.trace_store.database)
            external = spec.trace_store.external
            for i, p in enumerate(external.agents if external else []):
                # with no alias, the URL's host names it: @partner.example/<id>
                alias = p.alias or urlsplit(p.url).hostname or ""
                peers.append(_peer(p, alias, f"trace_store.external.agents[{i}]"))
    except ValidationError as exc:
        raise PeerConfigError(f"{source}: " + "; ".join(_explain(exc))) from None
    except ValueError as exc:
        raise PeerConfigError(f"{source}: {exc}") from None
    aliases = [peer.alias for peer in peers]
    for alias in aliases:
        if aliases.count(alias) > 1:
            raise PeerConfigError(f"{source}: peer alias {alias!r} is registered twice: expected one each")
    return peers, store


def _peer(spec: PeerSpec, alias: str, where: str) -> Peer:
    try:
        return spec.peer(alias)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def missing_credentials(peers: list[Peer], environ: Mapping[str, str], source: str) -> None:
    """PeerConfigError when a peer's credential variable is not set (the trace service's start)."""
    unset = [p for p in peers if p.credential and not environ.get(p.credential)]
    if unset:
        names = "; ".join(
            f"peer {p.alias!r}: credential: the variable {p.credential} is not set "
            "(expected the peer's API key)"
            for p in unset
        )
        raise PeerConfigError(f"{source}: {names}")
