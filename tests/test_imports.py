"""No import cycles in mtp/: between modules, and between subpackages (mtp.generate,
mtp.eval, ...; a top-level module counts as its own).

Every import counts, wherever it stands: at the top, inside a function (a lazy import
defers a cycle, it does not remove it) or under `if TYPE_CHECKING:`. Read from the source
(AST), so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mtp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The mtp modules that module `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from package import submodule` imports the submodule too
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # mtp.x.y.attr -> mtp.x.y
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _subpackage(name: str) -> str:
    """mtp.decode.engine -> mtp.generate; mtp.model -> mtp.model."""
    return ".".join(name.split(".")[:2])


def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    packages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        for target in targets:
            edge = (_subpackage(name), _subpackage(target))
            if edge[0] != edge[1]:
                packages.setdefault(edge[0], set()).add(edge[1])
    return graph, packages


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_import_graph_is_read_whole():
    graph, _ = _graphs()
    assert "mtp.decode.loop" in graph["mtp.decode"]  # a package's re-exports
    assert "mtp.kv_cache" in graph["mtp.model"]  # a TYPE_CHECKING import
    assert "mtp.checkpoint" in graph["mtp.decode.drafters.draft_model"]  # an import inside a function


def test_no_module_imports_itself_back():
    graph, _ = _graphs()
    assert _cycles(graph) == []


def test_no_subpackage_imports_itself_back():
    _, packages = _graphs()
    assert _cycles(packages) == []


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_kernels_room_imports_nothing_else_of_mtp():
    graph, _ = _graphs()
    kernels = {name for name in graph if name.startswith("mtp.kernels")}
    assert kernels >= {"mtp.kernels", "mtp.kernels.build"}
    assert set().union(*(graph[name] for name in kernels)) <= kernels


def test_the_command_line_room_imports_nothing_else_of_mtp():
    """mtp.cli holds the value checks that the model uses too: it stays below the model."""
    graph, _ = _graphs()
    assert "mtp.cli" in graph["mtp.model"]
    assert graph["mtp.cli"] == set()
