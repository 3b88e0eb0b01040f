"""`make deploy-check`: render every Kubernetes overlay and validate it offline; check compose.yaml.

    python deploy/check.py --kubectl PATH [--root REPO] [--out DIR] [--kubernetes-version V ...]

1. Renders deploy/k8s/overlays/* with `kubectl kustomize` into OUT/<overlay>.yaml. The tree is copied
   first and every `X.env.example` is copied over `X.env`, so prod renders from a clean clone with
   the example values and a real secrets.env never reaches OUT.
2. Validates every rendered object against the Kubernetes OpenAPI schemas bundled with the
   `kubernetes-validate` package (strict: unknown fields fail), for each given Kubernetes version.
3. Checks what a schema cannot: selectors that select, names and keys that exist, probes on the
   served port, termination grace longer than preStop + AGENTMESH_SHUTDOWN_GRACE_S, service
   addresses that name a Service and its port.
4. Validates deploy/compose.yaml against the Compose Specification schema (vendored in
   check-jsonschema) and checks each service has an image, a command and a health check.

Prints one line per problem and exits 1 when there is any; 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VERSIONS = ("1.29.0", "1.37.0")
MESH = {  # component: port (gateway: HTTP, the others gRPC)
    "orchestrator": 50051,
    "agent-runtime": 50052,
    "trace": 50053,
    "stream": 50054,
    "gateway": 8080,
}
HEADLESS = ("orchestrator", "agent-runtime", "stream")
AUTOSCALED = ("gateway", "orchestrator", "agent-runtime", "stream")
WORKLOADS = ("Deployment", "StatefulSet")

Obj = dict[str, Any]


def render(kubectl: str, overlay: Path) -> list[Obj]:
    """`kubectl kustomize OVERLAY` as a list of objects; raises RuntimeError with kubectl's stderr."""
    proc = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip() or f"kubectl exited with {proc.returncode}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def name_of(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def validate_schemas(objs: Iterable[Obj], versions: Iterable[str]) -> list[str]:
    problems = []
    for version in versions:
        for obj in objs:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                problems.append(f"{name_of(obj)}: {where}: {exc.message} (Kubernetes {version} schema)")
            except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
                problems.append(f"{name_of(obj)}: {exc} (Kubernetes {version})")
    return problems


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _probe_port(probe: Obj) -> Any:
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            return probe[kind].get("port")
    return None


def check_references(objs: list[Obj]) -> list[str]:
    """Cross-object consistency of one rendered overlay."""
    problems: list[str] = []
    by_kind: dict[str, dict[str, Obj]] = {}
    for obj in objs:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    configmaps, secrets = by_kind.get("ConfigMap", {}), by_kind.get("Secret", {})
    workloads = [o for kind in WORKLOADS for o in by_kind.get(kind, {}).values()]
    services = by_kind.get("Service", {})

    def pod_labels(w: Obj) -> dict[str, str]:
        return w["spec"]["template"]["metadata"].get("labels", {})

    def mesh_env(key: str) -> str | None:
        for cm in configmaps.values():
            if key in cm.get("data", {}):
                return str(cm["data"][key])
        return None

    for w in workloads:
        n, pod = name_of(w), w["spec"]["template"]["spec"]
        if not _selects(w["spec"]["selector"].get("matchLabels", {}), pod_labels(w)):
            problems.append(f"{n}: selector does not match the pod template labels")
        for vol in pod.get("volumes", []):
            if "configMap" in vol and vol["configMap"]["name"] not in configmaps:
                problems.append(f"{n}: volume {vol['name']}: no ConfigMap {vol['configMap']['name']}")
        for c in pod["containers"]:
            cn = f"{n} container {c['name']}"
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            for which in ("readinessProbe", "livenessProbe"):
                if which not in c:
                    problems.append(f"{cn}: no {which}")
                elif "exec" in c[which]:
                    continue
                elif (port := _probe_port(c[which])) not in ports and port not in ports.values():
                    problems.append(f"{cn}: {which} port {port} is not a container port")
            for part in ("requests", "limits"):
                if not {"cpu", "memory"} <= set(c.get("resources", {}).get(part, {})):
                    problems.append(f"{cn}: resources.{part} needs cpu and memory")
            for src in c.get("envFrom", []):
                if "configMapRef" in src and src["configMapRef"]["name"] not in configmaps:
                    problems.append(f"{cn}: envFrom: no ConfigMap {src['configMapRef']['name']}")
                if "secretRef" in src and src["secretRef"]["name"] not in secrets:
                    problems.append(f"{cn}: envFrom: no Secret {src['secretRef']['name']}")
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], {}).get("data", {}):
                    problems.append(f"{cn}: env {env['name']}: no key {ref['key']} in Secret {ref['name']}")
        if pod_labels(w).get("app.kubernetes.io/part-of") == "agentmesh":
            grace = float(mesh_env("AGENTMESH_SHUTDOWN_GRACE_S") or 10)
            pre_stop = 0.0
            for c in pod["containers"]:
                cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                if cmd[:1] == ["sleep"]:
                    pre_stop = max(pre_stop, float(cmd[1]))
            if pod.get("terminationGracePeriodSeconds", 30) <= pre_stop + grace:
                problems.append(
                    f"{n}: terminationGracePeriodSeconds must exceed preStop {pre_stop:g}s"
                    f" + AGENTMESH_SHUTDOWN_GRACE_S {grace:g}s"
                )

    for svc in services.values():
        selected = [w for w in workloads if _selects(svc["spec"].get("selector", {}), pod_labels(w))]
        if not selected:
            problems.append(f"{name_of(svc)}: selects no workload")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in selected:
                cports = [p for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
                if not any(target in (p.get("name"), p["containerPort"]) for p in cports):
                    problems.append(f"{name_of(svc)}: targetPort {target} is not a port of {name_of(w)}")

    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget"):
        for obj in by_kind.get(kind, {}).values():
            if kind == "HorizontalPodAutoscaler":
                ref = obj["spec"]["scaleTargetRef"]
                ok = ref["name"] in by_kind.get(ref["kind"], {})
            else:
                ok = any(_selects(obj["spec"]["selector"]["matchLabels"], pod_labels(w)) for w in workloads)
            if not ok:
                problems.append(f"{name_of(obj)}: targets no workload")

    for key in ("TRACE", "STREAM", "AGENT_RUNTIME", "ORCHESTRATOR"):
        value = mesh_env(f"AGENTMESH_ADDRESSES__{key}")
        if value is None:
            problems.append(f"AGENTMESH_ADDRESSES__{key} is not set")
            continue
        host, _, port = value.removeprefix("dns:///").rpartition(":")
        target = services.get(host.split(".")[0])
        if (
            target is None
            or not port.isdigit()
            or int(port) not in [p["port"] for p in target["spec"]["ports"]]
        ):
            problems.append(f"AGENTMESH_ADDRESSES__{key}={value}: no Service with that name and port")
        elif "." in host and host.split(".")[1] != target["metadata"].get("namespace"):
            problems.append(f"AGENTMESH_ADDRESSES__{key}={value}: Service is in another namespace")

    for comp, port in MESH.items():
        key = comp.upper().replace("-", "_")
        listen = mesh_env(f"AGENTMESH_LISTEN__{key}")
        if comp != "gateway" and (listen is None or not listen.endswith(f":{port}")):
            problems.append(f"AGENTMESH_LISTEN__{key}={listen}: the pods of {comp} must bind port {port}")
    for w in workloads:
        notes = w["spec"]["template"]["metadata"].get("annotations", {})
        if pod_labels(w).get("app.kubernetes.io/part-of") == "agentmesh" and notes.get(
            "prometheus.io/scrape"
        ):
            want = notes.get("prometheus.io/port", "")
            cports = [
                p["containerPort"]
                for c in w["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            ]
            comp = pod_labels(w).get("app.kubernetes.io/name", "")
            metrics = mesh_env(f"AGENTMESH_METRICS__{comp.upper().replace('-', '_')}")
            if not want.isdigit() or int(want) not in cports:
                problems.append(f"{name_of(w)}: prometheus.io/port {want!r} is not a container port")
            elif comp != "gateway" and (metrics is None or not metrics.endswith(f":{want}")):
                problems.append(f"{name_of(w)}: AGENTMESH_METRICS__ does not serve port {want}")

    deployments = by_kind.get("Deployment", {})
    for comp in MESH:
        for kind, name in (("Deployment", comp), ("Service", comp), ("PodDisruptionBudget", comp)):
            if name not in by_kind.get(kind, {}):
                problems.append(f"missing {kind}/{name}")
    for comp in HEADLESS:
        if services.get(f"{comp}-headless", {}).get("spec", {}).get("clusterIP") != "None":
            problems.append(f"missing headless Service/{comp}-headless")
    for comp in AUTOSCALED:
        if comp not in by_kind.get("HorizontalPodAutoscaler", {}):
            problems.append(f"missing HorizontalPodAutoscaler/{comp}")
        elif "replicas" in deployments.get(comp, {}).get("spec", {}):
            problems.append(f"Deployment/{comp}: replicas is set although an autoscaler owns it")
    if not by_kind.get("NetworkPolicy"):
        problems.append("no NetworkPolicy")
    return problems


def check_compose(path: Path) -> list[str]:
    """The Compose Specification schema (check-jsonschema's vendored copy), then the mesh's shape."""
    problems = []
    check_jsonschema = Path(sys.executable).parent / "check-jsonschema"
    proc = subprocess.run(
        [str(check_jsonschema), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        problems.append(f"{path.name}: compose-spec schema: {(proc.stdout + proc.stderr).strip()}")
    compose = yaml.safe_load(path.read_text())
    services = compose.get("services", {})
    for name, svc in services.items():
        for key in ("image", "command", "healthcheck"):
            if key not in svc:
                problems.append(f"{path.name}: service {name}: no {key}")
        if not svc.get("healthcheck", {}).get("test"):
            problems.append(f"{path.name}: service {name}: health check has no test")
        for dep in svc.get("depends_on", {}):
            if dep not in services:
                problems.append(f"{path.name}: service {name}: depends on unknown service {dep}")
    for comp, port in MESH.items():
        svc = services.get(comp)
        if svc is None:
            problems.append(f"{path.name}: no service {comp}")
            continue
        if svc.get("command") != ["agentmesh", "serve", comp]:
            problems.append(f"{path.name}: service {comp}: command is not agentmesh serve {comp}")
        replicas = svc.get("deploy", {}).get("replicas", 1)
        if comp != "trace" and replicas != 2:
            problems.append(f"{path.name}: service {comp}: {replicas} replicas, want 2")
        if comp != "gateway" and f"127.0.0.1:{port}" not in svc["healthcheck"].get("test", []):
            problems.append(f"{path.name}: service {comp}: health check does not ask port {port}")
    for name in ("postgres", "redis"):
        if name not in services:
            problems.append(f"{path.name}: no service {name}")
    return problems


def check(kubectl: str, root: Path, out: Path, versions: Iterable[str]) -> list[str]:
    versions = tuple(versions)
    problems: list[str] = []
    catalog = root / "deploy/k8s/base/catalog/catalog.yaml"
    if catalog.read_text() != (root / "services/trace/demo_catalog.yaml").read_text():
        source = "services/trace/demo_catalog.yaml"
        problems.append(f"{catalog.relative_to(root)} differs from {source}: copy it over")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "k8s"
        shutil.copytree(root / "deploy/k8s", tree)
        for example in tree.rglob("*.env.example"):
            shutil.copyfile(example, example.with_suffix(""))
        for overlay in sorted(p for p in (tree / "overlays").iterdir() if p.is_dir()):
            try:
                objs = render(kubectl, overlay)
            except RuntimeError as exc:
                problems.append(f"{overlay.name}: kubectl kustomize failed: {exc}")
                continue
            (out / f"{overlay.name}.yaml").write_text(yaml.safe_dump_all(objs, sort_keys=False))
            found = validate_schemas(objs, versions) + check_references(objs)
            problems += [f"{overlay.name}: {p}" for p in found]
            kinds = sorted({o["kind"] for o in objs})
            print(
                f"{overlay.name}: {len(objs)} objects ({', '.join(kinds)}) -> {out / overlay.name}.yaml;"
                f" schemas (strict) {', '.join(versions)}: {'FAILED' if found else 'ok'}"
            )
    found = check_compose(root / "deploy/compose.yaml")
    print(f"compose.yaml: {'FAILED' if found else 'ok'} (compose-spec schema, services, health checks)")
    return problems + found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--kubectl", default="kubectl", help="a kubectl with `kustomize`")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository to check")
    parser.add_argument("--out", type=Path, default=None, help="rendered manifests (ROOT/build/deploy)")
    parser.add_argument(
        "--kubernetes-version", action="append", dest="versions", help=f"default {DEFAULT_VERSIONS}"
    )
    args = parser.parse_args(argv)
    version = subprocess.run(
        [args.kubectl, "version", "--client"], capture_output=True, text=True, check=False
    ).stdout
    match = re.search(r'GitVersion:"([^"]+)"', version) or re.search(r"Client Version: (\S+)", version)
    print(f"rendering with {args.kubectl} (kubectl {match.group(1) if match else 'of unknown version'})")
    problems = check(
        args.kubectl, args.root, args.out or args.root / "build/deploy", args.versions or DEFAULT_VERSIONS
    )
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    print(f"deploy-check: {'FAILED, ' + str(len(problems)) + ' problem(s)' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
