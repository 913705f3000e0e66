"""No import loops, at file or at package level: the packages below, and every other module of backend/ on its own,
import one another in one direction (parallel -> deployment -> memory -> model -> kernels).

The graph is read from the import statements of every file (with `ast`): those at module level and those inside a
function alike (a lazy import that goes back up is a loop all the same), but not those under `if TYPE_CHECKING:`,
which never run (the model names the pools' types so; the pools import the model's config). Each package is then
imported, module by module, in a fresh interpreter.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("backend.parallel", "backend.model", "backend.memory", "backend.scheduler", "backend.serving",
            "backend.structured", "kernels")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of backend/ and kernels/ (a package by its __init__)."""
    files = [*REPO.glob("backend/**/*.py"), *REPO.glob("kernels/*.py")]
    names = (".".join(f.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for f in files)
    return dict(zip(names, files))


def _runtime_imports(path: Path) -> list[str]:
    """What the file's import statements name (`from a import b`: a, and a.b in case it is a module), but those
    under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(branch.test) for node in ast.walk(branch)}
    named = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return named


def _graph(node_of) -> dict[str, set[str]]:
    """node -> the nodes it imports, a module's node being node_of(its name)."""
    modules = _modules()
    graph = defaultdict(set)
    for name, path in modules.items():
        for imported in _runtime_imports(path):
            while imported and imported not in modules:  # a name inside a module: the module
                imported = imported.rpartition(".")[0]
            if imported and node_of(imported) != node_of(name):
                graph[node_of(name)].add(node_of(imported))
    return graph


def _package_of(module: str) -> str:
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), module)


def _a_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """Some loop of the graph (its nodes, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # node -> "open" (on the path) or "done"
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (loop := visit(nxt)):
                return loop
        state[node] = "done"
        path.pop()
        return None

    return next((loop for node in sorted(graph) if node not in state and (loop := visit(node))), None)


def test_the_packages_import_one_another_in_one_direction():
    graph = _graph(_package_of)
    assert _a_loop(graph) is None, " -> ".join(_a_loop(graph))
    assert "backend.parallel" not in graph["backend.model"] | graph["backend.deployment"]  # the loop this broke


def test_no_module_imports_itself_back():
    graph = _graph(lambda module: module)
    assert _a_loop(graph) is None, " -> ".join(_a_loop(graph))


def test_the_loop_finder_finds_a_loop():
    assert _a_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_loop({"a": {"b", "c"}, "b": {"c"}}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_in_a_fresh_interpreter(package):
    modules = sorted(m for m in _modules() if _package_of(m) == package)
    code = "import importlib\nfor name in %r:\n    importlib.import_module(name)" % modules
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
