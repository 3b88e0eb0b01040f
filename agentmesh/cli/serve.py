"""`agentmesh serve SERVICE`: one service in this process, until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from agentmesh.libs.config import load_settings

SERVICES = ("trace", "stream", "agent-runtime", "orchestrator", "gateway")


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVICES)


def run(args: argparse.Namespace) -> int:
    return serve(args.service)


def serve(name: str) -> int:
    settings = load_settings()
    if name == "trace":
        from agentmesh.services.trace.server import main as service_main
    elif name == "stream":
        from agentmesh.services.stream.server import main as service_main
    elif name == "agent-runtime":
        from agentmesh.services.agent_runtime.server import main as service_main
    elif name == "orchestrator":
        from agentmesh.services.orchestrator.server import main as service_main
    elif name == "gateway":
        from agentmesh.gateway.server import main as service_main
    else:
        print(f"unknown service {name!r}; one of {', '.join(SERVICES)}", file=sys.stderr)
        return 2
    from agentmesh.libs import telemetry
    from agentmesh.libs.log import setup_logging

    setup_logging(name, settings.log_level, settings.log_json, access_log=settings.gateway_access_log)
    telemetry.setup(name)  # only with OTEL_EXPORTER_OTLP_ENDPOINT
    from agentmesh.libs.aio import run as run_loop

    try:
        run_loop(service_main(settings))
    except OSError as exc:  # its port (libs.rpc.BindError, libs.embedded_http.bind): no traceback
        logging.getLogger("agentmesh.serve").error("%s cannot start: %s", name, exc.strerror or exc)
        return 1
    except Exception:
        logging.getLogger("agentmesh.serve").exception("%s stopped on an error", name)
        return 1
    finally:
        telemetry.shutdown()
    return 0
