"""The peer registry (docs/requirements.md#peer-registry, #shared-database-mode): the
meshes this one may contact, by alias. Every process that calls out reads it (the trace service for
remote traces, the agent runtime for remote agents, the CLI for `agentmesh peers`).

The file (`AGENTMESH_PEERS`, YAML) takes either shape:

    peers:                              # or `agents:`, as in docs/requirements.md#peer-registry
      terminal:
        url: http://127.0.0.1:8081
        credential: TERMINAL_API_KEY    # the NAME of an environment variable holding the key
        type: terminal                  # terminal | cloud | org

    trace_store:                        # the hybrid-mode shape (docs/requirements.md#shared-database-mode)
      internal: {type: database, url: postgresql://org-db/traces}
      external:
        type: remote
        agents:
          - {alias: partner, url: https://partner-org.example, credential: PARTNER_KEY, type: org}

The secret itself is never in the file (a key that looks like one is refused) and never in a log or a
repr. Only a registered peer is ever contacted: `resolve` turns a trace reference into its peer, or
refuses it before any connection is made (no DNS lookup, no guessing: an `agent://` id must name a
registered peer's host and port exactly as its URL spells them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from agentmesh.libs.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from agentmesh.libs.ids import TraceRef, shown

PEER_TYPES = ("terminal", "cloud", "org")
_ALIAS_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_DEFAULT_PORTS = {"http": 80, "https": 443}


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
        return parts.port or _DEFAULT_PORTS[parts.scheme]

    def api_key(self, environ: Mapping[str, str] | None = None) -> str:
        """The key, read from the environment at the moment of the call; FailedPrecondition when unset."""
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


def _check_url(alias: str, url: Any) -> str:
    if not isinstance(url, str) or not url:
        raise PeerConfigError(f"peer {alias!r}: url is required")
    parts = urlsplit(url)
    if parts.scheme not in _DEFAULT_PORTS:
        raise PeerConfigError(f"peer {alias!r}: url must be http:// or https://")
    if parts.username is not None or parts.password is not None:
        raise PeerConfigError(f"peer {alias!r}: url must not carry user information (use credential)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise PeerConfigError(f"peer {alias!r}: url is scheme://host[:port] only")
    try:
        port = parts.port
    except ValueError as exc:
        raise PeerConfigError(f"peer {alias!r}: bad port") from exc
    if not parts.hostname:
        raise PeerConfigError(f"peer {alias!r}: url has no host")
    host = parts.hostname.lower()
    shown_host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown_host}" + (f":{port}" if port else "")


def _peer(alias: Any, spec: Any) -> Peer:
    if not isinstance(alias, str) or not alias or not set(alias) <= _ALIAS_CHARS or alias[0] in ".-_":
        raise PeerConfigError(f"peer alias {alias!r}: 1-63 characters of [A-Za-z0-9_.-]")
    if not isinstance(spec, dict):
        raise PeerConfigError(f"peer {alias!r}: expected a mapping")
    unknown = set(spec) - {"url", "credential", "credential_env", "api_key_env", "type", "alias", "users"}
    if "api_key" in spec:
        raise PeerConfigError(
            f"peer {alias!r}: a key never goes in the file; name its environment variable in `credential`"
        )
    if unknown:
        raise PeerConfigError(f"peer {alias!r}: unknown fields {sorted(unknown)}")
    credential = spec.get("credential") or spec.get("credential_env") or spec.get("api_key_env") or ""
    if not isinstance(credential, str) or (credential and not credential.replace("_", "").isalnum()):
        raise PeerConfigError(f"peer {alias!r}: credential is an environment variable name")
    kind = spec.get("type", "cloud")
    if kind not in PEER_TYPES:
        raise PeerConfigError(f"peer {alias!r}: type is one of {', '.join(PEER_TYPES)}")
    users = spec.get("users") or []
    if not isinstance(users, list) or not all(isinstance(u, str) and u for u in users):
        raise PeerConfigError(f"peer {alias!r}: users is a list of user names")
    try:
        TraceRef("x", alias=alias)  # the same alias grammar as the ids
    except InvalidArgument as exc:
        raise PeerConfigError(f"peer alias {alias!r}: {exc.message}") from exc
    return Peer(
        alias=alias,
        url=_check_url(alias, spec.get("url")),
        credential=credential,
        type=kind,
        users=tuple(users),
    )


@dataclass(frozen=True)
class StoreConfig:
    """`trace_store.internal`: the organisation's shared database
    (docs/requirements.md#shared-database-mode)."""

    internal_url: str = ""


def _unregistered(ref: TraceRef) -> PermissionDenied:
    if ref.alias:
        return PermissionDenied(f"unknown peer {shown(ref.alias, 60)}: only registered peers are contacted")
    where = shown(ref.authority, 60)
    return PermissionDenied(f"host {where} is not a registered peer: only registered peers are contacted")


class PeerRegistry:
    def __init__(self, peers: list[Peer] | None = None, store: StoreConfig | None = None) -> None:
        self._by_alias = {p.alias: p for p in peers or []}
        self.store = store or StoreConfig()

    def __iter__(self) -> Iterator[Peer]:
        return iter(self._by_alias.values())

    def __len__(self) -> int:
        return len(self._by_alias)

    def get(self, alias: str) -> Peer | None:
        return self._by_alias.get(alias)

    @classmethod
    def parse(cls, data: Any) -> PeerRegistry:
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise PeerConfigError("the peer file is a mapping")
        peers: list[Peer] = []
        for key in ("peers", "agents"):
            section = data.get(key) or {}
            if not isinstance(section, dict):
                raise PeerConfigError(f"`{key}` maps an alias to a peer")
            peers += [_peer(alias, spec) for alias, spec in section.items()]
        store = StoreConfig()
        ts = data.get("trace_store")
        if ts is not None:
            if not isinstance(ts, dict):
                raise PeerConfigError("`trace_store` is a mapping")
            internal = ts.get("internal") or {}
            if internal:
                if internal.get("type", "database") != "database" or not isinstance(internal.get("url"), str):
                    raise PeerConfigError("trace_store.internal is {type: database, url: ...}")
                store = StoreConfig(internal_url=internal["url"])
            external = ts.get("external") or {}
            if external:
                if external.get("type", "remote") != "remote":
                    raise PeerConfigError("trace_store.external.type is remote")
                for spec in external.get("agents") or []:
                    if not isinstance(spec, dict) or "alias" not in spec:
                        raise PeerConfigError("trace_store.external.agents: each has an alias")
                    peers.append(_peer(spec["alias"], spec))
        aliases = [p.alias for p in peers]
        if len(set(aliases)) != len(aliases):
            raise PeerConfigError("a peer alias is registered twice")
        return cls(peers, store)

    @classmethod
    def load(cls, path: Path | str | None) -> PeerRegistry:
        """The registry of `path` (empty when no path is configured)."""
        if not path:
            return cls()
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PeerConfigError(f"cannot read the peer file {path}: {exc.strerror}") from exc
        try:
            return cls.parse(yaml.safe_load(text))
        except yaml.YAMLError as exc:
            raise PeerConfigError(f"the peer file {path} is not YAML") from exc

    def resolve(self, ref: TraceRef | str, user: str | None = None) -> Peer:
        """The registered peer a remote reference names; refused (PermissionDenied or InvalidArgument)
        otherwise, before any connection. `agent://host[:port]/id` must name a peer's host exactly as
        its URL spells it (a name is not resolved to compare with an IP literal) and its port (or the
        scheme's default). With `user`: a peer whose `users` do not include them is refused the same
        way as an unregistered one."""
        if isinstance(ref, str):
            ref = TraceRef.parse(ref)
        peer = self._resolve(ref)
        if user is not None and peer.users and user not in peer.users:
            raise _unregistered(ref)  # the same answer as for an unregistered peer
        return peer

    def _resolve(self, ref: TraceRef) -> Peer:
        if ref.is_local:
            raise InvalidArgument("a local trace id names no peer")
        if ref.alias:
            peer = self._by_alias.get(ref.alias)
            if peer is None:
                raise _unregistered(ref)
            return peer
        for peer in self._by_alias.values():
            host = f"[{peer.host}]" if ":" in peer.host else peer.host
            if host == ref.host and (ref.port or _DEFAULT_PORTS[peer.scheme]) == peer.port:
                return peer
        raise _unregistered(ref)

    def canonical(self, ref: TraceRef) -> TraceRef:
        """The short form (`@alias/id`) of a remote reference (the key its cached copy is stored under)."""
        return self.resolve(ref).ref(ref.id)
