"""The `agentmesh` command: up, serve SERVICE, health ADDRESS, chat, agents, keys create, peers, mock-llm.

Every failure is one line on stderr, `agentmesh <command>: <what went wrong>`, and a non-zero exit (1;
2 for a usage error or a malformed setting); a command that prints data takes `-o json`.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from agentmesh import __version__
from agentmesh.cli import agents, chat, health, keys, peers, serve, up
from agentmesh.cli.common import CliError, output_parser
from agentmesh.libs.log import quiet_grpc_core
from agentmesh.libs.transport import use_classic_transport

# One module per command (group): each adds its parser and runs its parsed arguments.
COMMANDS = {
    "up": up,
    "serve": serve,
    "health": health,
    "chat": chat,
    "agents": agents,
    "peers": peers,
    "keys": keys,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentmesh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"agentmesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    output = output_parser()
    up.add_parser(sub)
    serve.add_parser(sub)
    health.add_parser(sub, output)
    chat.add_parser(sub)
    agents.add_parser(sub)
    keys.add_parser(sub, output)
    peers.add_parser(sub, output)
    sub.add_parser("mock-llm", help="run the scripted OpenAI-compatible model server", add_help=False)
    return parser


def _setting_error(exc: ValidationError) -> str:
    """A malformed AGENTMESH_* variable, named as the user wrote it."""
    first = exc.errors()[0]
    name = "AGENTMESH_" + "__".join(str(part) for part in first.get("loc", ())).upper()
    return f"invalid setting {name}: {first.get('msg', 'not valid')}"


def main(argv: list[str] | None = None) -> int:
    use_classic_transport()  # before anything below imports gRPC
    quiet_grpc_core()  # its lines would bypass the log format (libs/log.py)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "mock-llm":
        from agentmesh.mock_llm import main as mock_main

        return mock_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "up" and args.tokens_per_second is not None and (args.model_url or args.no_mock_llm):
        parser.error("--tokens-per-second paces the bundled model; it does not apply with another model")
    name = " ".join(
        part for part in (args.command, *(getattr(args, f"{args.command}_command", None) or "",)) if part
    )
    try:
        return int(COMMANDS[args.command].run(args))
    except CliError as err:
        print(f"agentmesh {name}: {err}", file=sys.stderr)
    except ValidationError as exc:
        print(f"agentmesh {name}: {_setting_error(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or a socket of this command
        where = f" {exc.filename}" if exc.filename else ""
        print(f"agentmesh {name}:{where} {exc.strerror or exc}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1
