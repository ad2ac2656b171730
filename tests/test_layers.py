"""The package's import graph has no cycle: each module sits above the ones it imports.

Edges are read from the source with `ast`, so nothing is imported. Three kinds of edge:
module-level imports (run when the module is imported), imports inside functions (deferred), and
imports under `if TYPE_CHECKING:` (for annotations only). The first kind must form a DAG. A cycle
through deferred imports cannot deadlock an import, but still means two modules each need the
other: none may exist either. Type-only cycles are listed, and only the known one is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dpltm

PACKAGE = Path(dpltm.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(target: str, modules: set[str]) -> str | None:
    """`dpltm.a.b.c` names module dpltm.a.b.c, or (from-import of a name) dpltm.a.b."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


KNOWN_TYPE_ONLY_CYCLES: list[list[str]] = []
"""Cycles closed only by imports for annotations: none (a new one is a failure to look at)."""


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_edges() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """(module-level, function-level, type-only) edges: module → the dpltm modules it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    top: dict[str, set[str]] = {m: set() for m in modules}
    deferred: dict[str, set[str]] = {m: set() for m in modules}
    typing: dict[str, set[str]] = {m: set() for m in modules}

    def targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:  # relative: from the module's package
            package = module if files[module].name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        return [f"{base}.{a.name}" for a in node.names]

    def visit(node: ast.AST, module: str, edges: dict[str, set[str]]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                for name in targets(child, module):
                    found = resolve(name, modules) if name.startswith("dpltm") else None
                    if found is not None and found != module:
                        edges[module].add(found)
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, module, deferred)
            elif is_type_checking(child):
                visit(child, module, typing)
            else:
                visit(child, module, edges)

    for module, path in files.items():
        visit(ast.parse(path.read_text("utf-8")), module, top)
    return top, deferred, typing


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_is_read() -> None:
    top, deferred, typing = import_edges()
    assert "dpltm.checkpoint" in top["dpltm.training.pipeline"]
    assert "dpltm.stages.train" in deferred["dpltm.stages.run"] | top["dpltm.stages.run"]
    assert "dpltm.audit.run" in typing["dpltm.training.pipeline"]


def test_module_level_imports_form_no_cycle() -> None:
    top, _, _ = import_edges()
    assert cycles(top) == []


def test_no_cycle_even_through_imports_inside_functions() -> None:
    top, deferred, _ = import_edges()
    assert cycles({m: top[m] | deferred[m] for m in top}) == []


def test_type_only_imports_close_no_new_cycle() -> None:
    """The audit's plan is annotated in dpltm.training.pipeline; the audit stage (dpltm.stages.audit) runs
    the pipeline, so dpltm.audit.run itself must not import it, nor the stage that does."""
    top, deferred, typing = import_edges()
    found = cycles({m: top[m] | deferred[m] | typing[m] for m in top})
    assert found == KNOWN_TYPE_ONLY_CYCLES


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
