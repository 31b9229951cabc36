"""The package's import graph: no cycle anywhere (imports inside functions and under TYPE_CHECKING included),
`runtime/` imports nothing from the layers above it (loading, the entry points, scale-out), and each top-level
package imports only what `docs/architecture.md`'s table allows it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "src" / "layerstream"
LEAVES = ("json_object", "lazy", "processes", "procfs", "wording")
"""Modules that import nothing of the package (but its errors) and that every package may import: small helpers with one home."""
RUNTIME_MAY_IMPORT = ("layerstream.runtime", "layerstream.plan", "layerstream.config", "layerstream.errors",
                      *(f"layerstream.{leaf}" for leaf in LEAVES))
"""`runtime/` sits on the plan's data and the package's errors; `models`, `omni`, `cli`, `server`, `bench`,
`distributed` and `offload` (the composition root) are above it."""


MAY_IMPORT: dict[str, frozenset[str]] = {
    name: frozenset(allowed.split())
    for name, allowed in {
        # the core, pure or moving bytes: nothing above it
        "errors": "",
        "atomic_write": "",
        **dict.fromkeys(LEAVES, ""),
        "json_object": "errors",  # its limit's error is the package's
        "timing": "",  # the ideal and the block timer: torch only, below the planner and the benchmarks alike
        "config": "errors",
        "plan": "config errors",
        "runtime": "config errors plan",
        # loading and scale-out, over the core
        "models": "config errors runtime",
        "request": "errors models",
        "outputs": "atomic_write errors request",  # a result encoded once into its file
        "pipeline_runner": "errors models outputs request runtime",  # a request made into one pipeline call
        "distributed": "config errors runtime",  # the launched group: torchrun's, joined where a config asks for allgather
        "host": "errors models plan",  # the host's free memory and a generation's reserve: below enabling and planning
        # the composition root, and planning for a machine above it
        "offload": "config distributed errors host models plan runtime",
        "machine": "config errors host models offload plan runtime timing",
        # the entry points; only the command line reaches the benchmarks
        "layerstream": "config errors plan",  # the public surface (the rest is imported on first use)
        "omni": "atomic_write config distributed errors models offload outputs pipeline_runner request runtime",
        "server": "layerstream atomic_write config distributed errors models omni outputs request runtime",
        "bench": "layerstream",
        "cli": "layerstream atomic_write bench config distributed errors machine models offload omni plan request runtime server",
        "__main__": "cli",
    }.items()
}
"""Top-level package (or module) -> the top-level packages it may import: the table of `docs/architecture.md`."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that `name` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("layerstream"):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    # a package's __init__ is imported with any of its modules, but ours hold no imports of their own modules
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_the_package():
    graph = _graph()
    assert len(graph) > 50  # the walk found the package
    assert _cycles(graph) == []


def test_runtime_imports_nothing_above_it():
    wrong = sorted(
        (name, target)
        for name, targets in _graph().items()
        if name.startswith("layerstream.runtime")
        for target in targets
        if not target.startswith(RUNTIME_MAY_IMPORT)
    )
    assert wrong == []


def test_runtime_top_level_holds_few_modules():
    top = [p.name for p in (PACKAGE_ROOT / "runtime").glob("*.py")]
    assert len(top) <= 8, top


def _top(name: str) -> str:
    """`layerstream.machine.planner` -> `machine`; the package itself -> `layerstream`."""
    return name.split(".")[1] if "." in name else name


def test_each_package_imports_only_what_the_architecture_allows():
    graph = _graph()
    assert {_top(name) for name in graph} == set(MAY_IMPORT)  # a new top-level package gets its row
    wrong = sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if _top(target) != _top(name) and _top(target) not in MAY_IMPORT[_top(name)] and _top(target) not in LEAVES
    )
    assert wrong == []


def test_the_planner_and_the_library_below_it_import_nothing_from_the_benchmarks():
    below_bench = {top for top, allowed in MAY_IMPORT.items() if top not in ("bench", "cli", "__main__")}
    assert all("bench" not in MAY_IMPORT[top] for top in below_bench)
    assert not [t for name, ts in _graph().items() if _top(name) == "machine" for t in ts if _top(t) == "bench"]


def test_nothing_below_the_planner_imports_it():
    """`machine/` (the planner) sits above `enable_offload`; what enabling reads of the host is in `host/`."""
    assert [top for top, allowed in MAY_IMPORT.items() if "machine" in allowed] == ["cli"]
