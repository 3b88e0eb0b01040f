"""The build: one import root and the files a wheel needs that git does not hold.

- One import root: the repository's top-level folders services/, gateway/ and libs/ install as
  `agentmesh.services`, `agentmesh.gateway` and `agentmesh.libs` beside agentmesh/ itself.
- `build_assets` makes what is generated, never committed: the protobuf and gRPC modules from
  protos/ (`agentmesh.<package>.v1`, with `.pyi` stubs) and the web UI's browser libraries from the
  npm packages in package.json (gateway/static/ui/vendor/). A wheel build runs it into the build
  tree, so a wheel from a clean clone is complete; `make setup` runs it in place (`--inplace`) for the
  editable install the checkout uses.

Configuration that is not code stays in pyproject.toml.
"""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

from setuptools import Command, find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
MAPPED = {"agentmesh.services": "services", "agentmesh.gateway": "gateway", "agentmesh.libs": "libs"}
# npm package file -> the name the UI imports it by (gateway/static/ui/*.js)
VENDOR = {
    "marked/lib/marked.esm.js": "marked.esm.js",
    "dompurify/dist/purify.es.mjs": "purify.es.mjs",
    # highlight.js's own browser build (ES module, the common languages built in)
    "@highlightjs/cdn-assets/es/highlight.min.js": "highlight.min.js",
}
VENDOR_DIR = "gateway/static/ui/vendor"


def packages() -> list[str]:
    found = find_namespace_packages(include=["agentmesh", "agentmesh.*"])
    for name, folder in MAPPED.items():
        found += [name, *(f"{name}.{p}" for p in find_namespace_packages(folder))]
    return sorted(p for p in found if "__pycache__" not in p)


def generate_protos(out: Path) -> None:
    """protos/**/*.proto -> out/agentmesh/<package>/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py."""
    from grpc_tools import protoc  # a build requirement only

    include = resources.files("grpc_tools") / "_proto"
    sources = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    for folder in {Path(s).parent for s in sources}:
        shutil.rmtree(out / folder, ignore_errors=True)  # no module of a deleted proto stays behind
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}"]
    args += [f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def copy_vendor(out: Path) -> None:
    """The UI's browser libraries (with their source maps, where the package has one) from node_modules,
    installed by `npm ci` when missing (npm is a build prerequisite, like a compiler)."""
    modules = ROOT / "node_modules"
    if not all((modules / src).exists() for src in VENDOR):
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=ROOT, check=True)
    target = out / VENDOR_DIR
    target.mkdir(parents=True, exist_ok=True)
    for src, name in VENDOR.items():
        shutil.copyfile(modules / src, target / name)
        if (modules / (src + ".map")).exists():
            shutil.copyfile(modules / (src + ".map"), target / (name + ".map"))


class BuildAssets(Command):
    """Generates the protobuf modules and copies the UI's vendor files (into the source tree with
    --inplace, else into the build tree)."""

    description = "generate the protobuf modules and copy the web UI's vendor files"
    user_options = [("inplace", "i", "write into the source tree")]

    def initialize_options(self) -> None:
        self.inplace = False
        self.build_lib: str | None = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        if self.inplace:
            generate_protos(ROOT)
            copy_vendor(ROOT)
            return
        assert self.build_lib is not None
        lib = Path(self.build_lib)
        generate_protos(lib)
        copy_vendor(lib / "agentmesh")  # gateway/ is agentmesh/gateway/ in the wheel


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads them from the checkout (make setup)
            self.run_command("build_assets")


setup(
    packages=packages(),
    package_dir={"agentmesh": "agentmesh", **MAPPED},
    cmdclass={"build_py": BuildPy, "build_assets": BuildAssets},
)
