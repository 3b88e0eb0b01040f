"""The peer registry (docs/requirements.md#peer-registry, #shared-database-mode): the
meshes this one may contact, by alias. Every process that calls out reads it (the trace service for
remote traces, the agent runtime for remote agents, the CLI for `agentmesh peers`). The file's schema
and its shapes are in libs/peer_file.py: a file that does not match it does not load.

The secret itself is never in the file (a key field is refused) and never in a log or a repr. Only a
registered peer is ever contacted: `resolve` turns a trace reference into its peer, or refuses it
before any connection is made (no DNS lookup, no guessing: an `agent://` id must name a registered
peer's host and port exactly as its URL spells them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from agentmesh.libs.errors import InvalidArgument, PermissionDenied
from agentmesh.libs.ids import TraceRef, shown
from agentmesh.libs.peer_file import (
    DEFAULT_PORTS,
    PEER_TYPES,
    Peer,
    PeerConfigError,
    StoreConfig,
    missing_credentials,
    read,
)

__all__ = ["PEER_TYPES", "Peer", "PeerConfigError", "PeerRegistry", "StoreConfig"]
_DEFAULT_PORTS = DEFAULT_PORTS


def _unregistered(ref: TraceRef) -> PermissionDenied:
    if ref.alias:
        return PermissionDenied(f"unknown peer {shown(ref.alias, 60)}: only registered peers are contacted")
    where = shown(ref.authority, 60)
    return PermissionDenied(f"host {where} is not a registered peer: only registered peers are contacted")


class PeerRegistry:
    def __init__(self, peers: list[Peer] | None = None, store: StoreConfig | None = None) -> None:
        self._by_alias = {p.alias: p for p in peers or []}
        self.store = store or StoreConfig()
        self.source = "the peer file"

    def __iter__(self) -> Iterator[Peer]:
        return iter(self._by_alias.values())

    def __len__(self) -> int:
        return len(self._by_alias)

    def get(self, alias: str) -> Peer | None:
        return self._by_alias.get(alias)

    @classmethod
    def parse(cls, data: Any, source: str = "the peer file") -> PeerRegistry:
        """The registry of a parsed peer file (libs/peer_file.py: the schema); PeerConfigError naming
        `source`, the path of the bad field and what is expected."""
        peers, store = read(data, source)
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
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise PeerConfigError(f"{path}: not YAML{at}: expected a YAML mapping") from exc
        registry = cls.parse(data, str(path))
        registry.source = str(path)
        return registry

    def require_credentials(self, environ: Mapping[str, str] | None = None) -> PeerRegistry:
        """PeerConfigError when a peer's credential variable is unset (a mesh does not start so)."""
        missing_credentials(list(self), os.environ if environ is None else environ, self.source)
        return self

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
