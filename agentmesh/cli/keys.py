"""`agentmesh keys create --user NAME`: an API key made by the trace service, signed with the mesh secret."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TYPE_CHECKING, Any

from agentmesh.cli.common import CliError, create_key
from agentmesh.libs.config import load_settings

if TYPE_CHECKING:
    import grpc


def add_parser(sub: Any, output: argparse.ArgumentParser) -> None:
    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", parents=[output], help="create a key for a user (printed once)")
    create.add_argument("--user", required=True)


def rpc_failure(exc: grpc.RpcError, service: str, target: str) -> CliError:
    """A failed call to the mesh, in one line that says what to do about it."""
    import grpc

    code: grpc.StatusCode | None = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CliError(
            f"the mesh is not answering: the {service} service at {target} is {code.name.lower()}"
            " (is the mesh running? `agentmesh up` starts it)"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            f"the {service} service refused this command: its mesh secret is not this one"
            " (AGENTMESH_MESH_SECRET, or mesh_secret in AGENTMESH_DATA_DIR)"
        )
    return CliError(f"the {service} service answered {code.name if code else 'an error'}: {details}")


def run(args: argparse.Namespace) -> int:
    import grpc

    from agentmesh.libs.identity import Signer, load_secret

    settings = load_settings()
    try:  # never made here: a mesh that has none has not run in this data directory
        signer = Signer(load_secret(settings.mesh_secret, settings.data_dir, create=False))
    except RuntimeError as exc:
        raise CliError(f"{exc} (is the mesh running here? `agentmesh up` starts it)") from exc
    try:
        key = asyncio.run(create_key(settings, args.user, signer))
    except grpc.RpcError as exc:
        raise rpc_failure(exc, "trace", settings.addresses.trace) from exc
    print(json.dumps({"user": args.user, "apiKey": key}) if args.output == "json" else key)
    return 0
