"""No import circles in the sidecar and kvtestbed packages (module-level imports,
``TYPE_CHECKING`` ones included: mypy and a reader follow those too). Imports inside functions
are lazy on purpose and not counted here (tests/test_layout.py counts them too).

Importing ``a.b.c`` runs ``a/b/__init__.py`` first, so an import is also an edge to every
package above its target that is not already above the importer (those are running already):
``kvtestbed.workload -> kvtestbed.engines.engine`` is an edge to ``kvtestbed.engines`` too,
whose ``__init__`` once re-exported the workload, and ``import kvtestbed.workload`` failed.

``KNOWN`` lists the circles that remain, each with who removes it; a new circle fails here,
and so does a listed one that is gone (so the list cannot go stale).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import kvtestbed

import sidecar

KNOWN: set[frozenset[str]] = set()


def package_modules(packages: tuple[ModuleType, ...] = (sidecar, kvtestbed)) -> dict[str, Path]:
    """Every module of the runtime (``sidecar``) and the testbed (``kvtestbed``), by name (or
    of ``packages``)."""
    modules: dict[str, Path] = {}
    for package in packages:
        root = Path(package.__file__).parent
        for path in root.rglob("*.py"):
            parts = (package.__name__, *path.relative_to(root).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def with_parent_packages(importer: str, targets: set[str], modules: dict[str, Path] | set[str]
                         ) -> set[str]:
    """``targets`` plus the packages whose ``__init__`` importing them runs: every package above a
    target, except the importer's own ancestors (already initialising when it runs)."""
    running = {importer.rsplit(".", depth)[0] for depth in range(1, importer.count(".") + 1)}
    edges = set(targets)
    for target in targets:
        parts = target.split(".")
        for end in range(1, len(parts)):
            package = ".".join(parts[:end])
            if package in modules and package not in running and package != importer:
                edges.add(package)
    return edges


def _module_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def visit(name: str, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If | ast.Try):
                for block in (node.body, node.orelse, *getattr(node, "handlers", ())):
                    visit(name, block if isinstance(block, list) else block.body)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    if target in modules or node.module in modules:
                        graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)

    for name, path in modules.items():
        visit(name, ast.parse(path.read_text()).body)
    return {name: with_parent_packages(name, targets, modules) for name, targets in graph.items()}


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == {frozenset({"a", "b", "c"})}
    assert circles({"a": {"b"}, "b": set()}) == set()


def test_an_import_runs_the_packages_above_its_target():
    modules = {"p", "p.engines", "p.engines.engine", "p.workload"}
    assert with_parent_packages("p.workload", {"p.engines.engine"}, modules) == {
        "p.engines", "p.engines.engine"}
    # a package's own modules do not depend on it: it is initialising when they run
    assert with_parent_packages("p.engines.engine", {"p.engines"}, modules) == {"p.engines"}
    assert with_parent_packages("p.engines", {"p.engines.engine"}, modules) == {
        "p.engines.engine"}


def test_no_import_circles_beyond_the_known_ones():
    found = circles(_module_graph())
    assert found - KNOWN == set(), "new import circle(s)"
    assert KNOWN - found == set(), "a known circle is gone: remove it from KNOWN"


def test_the_reference_engine_truth_and_tier_import_no_engine():
    graph = _module_graph()
    engine = "kvtestbed.engines.engine"
    for module in ("truth", "tier", "pool", "blocks", "pool_view", "sequence", "config"):
        assert engine not in graph[f"kvtestbed.engines.{module}"], module
