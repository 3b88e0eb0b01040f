"""The product's import graph, read from the source with ast: no cycle between modules of agentmesh.*,
and the layers of docs/architecture.md kept apart (a service imports no other service's package, libs/
imports no service and not the gateway, the gateway imports no service).

Every import counts, at module level or inside a function: one inside a function only hides a cycle
until that function runs. An import under `if TYPE_CHECKING:` never runs, so it makes no cycle; it
still couples two packages, so the layers count it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The folders of the one import root, as setup.py maps them.
FOLDERS = {
    "agentmesh": "agentmesh",
    "services": "agentmesh.services",
    "gateway": "agentmesh.gateway",
    "libs": "agentmesh.libs",
}
GENERATED = ("_pb2.py", "_pb2_grpc.py")  # agentmesh/<package>/v1: protoc's, importing only protobuf


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (the package, for a name that is not a module of it)
    line: int
    typing_only: bool  # under `if TYPE_CHECKING:`


def product_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of the product."""
    out: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            if path.name.endswith(GENERATED) or "__pycache__" in path.parts:
                continue
            parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str, modules: set[str], is_package: bool = False) -> list[Import]:
    """What `module` imports, among `modules`, wherever in its code (relative imports resolved)."""
    found: list[tuple[str, str | None, int, bool]] = []  # (base, name or None, line, typing only)

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for part in child.body:
                    visit_node(part, True)
                for part in child.orelse:
                    visit_node(part, typing_only)
            else:
                visit_node(child, typing_only)

    def visit_node(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno, typing_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            found.extend((base, alias.name, node.lineno, typing_only) for alias in node.names)
        else:
            visit(node, typing_only)

    visit(ast.parse(source), False)
    out: list[Import] = []
    for base, name, line, typing_only in found:
        target = f"{base}.{name}" if name and f"{base}.{name}" in modules else base
        while target and target not in modules:  # a name of a module, or a module outside the product
            target = target.rpartition(".")[0]
        if target and target != module:
            out.append(Import(module, target, line, typing_only))
    return out


def import_graph(root: Path = ROOT) -> list[Import]:
    modules = product_modules(root)
    names = set(modules)
    return [
        edge
        for name, path in modules.items()
        for edge in imports_of(name, path.read_text(encoding="utf-8"), names, path.name == "__init__.py")
    ]


def cycles(edges: list[Import]) -> list[list[Import]]:
    """One cycle of imports (as the edges that make it) per strongly connected group of modules."""
    graph: dict[str, list[Import]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.target not in index:
                connect(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_one_cycle(graph, group) for group in groups]


def _one_cycle(graph: dict[str, list[Import]], group: set[str]) -> list[Import]:
    """A path of imports inside `group` from its first module back to itself."""
    start = min(group)
    paths: dict[str, list[Import]] = {start: []}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for edge in graph[node]:
            if edge.target == start:
                return [*paths[node], edge]
            if edge.target in group and edge.target not in paths:
                paths[edge.target] = [*paths[node], edge]
                queue.append(edge.target)
    raise AssertionError(f"no cycle through {start}")


def area(module: str) -> str:
    """The layer a module belongs to: `services.<name>`, `gateway`, `libs`, or `agentmesh` (the rest:
    the CLI, the model server, the generated code)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "services":
        return f"services.{parts[2]}"
    if len(parts) > 1 and parts[1] in ("services", "gateway", "libs"):
        return parts[1]
    return "agentmesh"


def crosses_layers(edge: Import) -> bool:
    source, target = area(edge.source), area(edge.target)
    if source.startswith("services.") and target.startswith("services") and target != source:
        return True  # another service's package (or the folder of all of them)
    if source == "libs":
        return target.startswith("services") or target == "gateway"
    if source == "gateway":
        return target.startswith("services")
    return False


def _shown(path: list[Import]) -> str:
    return " -> ".join([path[0].source, *(f"{e.target} (line {e.line} of {e.source})" for e in path)])


def test_the_product_has_no_import_cycle() -> None:
    edges = [edge for edge in import_graph() if not edge.typing_only]
    assert len({edge.source for edge in edges}) > 100  # the product was found
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(_shown(path) for path in found)


def test_each_layer_imports_only_what_it_may() -> None:
    wrong = [edge for edge in import_graph() if crosses_layers(edge)]
    assert not wrong, "imports across layers:\n" + "\n".join(
        f"{e.source} (line {e.line}) imports {e.target}" for e in wrong
    )


def test_the_checks_see_imports_inside_functions_and_relative_ones(tmp_path: Path) -> None:
    """The checks themselves: a cycle closed by an import inside a function, a relative import, a name
    imported from a package, and a typing-only import."""
    (tmp_path / "services" / "orchestrator").mkdir(parents=True)
    (tmp_path / "services" / "trace").mkdir()
    (tmp_path / "libs").mkdir()
    (tmp_path / "gateway").mkdir()
    (tmp_path / "agentmesh").mkdir()
    files = {
        "services/__init__.py": "",
        "services/orchestrator/__init__.py": "from .turns import run\n",
        "services/orchestrator/turns.py": "from agentmesh.services.orchestrator import kinds\n",
        "services/orchestrator/kinds.py": "def f():\n    from . import turns\n",
        "services/trace/__init__.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from agentmesh.services.orchestrator.turns import run\n",
        "libs/__init__.py": "",
        "libs/ids.py": "import agentmesh.libs.errors\n",
        "libs/errors.py": "",
        "gateway/__init__.py": "",
        "gateway/app.py": "from agentmesh.libs import ids, missing_name\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    edges = import_graph(tmp_path)
    shown = {(e.source, e.target, e.typing_only) for e in edges}
    assert ("agentmesh.services.orchestrator", "agentmesh.services.orchestrator.turns", False) in shown
    assert ("agentmesh.services.orchestrator.kinds", "agentmesh.services.orchestrator.turns", False) in shown
    assert ("agentmesh.services.trace", "agentmesh.services.orchestrator.turns", True) in shown
    assert ("agentmesh.libs.ids", "agentmesh.libs.errors", False) in shown
    assert ("agentmesh.gateway.app", "agentmesh.libs.ids", False) in shown
    assert ("agentmesh.gateway.app", "agentmesh.libs", False) in shown  # a name that is no module
    [cycle] = cycles([e for e in edges if not e.typing_only])
    assert [(e.source, e.target) for e in cycle] == [
        ("agentmesh.services.orchestrator.kinds", "agentmesh.services.orchestrator.turns"),
        ("agentmesh.services.orchestrator.turns", "agentmesh.services.orchestrator.kinds"),
    ]
    assert [(e.source, e.target) for e in edges if crosses_layers(e)] == [
        ("agentmesh.services.trace", "agentmesh.services.orchestrator.turns")
    ]
