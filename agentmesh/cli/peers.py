"""`agentmesh peers list|check`: the peer registry (AGENTMESH_PEERS), never a secret."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from agentmesh.libs.config import load_settings


def add_parser(sub: Any, output: argparse.ArgumentParser) -> None:
    peers = sub.add_parser("peers", help="the peer registry (AGENTMESH_PEERS)")
    peers_sub = peers.add_subparsers(dest="peers_command", required=True)
    peers_sub.add_parser(
        "list", parents=[output], help="each peer: alias, type, URL, credential variable (never its value)"
    )
    check = peers_sub.add_parser(
        "check",
        parents=[output],
        help="FILE: validate a peer file, contacting nothing (exit 2 when it is invalid); no FILE: "
        "validate AGENTMESH_PEERS's file, then ask each peer (exit 1 when one does not answer)",
    )
    check.add_argument("file", nargs="?", default="", help="the peer file to validate")
    check.add_argument("--timeout", type=float, default=3.0, help="seconds per peer")


def run(args: argparse.Namespace) -> int:
    """`peers list` (the registry, never a secret) and `peers check` (does each answer, in time)."""
    from agentmesh.libs.peer_http import PeerClients
    from agentmesh.libs.peers import PeerConfigError, PeerRegistry

    settings = load_settings()
    as_json = args.output == "json"
    checking = args.peers_command == "check"
    path = getattr(args, "file", "") or settings.peers
    try:
        registry = PeerRegistry.load(path)
        if checking:
            registry.require_credentials()
    except PeerConfigError as exc:
        print(f"agentmesh peers: {exc}", file=sys.stderr)
        return 2
    if checking and getattr(args, "file", ""):
        return _valid(path, registry, as_json)
    if not len(registry):
        if as_json:
            print("[]")
        else:
            print("no peers registered (AGENTMESH_PEERS names the peer file)", file=sys.stderr)
        return 0 if args.peers_command == "list" else 1
    if args.peers_command == "list":
        rows = []
        for peer in registry:
            have = bool(peer.credential and os.environ.get(peer.credential))
            rows.append({"alias": peer.alias, "type": peer.type, "url": peer.url,
                         "credential": peer.credential or None, "credentialSet": have})  # fmt: skip
            if not as_json:
                cred = f"{peer.credential} ({'set' if have else 'unset'})" if peer.credential else "-"
                print(f"{peer.alias}\t{peer.type}\t{peer.url}\t{cred}")
        if as_json:
            print(json.dumps(rows, indent=2))
        return 0

    async def check() -> int:
        clients = PeerClients(settings.federation)
        try:
            results = await asyncio.gather(*(clients.of(p).healthy(args.timeout) for p in registry))
        finally:
            await clients.close()
        rows = [
            {"alias": peer.alias, "url": peer.url, "up": ok, "detail": detail}
            for peer, (ok, detail) in zip(registry, results, strict=True)
        ]
        if as_json:
            print(json.dumps(rows, indent=2))
        for row in [] if as_json else rows:
            print(f"{row['alias']}\t{row['url']}\t{'up' if row['up'] else 'DOWN'}\t{row['detail']}")
        return 0 if all(ok for ok, _ in results) else 1

    return asyncio.run(check())


def _valid(path: str, registry: Any, as_json: bool) -> int:
    """`peers check FILE`: what the valid file registers (nothing is contacted)."""
    aliases = [p.alias for p in registry]
    shared = bool(registry.store.internal_url)
    if as_json:
        print(json.dumps({"file": path, "valid": True, "peers": aliases, "sharedDatabase": shared}, indent=2))
    else:
        names = ", ".join(aliases) or "none"
        print(f"{path}: valid; peers: {names}; shared database: {'yes' if shared else 'no'}")
    return 0
