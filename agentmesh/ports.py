"""The ports of `agentmesh up`: every one it will bind, derived from `--port-base` or read from the
settings, and checked before anything starts (docs/operations.md#ports).

A port is owned by one server (no SO_REUSEPORT anywhere), so a second mesh on the same ports would
fail child by child; `up` instead finds every busy port first and says which, and `--port-base N`
moves the whole mesh: each port is N plus its offset below.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from agentmesh.libs.config import MeshSettings

# --port-base N: what listens on N + offset. The metrics ports are used only when configured.
OFFSETS: dict[str, int] = {
    "gateway": 0,
    "orchestrator": 1,
    "agent-runtime": 2,
    "trace": 3,
    "stream": 4,
    "a2a-grpc": 5,
    "model": 6,
    "gateway-metrics": 7,
    "orchestrator-metrics": 8,
    "agent-runtime-metrics": 9,
    "trace-metrics": 10,
    "stream-metrics": 11,
}
SPAN = max(OFFSETS.values()) + 1  # ports a base takes
SERVICES = ("orchestrator", "agent-runtime", "trace", "stream")


@dataclass(frozen=True)
class Port:
    """One port a process of the mesh will listen on."""

    name: str  # what listens there: gateway, trace, model, ...
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def split(address: str) -> tuple[str, int] | None:
    """host:port (also [v6]:port) -> (host, port); None for what is not one (dns:///..., ipv4:a,b)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address or "," in address:
        return None
    return host.strip("[]") or "0.0.0.0", int(port)


def _moved(address: str, port: int, host: str = "127.0.0.1") -> str:
    """`address` on another port (its host kept), or host:port when it names none."""
    found = split(address)
    host = found[0] if found else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def based_env(base: int, settings: MeshSettings) -> dict[str, str]:
    """The variables that put every port of the mesh at `base` + its offset (hosts kept): the gateway,
    the four services (and their listen addresses when set), the A2A gRPC binding unless it is off,
    and the metrics servers that are configured. The model server's port is the caller's (OFFSETS)."""
    out = {"AGENTMESH_GATEWAY_PORT": str(base + OFFSETS["gateway"])}
    for service in SERVICES:
        key, field = service.upper().replace("-", "_"), service.replace("-", "_")
        port = base + OFFSETS[service]
        out[f"AGENTMESH_ADDRESSES__{key}"] = _moved(getattr(settings.addresses, field), port)
        if getattr(settings.listen, field):
            out[f"AGENTMESH_LISTEN__{key}"] = _moved(getattr(settings.listen, field), port)
        if getattr(settings.metrics, field):
            out[f"AGENTMESH_METRICS__{key}"] = _moved(
                getattr(settings.metrics, field), base + OFFSETS[f"{service}-metrics"]
            )
    if settings.a2a.grpc_listen:
        out["AGENTMESH_A2A__GRPC_LISTEN"] = _moved(settings.a2a.grpc_listen, base + OFFSETS["a2a-grpc"])
    if settings.gateway_metrics_listen:
        out["AGENTMESH_GATEWAY_METRICS_LISTEN"] = _moved(
            settings.gateway_metrics_listen, base + OFFSETS["gateway-metrics"]
        )
    return out


def planned(settings: MeshSettings, model_port: int | None) -> list[Port]:
    """Every port the mesh of these settings listens on (`model_port`: the bundled model's, if any)."""
    ports = [Port("gateway", settings.gateway_host or "0.0.0.0", settings.gateway_port)]
    for service in SERVICES:
        field = service.replace("-", "_")
        found = split(settings.listen_address(field))
        if found:
            ports.append(Port(service, *found))
        metrics = getattr(settings.metrics, field)
        if metrics and (found := split(metrics)):
            ports.append(Port(f"{service} metrics", *found))
    if settings.a2a.grpc_listen and (found := split(settings.a2a.grpc_listen)):
        ports.append(Port("A2A gRPC", *found))
    if settings.gateway_metrics_listen and (found := split(settings.gateway_metrics_listen)):
        ports.append(Port("gateway metrics", *found))
    if model_port is not None:
        ports.append(Port("model", "127.0.0.1", model_port))
    return ports


def _bindable(port: Port) -> OSError | None:
    """None when a server could listen on the port now (bound as servers bind it), else the error."""
    family = socket.AF_INET6 if ":" in port.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((port.host, port.port))
        except OSError as exc:
            return exc
    return None


def problems(ports: Iterable[Port]) -> list[str]:
    """One line per port that cannot be used: in use, given twice, or not bindable at all."""
    out: list[str] = []
    seen: dict[int, Port] = {}
    for port in ports:
        if port.port == 0:
            continue  # the OS picks one
        if port.port in seen:
            out.append(f"port {port.port} is given to both {seen[port.port].name} and {port.name}")
            continue
        seen[port.port] = port
        if not 0 < port.port < 65536:
            out.append(f"port {port.port} ({port.name}) is not a TCP port")
            continue
        error = _bindable(port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            out.append(f"port {port.port} ({port.name}) is in use")
        else:
            out.append(f"cannot listen on {port.address} ({port.name}): {error.strerror or error}")
    return out


def free_base(start: int = 9100, step: int = 100, tries: int = 50) -> int | None:
    """A port base whose ports are all free now (to suggest one), or None."""
    for base in range(start, start + step * tries, step):
        if base + SPAN > 65535:
            break
        if not problems(Port(name, "127.0.0.1", base + offset) for name, offset in OFFSETS.items()):
            return base
    return None
