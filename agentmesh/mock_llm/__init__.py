"""The scripted OpenAI-compatible model server (`agentmesh mock-llm`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from agentmesh.libs.config import MeshSettings
from agentmesh.libs.log import setup_logging
from agentmesh.mock_llm.rules import RulesError, RuleSet, parse_rules
from agentmesh.mock_llm.server import MockLLM

DEMO_RULES = Path(__file__).resolve().parent / "demo_rules.yaml"

__all__ = ["DEMO_RULES", "MockLLM", "RuleSet", "RulesError", "main", "parse_rules"]


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def main(argv: list[str] | None = None) -> int:
    """Run the scripted model server until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="agentmesh mock-llm", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("AGENTMESH_MOCK_LLM_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("AGENTMESH_MOCK_LLM_PORT", "8090")))
    parser.add_argument(
        "--rules", type=Path, default=Path(os.environ.get("AGENTMESH_MOCK_LLM_RULES", DEMO_RULES))
    )
    parser.add_argument(
        "--ttft-ms",
        type=float,
        default=_env_float("AGENTMESH_MOCK_LLM_TTFT_MS"),
        help="time to first token (overrides the rules file; a rule's own value wins)",
    )
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=_env_float("AGENTMESH_MOCK_LLM_TOKENS_PER_SECOND"),
        help="streaming pace, 0 = as fast as possible (overrides the rules file; a rule's own value wins)",
    )
    args = parser.parse_args(argv)
    settings = MeshSettings()
    setup_logging("mock-llm", settings.log_level, settings.log_json)
    try:
        server = MockLLM.from_file(args.rules, ttft_ms=args.ttft_ms, tokens_per_second=args.tokens_per_second)
    except (OSError, RulesError) as exc:
        print(f"agentmesh mock-llm: cannot load rules {args.rules}: {_reason(exc)}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_serve(server, args.host, args.port))
    except OSError as exc:  # its port
        print(f"agentmesh mock-llm: {_reason(exc)}", file=sys.stderr)
        return 1


def _reason(exc: Exception) -> str:
    """On one line: an OSError's own words, a rules error (YAML's spans several lines) joined."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


async def _serve(server: MockLLM, host: str, port: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start(host, port)
    logging.getLogger(__name__).info("mock LLM serving", extra={"base_url": server.base_url})
    await stop.wait()
    await server.stop()
    return 0
