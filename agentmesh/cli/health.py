"""`agentmesh health ADDRESS`: one grpc.health.v1 Check, for a container health check or a probe."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: Any, output: argparse.ArgumentParser) -> None:
    health = sub.add_parser(
        "health", parents=[output], help="exit 0 when a gRPC service reports SERVING, else 1"
    )
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name; empty: the whole server")
    health.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds")


def run(args: argparse.Namespace) -> int:
    """One grpc.health.v1 Check with a deadline: 0 when ADDRESS reports SERVING, 1 otherwise (a
    container health check or a probe; no retries, no waiting for the server to come up)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=args.service)
    result: dict[str, Any] = {"address": args.address, "service": args.service}
    with grpc.insecure_channel(args.address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            result.update(status=code.name if code else "UNKNOWN", error=details)
            if args.output == "json":
                print(json.dumps(result))
            else:
                print(f"{args.address}: {result['status']} {details}", file=sys.stderr)
            return 1
    result["status"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(json.dumps(result) if args.output == "json" else f"{args.address}: {result['status']}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
