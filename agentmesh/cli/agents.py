"""`agentmesh agents list|show SLUG|apply -f FILE|delete SLUG`: a user's agents over the gateway's HTTP
API, so they can be kept in files (in git) and applied, like `kubectl apply`.

`apply` reads one or more agents from YAML (one agent, a list, `agents: [...]` as in a catalog, or
several `---` documents) and makes each agent of that slug what the file says: it creates the ones the
user does not have, and changes the others (a field the file leaves out takes its default), reporting
`created`, `configured` or `unchanged`. A change names the version it was made against (If-Match): the
file's `version` when it has one, else the version just read, so a concurrent edit is never
overwritten silently (HTTP 412).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from agentmesh.cli.common import CliError
from agentmesh.libs.config import load_settings

OUTPUT_ONLY = ("effectiveSubagentConfig", "owner", "version", "createTime", "updateTime")
# Settings whose nested keys a file may give in part; the rest of the object takes its defaults.
NESTED_DEFAULTS = ("limits", "invoke")
WRITABLE = (
    "slug",
    "name",
    "description",
    "systemPrompt",
    "model",
    "tools",
    "limits",
    "invoke",
    "subagentConfig",
    "public",
)


def add_parser(sub: Any) -> None:
    gateway = argparse.ArgumentParser(add_help=False)
    gateway.add_argument("--url", default="", help="the gateway (default: http://HOST:PORT of the settings)")
    gateway.add_argument("--api-key", default="", help="default: $AGENTMESH_API_KEY, else the dev key")
    agents = sub.add_parser("agents", help="list, show, apply and delete your agents (over the gateway)")
    verbs = agents.add_subparsers(dest="agents_command", required=True)
    listing = verbs.add_parser("list", parents=[gateway], help="your agents and the built-in ones")
    listing.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table")
    show = verbs.add_parser("show", parents=[gateway], help="one agent, as YAML (or JSON)")
    show.add_argument("slug")
    show.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    apply = verbs.add_parser("apply", parents=[gateway], help="create or change agents from a YAML file")
    apply.add_argument("-f", "--filename", required=True, help="a YAML file, or - for stdin")
    delete = verbs.add_parser("delete", parents=[gateway], help="delete one of your agents")
    delete.add_argument("slug")


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    key = args.api_key or os.environ.get("AGENTMESH_API_KEY", "")
    dev_key = settings.data_dir / "dev_api_key"
    if not key and dev_key.exists():
        key = dev_key.read_text().strip()
    url = args.url or f"http://{settings.gateway_host}:{settings.gateway_port}"
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            if args.agents_command == "list":
                return _list(http, args.output)
            if args.agents_command == "show":
                agent, _ = _get(http, args.slug)
                if agent is None:
                    raise CliError(f"agent/{args.slug}: unknown agent {args.slug!r}")
                _print(agent, args.output)
                return 0
            if args.agents_command == "apply":
                return _apply(http, args.filename)
            _call(http, "DELETE", f"/api/agents/{args.slug}", what=f"agent/{args.slug}")
            print(f"agent/{args.slug} deleted")
            return 0
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the gateway at {url}: {exc or type(exc).__name__}") from exc


def _error(resp: httpx.Response, what: str) -> CliError:
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text
    return CliError(f"{what}: error {resp.status_code}: {message}")


def _call(http: httpx.Client, method: str, path: str, what: str, **kw: Any) -> httpx.Response:
    resp = http.request(method, path, **kw)
    if resp.is_error:
        raise _error(resp, what)
    return resp


def _get(http: httpx.Client, slug: str) -> tuple[dict[str, Any] | None, str]:
    """The agent as the user sees it (None when there is none) and its ETag."""
    resp = http.get(f"/api/agents/{slug}")
    if resp.status_code == 404:
        return None, ""
    if resp.is_error:
        raise _error(resp, f"agent/{slug}")
    return resp.json()["agent"], resp.headers.get("etag", "")


def _print(data: Any, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        print(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), end="")


def _list(http: httpx.Client, output: str) -> int:
    agents = _call(http, "GET", "/api/agents", what="agents").json()["agents"]
    if output != "table":
        _print(agents, output)
        return 0
    rows = [("SLUG", "NAME", "OWNER", "VERSION", "TOOLS")]
    rows += [
        (a["slug"], a["name"], a["owner"] or "built-in", str(a["version"]), ",".join(a["tools"]) or "-")
        for a in agents
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def read_agents(filename: str) -> list[dict[str, Any]]:
    """The agents of a YAML file (or stdin for "-"): one agent, a list, `agents: [...]`, or several
    documents of any of these."""
    try:
        text = sys.stdin.read() if filename == "-" else Path(filename).read_text(encoding="utf-8")
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise CliError(f"cannot read {filename}: {' '.join(str(exc).split())}") from exc
    agents: list[Any] = []
    for doc in documents:
        if isinstance(doc, dict) and isinstance(doc.get("agents"), list):
            agents.extend(doc["agents"])
        elif isinstance(doc, list):
            agents.extend(doc)
        else:
            agents.append(doc)
    for i, agent in enumerate(agents):
        if not isinstance(agent, dict) or not isinstance(agent.get("slug"), str) or not agent["slug"]:
            raise CliError(f"{filename}: agent {i + 1} is not a mapping with a slug")
    if not agents:
        raise CliError(f"{filename}: no agents in it")
    return agents


def _apply(http: httpx.Client, filename: str) -> int:
    agents = read_agents(filename)
    defaults: dict[str, Any] | None = None
    failed = 0
    for given in agents:
        slug = given["slug"]
        what = f"agent/{slug}"
        body = {k: v for k, v in given.items() if k not in OUTPUT_ONLY}
        try:
            current, etag = _get(http, slug)
            if current is None or not current["owner"]:  # none of the user's own: create it
                _call(http, "POST", "/api/agents", what=what, json=body)
                print(f"{what} created")
                continue
            if defaults is None:
                options = _call(http, "GET", "/api/agents/options", what="agent options").json()
                defaults = options["defaults"]
            match = f'"{given["version"]}"' if isinstance(given.get("version"), int) else etag
            patch = _whole(body, defaults)
            resp = _call(
                http, "PATCH", f"/api/agents/{slug}", what=what, json=patch, headers={"If-Match": match}
            )
            changed = resp.json()["agent"]["version"] != current["version"]
            print(f"{what} {'configured' if changed else 'unchanged'}")
        except CliError as err:  # reported, and the next agent is still applied
            print(f"agentmesh agents apply: {err}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _whole(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A merge patch that makes the agent exactly `body`: every writable field, the ones the file
    leaves out at their defaults (`null`: unset), and `limits` / `invoke` completed from the defaults."""
    out: dict[str, Any] = {}
    for key in WRITABLE:
        if key in NESTED_DEFAULTS:
            given = body.get(key)
            out[key] = {**defaults.get(key, {}), **given} if isinstance(given, dict) else given
        elif key in body:
            out[key] = body[key]
        else:
            out[key] = defaults.get(key)
    out.update({k: v for k, v in body.items() if k not in out})  # unknown keys: the gateway refuses them
    return out
