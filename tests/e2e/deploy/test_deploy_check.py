"""`make deploy-check`: every overlay renders and validates, and a broken manifest fails the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# What the Makefile unpacks from Debian's kubernetes-client (make test depends on it); KUBECTL overrides.
KUBECTL = os.environ.get("KUBECTL") or str(ROOT / ".venv/kubernetes-client/usr/bin/kubectl")
MESH = ("orchestrator", "agent-runtime", "trace", "stream", "gateway")


@pytest.fixture(scope="module")
def kubectl() -> str:
    if not shutil.which(KUBECTL):
        if CI:
            pytest.fail(f"no kubectl at {KUBECTL} (CI=true); `make test` unpacks it")
        pytest.skip(f"no kubectl at {KUBECTL}; `make test` or `make deploy-check` unpacks it")
    return KUBECTL


def run_check(kubectl: str, root: Path, out: Path, *versions: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(ROOT / "deploy/check.py"), "--kubectl", kubectl, "--root", str(root)]
    args += ["--out", str(out)] + [f"--kubernetes-version={v}" for v in versions]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_overlays_render_and_validate(kubectl: str, tmp_path: Path) -> None:
    proc = run_check(kubectl, ROOT, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("deploy-check: ok")
    rendered = {p.stem: list(yaml.safe_load_all(p.read_text())) for p in tmp_path.glob("*.yaml")}
    assert set(rendered) == {"dev", "prod"}
    for overlay, objs in rendered.items():
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
        for name in MESH:
            assert ("Deployment", name) in kinds and ("PodDisruptionBudget", name) in kinds, overlay
        stateful = {n for k, n in kinds if k == "StatefulSet"}
        assert stateful == ({"postgres", "redis"} if overlay == "dev" else set())
        (secret,) = [o for o in objs if o["kind"] == "Secret"]
        assert {"AGENTMESH_MESH_SECRET", "AGENTMESH_LLM__API_KEY", "AGENTMESH_DATABASE_URL"} <= set(
            secret["data"]
        )
        for dep in (o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] in MESH):
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            probe = "httpGet" if dep["metadata"]["name"] == "gateway" else "grpc"
            assert probe in container["readinessProbe"] and probe in container["livenessProbe"]


# (file under the copied repository, text, replacement, what the check must report)
BREAKAGES = {
    "unknown field": (
        "deploy/k8s/base/trace.yaml",
        "readinessProbe:",
        "readinesProbe:",
        "'readinesProbe' was unexpected",
    ),
    "wrong type": (
        "deploy/k8s/base/gateway.yaml",
        "averageUtilization: 70",
        "averageUtilization: seventy",
        "'seventy' is not of type 'integer'",
    ),
    "grace too short": (
        "deploy/k8s/base/orchestrator.yaml",
        "terminationGracePeriodSeconds: 45",
        "terminationGracePeriodSeconds: 20",
        "Deployment/orchestrator: terminationGracePeriodSeconds must exceed",
    ),
    "address names no Service": (
        "deploy/k8s/base/kustomization.yaml",
        "dns:///stream-headless.",
        "dns:///stream-headles.",
        "AGENTMESH_ADDRESSES__STREAM=dns:///stream-headles.",
    ),
    "listen on another port than the container's": (
        "deploy/k8s/base/kustomization.yaml",
        "AGENTMESH_LISTEN__TRACE=0.0.0.0:50053",
        "AGENTMESH_LISTEN__TRACE=0.0.0.0:50055",
        "AGENTMESH_LISTEN__TRACE=0.0.0.0:50055: the pods of trace must bind port 50053",
    ),
    "metrics annotation names no container port": (
        "deploy/k8s/base/stream.yaml",
        'prometheus.io/port: "9090"',
        'prometheus.io/port: "9091"',
        "Deployment/stream: prometheus.io/port '9091' is not a container port",
    ),
    "render fails": (
        "deploy/k8s/base/kustomization.yaml",
        "- network-policy.yaml",
        "- network-policies.yaml",
        "kubectl kustomize failed",
    ),
    "compose service without a health check test": (
        "deploy/compose.yaml",
        '      test: ["CMD", "agentmesh", "health", "127.0.0.1:50054"]\n',
        "",
        "service stream: health check has no test",
    ),
    "stale catalog copy": (
        "services/trace/demo_catalog.yaml",
        "name: General Assistant",
        "name: Generalist",
        "differs from services/trace/demo_catalog.yaml",
    ),
}


@pytest.mark.parametrize("case", BREAKAGES)
def test_broken_manifest_fails(kubectl: str, tmp_path: Path, case: str) -> None:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "deploy", root / "deploy", ignore=shutil.ignore_patterns("secrets.env"))
    (root / "services/trace").mkdir(parents=True)
    shutil.copyfile(ROOT / "services/trace/demo_catalog.yaml", root / "services/trace/demo_catalog.yaml")
    path, old, new, expected = BREAKAGES[case]
    text = (root / path).read_text()
    assert text.count(old) == 1, f"{path} no longer has exactly one {old!r}"
    (root / path).write_text(text.replace(old, new))

    proc = run_check(kubectl, root, tmp_path / "out", "1.37.0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "deploy-check: FAILED" in proc.stdout
