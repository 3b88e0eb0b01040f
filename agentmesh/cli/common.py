"""What the commands share: the one-line failure, the development key, API-key calls to the mesh."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agentmesh.libs.config import MeshSettings

if TYPE_CHECKING:
    from agentmesh.libs.identity import Signer


class CliError(Exception):
    """A failure to report on stderr in one line, `agentmesh <command>: <message>` (the command exits 1)."""


def output_parser() -> argparse.ArgumentParser:
    """The `-o text|json` option of a command that prints data."""
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("-o", "--output", choices=("text", "json"), default="text", help="default: text")
    return output


async def create_key(settings: MeshSettings, user: str, signer: Signer | None = None) -> str:
    from agentmesh.auth.v1 import auth_service_pb2 as au
    from agentmesh.libs.clients import Clients

    clients = Clients(settings, signer)
    try:
        resp = await clients.auth.CreateApiKey(au.CreateApiKeyRequest(user=user))
        return resp.api_key
    finally:
        await clients.close()


async def key_works(settings: MeshSettings, key: str) -> bool:
    from agentmesh.auth.v1 import auth_service_pb2 as au
    from agentmesh.libs.clients import Clients

    clients = Clients(settings)
    try:
        await clients.auth.AuthenticateApiKey(au.AuthenticateApiKeyRequest(api_key=key))
        return True
    except Exception:
        return False
    finally:
        await clients.close()


def dev_key_file(settings: MeshSettings) -> Path:
    return settings.data_dir / "dev_api_key"


def api_key(args: argparse.Namespace, settings: MeshSettings) -> str:
    """--api-key, else $AGENTMESH_API_KEY, else the development key `agentmesh up` wrote."""
    key = args.api_key or os.environ.get("AGENTMESH_API_KEY", "")
    if not key and dev_key_file(settings).exists():
        key = dev_key_file(settings).read_text().strip()
    if not key:
        raise CliError(
            "no API key: give --api-key, set AGENTMESH_API_KEY, or start the mesh with `agentmesh up`"
        )
    return key


def http_failure(resp: httpx.Response) -> str:
    """An error answer of the gateway in one line: `error 401 UNAUTHENTICATED: <message>`."""
    try:
        error = resp.json()["error"]
        return f"error {resp.status_code} {error['reason']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"error {resp.status_code}: {' '.join(resp.text.split())[:200]}"
