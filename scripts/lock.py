"""constraints.txt, the lock of every install: what it holds and whether it matches pyproject.toml.

    python scripts/lock.py requirements   # every requirement of pyproject.toml, one a line (to install)
    python scripts/lock.py check          # the lock matches pyproject.toml (make lint runs it)

`make constraints` refreshes the lock: a fresh venv gets every requirement (the dependencies, every
extra, the build requirements) at the newest versions the bounds allow, and `pip freeze` of it becomes
constraints.txt; `make setup` installs with `pip install -c constraints.txt`. The check holds that
every requirement is pinned at a version inside its range and that every requirement bounds its
major version from above (so a new major never arrives with a refresh unseen).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "constraints.txt"


def requirements(pyproject: Path = PYPROJECT) -> list[str]:
    """Every requirement string: the project's dependencies, each extra's, the build system's."""
    doc = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    project = doc["project"]
    out = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        out.extend(extra)
    out.extend(doc.get("build-system", {}).get("requires", []))
    return out


def pins(constraints: Path = CONSTRAINTS) -> dict[str, str]:
    """name (canonical) -> pinned version, from `name==version` lines (comments and blanks skipped)."""
    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for raw in constraints.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{constraints.name}: not a pin: {raw!r}")
        out[canonicalize_name(name.strip())] = version.strip()
    return out


def problems(reqs: list[str], pinned: dict[str, str]) -> list[str]:
    """What makes the lock disagree with the requirements, one line each (none: they match)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    out: list[str] = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # not for this platform
        name = canonicalize_name(req.name)
        if not any(spec.operator in ("<", "<=", "==", "~=", "===") for spec in req.specifier):
            out.append(f"{text}: no upper bound (give the next major: <N)")
        version = pinned.get(name)
        if version is None:
            out.append(f"{text}: not in constraints.txt (run make constraints)")
        elif not req.specifier.contains(Version(version), prereleases=True):
            out.append(f"{text}: constraints.txt pins {version} (run make constraints)")
    return out


def main(argv: list[str]) -> int:
    if argv == ["requirements"]:
        print("\n".join(requirements()))
        return 0
    if argv == ["check"]:
        found = problems(requirements(), pins())
        for line in found:
            print(f"constraints.txt: {line}", file=sys.stderr)
        return 1 if found else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
