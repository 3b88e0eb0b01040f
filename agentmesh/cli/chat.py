"""`agentmesh chat --agent SLUG TEXT`: one chat turn over the gateway, streamed to the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from agentmesh.cli.common import CliError, api_key, http_failure
from agentmesh.libs.config import load_settings


def add_parser(sub: Any) -> None:
    chat = sub.add_parser("chat", help="stream one chat turn to the terminal")
    chat.add_argument("--agent", required=True)
    chat.add_argument("--trace", "--session", dest="trace", default="", help="the trace (chat) to continue")
    chat.add_argument("--api-key", default="")
    chat.add_argument("--url", default="")
    chat.add_argument("text")


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    key = api_key(args, settings)
    url = args.url or f"http://{settings.gateway_host}:{settings.gateway_port}"
    body: dict[str, str] = {"agent": args.agent, "message": args.text}
    if args.trace:
        body["traceId"] = args.trace
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.stream("POST", f"{url}/api/chat", json=body, headers=headers, timeout=None) as resp:
            if resp.status_code != 200:
                resp.read()
                raise CliError(http_failure(resp))
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                kind = event.get("type")
                if kind == "start":
                    print(f"[trace {event['traceId']}]", file=sys.stderr)
                elif kind == "text-delta":
                    print(event["textDelta"], end="", flush=True)
                elif kind == "tool-input-available":
                    print(f"\n[tool {event['toolName']} {json.dumps(event.get('input'))}]", file=sys.stderr)
                elif kind == "a2a-task-started":
                    print(
                        f"[{event['calleeAgentName']} is working on task {event['taskId']}]", file=sys.stderr
                    )
                elif kind == "subagent-update":
                    sub = event["subagent"]
                    print(f"[subagent {sub['name']}: {sub['status']}]", file=sys.stderr)
                elif kind == "error":
                    print(file=sys.stderr)
                    raise CliError(f"the turn failed: {event.get('code')}: {event.get('message')}")
                elif kind == "finish":
                    print()
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the gateway at {url}: {exc or type(exc).__name__}") from exc
    return 0
