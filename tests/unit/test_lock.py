"""constraints.txt is the lock of every install (scripts/lock.py): it pins every requirement of
pyproject.toml inside its range, every requirement bounds its major version, and this venv was
installed from it (`make setup`: pip install -c constraints.txt)."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def load_lock() -> Any:
    spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = load_lock()


def test_the_lock_matches_pyproject() -> None:
    reqs = lock.requirements()
    assert any(r.startswith("openai[aiohttp]") for r in reqs) and any(
        r.startswith("matplotlib") for r in reqs
    )
    assert any(r.startswith("grpcio-tools") for r in reqs)  # the build's too
    assert lock.problems(reqs, lock.pins()) == []


def test_what_the_check_finds() -> None:
    pinned = {"protobuf": "7.36.2", "openai": "3.60.0", "pyyaml": "6.0.4"}
    assert lock.problems(["protobuf>=5,<8", "openai[aiohttp]>=1.80,<4", "PyYAML>=6,<7"], pinned) == []
    assert lock.problems(["protobuf>=5,<7"], pinned) == [
        "protobuf>=5,<7: constraints.txt pins 7.36.2 (run make constraints)"
    ]
    assert lock.problems(["redis>=5,<9"], pinned) == [
        "redis>=5,<9: not in constraints.txt (run make constraints)"
    ]
    assert lock.problems(["protobuf>=5"], pinned) == ["protobuf>=5: no upper bound (give the next major: <N)"]
    assert lock.problems(['pywin32>=300,<400; sys_platform == "win32"'], pinned) == []  # not this platform


def test_pins_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "constraints.txt"
    path.write_text("# a comment\n\nPyYAML==6.0.4\nprometheus_client==0.26.0  # why\n")
    assert lock.pins(path) == {"pyyaml": "6.0.4", "prometheus-client": "0.26.0"}


def test_this_venv_was_installed_from_the_lock() -> None:
    pinned = lock.pins()
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    differ = {
        name: (installed[name], version)
        for name, version in pinned.items()
        if installed.get(name, version) != version
    }
    assert not differ, f"installed != constraints.txt (run make setup): {differ}"
    for name in ("grpcio", "protobuf", "openai", "fastapi", "pytest"):
        assert name in installed and name in pinned, name
