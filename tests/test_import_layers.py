"""The import graph of lit_cbs keeps the layers docs/design.md draws (its Architecture section): every module
imports only modules of its own layer or of a lower one, and no modules import each other, directly or round a
circle. Every import statement that runs counts, also one inside a function: it hides the arrow from a reader, not
from Python; one under ``if TYPE_CHECKING:`` never runs, but a type checker follows it, so no circle may run
through those either. ``from package import name`` of a name the package loads on first use (its ``_EXPORTS``) is
an arrow to the module that defines the name."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import lit_cbs

PACKAGE = Path(lit_cbs.__file__).parent

# Bottom first. A module's layer is that of the longest entry it equals or lies under ("lit_cbs" itself is only the
# package's __init__). docs/design.md lists the same layers and says why each sits where it does.
LAYERS = [
    (
        "foundation",
        ["lit_cbs", "lit_cbs._figures", "lit_cbs._internals", "lit_cbs._lazy", "lit_cbs.errors", "lit_cbs.metrics"],
    ),
    ("rules", ["lit_cbs.rules"]),
    ("the probe's reading", ["lit_cbs.probe.reading"]),
    ("analysis", ["lit_cbs.analysis"]),
    ("plots", ["lit_cbs.analysis.plots", "lit_cbs.probe.plot"]),
    ("data", ["lit_cbs.data"]),
    ("callbacks", ["lit_cbs.callbacks"]),
    ("models", ["lit_cbs.models"]),
    ("measurements", ["lit_cbs.probe", "lit_cbs.gns"]),
    ("programs", ["lit_cbs.run", "lit_cbs.litgpt"]),
]


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file (a package by its ``__init__.py``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def lazy_exports(init: Path) -> dict[str, str]:
    """The names a package's ``__init__.py`` loads on first use (``lit_cbs._lazy``): name -> the module that defines
    it. Its ``_EXPORTS`` table (and the ``_MODULES`` one it may be built from) is evaluated alone: nothing imported."""
    tables = [
        node
        for node in ast.parse(init.read_text()).body
        if isinstance(node, ast.Assign)
        and any(getattr(target, "id", None) in ("_EXPORTS", "_MODULES") for target in node.targets)
    ]
    namespace: dict = {}
    exec(compile(ast.Module(tables, type_ignores=[]), str(init), "exec"), namespace)
    return namespace.get("_EXPORTS", {})


def type_checking_only(tree: ast.Module) -> set[ast.stmt]:
    """The imports inside ``if TYPE_CHECKING:`` blocks: seen by type checkers, never run (a package's exports)."""
    blocks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    return {child for block in blocks for child in ast.walk(block) if isinstance(child, (ast.Import, ast.ImportFrom))}


def imports(modules: dict[str, Path], typed: bool = False) -> dict[str, dict[str, int]]:
    """module -> {lit_cbs module it imports: line of the first such import}, from the source of each. With
    ``typed``, also the imports a type checker follows (``if TYPE_CHECKING:``) in modules, not in a package's
    ``__init__.py``, whose block repeats its lazy exports for type checkers."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        arrows: dict[str, int] = {}
        tree = ast.parse(path.read_text(), str(path))
        unrun = type_checking_only(tree) if not typed or path.name == "__init__.py" else set()
        for node in ast.walk(tree):
            if node in unrun:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                targets = [_from_target(base, alias.name, modules) for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import lit_cbs.a.b` binds lit_cbs, imports lit_cbs.a.b
                    target = target.rpartition(".")[0]
                if target and target != module:
                    arrows.setdefault(target, node.lineno)
        graph[module] = arrows
    return graph


def _from_target(base: str, name: str, modules: dict[str, Path]) -> str:
    if f"{base}.{name}" in modules:
        return f"{base}.{name}"
    if base in modules and modules[base].name == "__init__.py":
        return lazy_exports(modules[base]).get(name, base)
    return base


def layer_of(module: str) -> int | None:
    """The index in LAYERS of ``module``'s layer, None where no entry covers it."""
    found = [
        (len(entry), index)
        for index, (_, entries) in enumerate(LAYERS)
        for entry in entries
        if module == entry or (entry != "lit_cbs" and module.startswith(entry + "."))
    ]
    return max(found)[1] if found else None


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    found = []
    for module, arrows in sorted(graph.items()):
        for target, line in sorted(arrows.items()):
            low, high = layer_of(module), layer_of(target)
            if high > low:
                higher = f"{target} ({LAYERS[high][0]}, a higher layer)"
                found.append(f"{module} ({LAYERS[low][0]}) imports {higher}, line {line}")
    return found


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle of imports through each strongly connected group of modules (Tarjan's algorithm), as the
    modules in import order, the first repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_circle_in(graph, set(group)) for group in groups]


def _circle_in(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest circle through the group's first module (by name), by breadth-first search."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    return [*paths[module], start]
                if target in group and target not in paths:
                    paths[target] = [*paths[module], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # a strongly connected group always has one


def describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return " -> ".join(f"{module} (line {graph[module][target]})" for module, target in zip(circle, circle[1:])) + (
        f" -> {circle[-1]}"
    )


@pytest.fixture(scope="module")
def graph():
    return imports(module_files())


def test_every_module_has_a_layer(graph):
    unplaced = [module for module in graph if layer_of(module) is None]
    assert not unplaced, f"place these in LAYERS here and in docs/design.md's Architecture: {unplaced}"


def test_no_module_imports_from_a_higher_layer(graph):
    found = upward_imports(graph)
    assert not found, "imports from a higher layer:\n" + "\n".join(found)


def test_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(describe(graph, circle) for circle in found)


def test_no_import_circles_for_type_checkers_either():
    # A module that imports another only for its annotations still depends on it: no circle through such imports.
    typed = imports(module_files(), typed=True)
    found = circles(typed)
    assert not found, "import circles, counting imports under TYPE_CHECKING:\n" + "\n".join(
        describe(typed, circle) for circle in found
    )


def test_the_check_sees_hidden_circles_and_upward_imports(tmp_path):
    # A package with the faults the checks above look for, each behind an import inside a function.
    package = tmp_path / "lit_cbs"
    for folder, source in {
        "rules/__init__.py": "",
        "rules/a.py": "def f():\n    from lit_cbs.rules.b import g\n",
        "rules/b.py": "from lit_cbs.rules import a\n",
        "callbacks/__init__.py": "",
        "callbacks/c.py": "",
        "analysis/__init__.py": "_EXPORTS = {'h': 'lit_cbs.analysis.d'}\n",
        "analysis/d.py": "def h():\n    import lit_cbs.callbacks.c\n",
        "analysis/e.py": "from lit_cbs.analysis import h\n",
        "data/__init__.py": "",
        "data/f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lit_cbs.data.g import G\n",
        "data/g.py": "from lit_cbs.data.f import F\n",
    }.items():
        (package / folder).parent.mkdir(parents=True, exist_ok=True)
        (package / folder).write_text(source)
    toy = imports(module_files(package))
    assert toy["lit_cbs.analysis.e"] == {"lit_cbs.analysis.d": 1}  # through the lazy export, to where h lives
    assert upward_imports(toy) == [
        "lit_cbs.analysis.d (analysis) imports lit_cbs.callbacks.c (callbacks, a higher layer), line 2"
    ]
    (circle,) = circles(toy)
    assert describe(toy, circle) == "lit_cbs.rules.a (line 2) -> lit_cbs.rules.b (line 1) -> lit_cbs.rules.a"
    typed = imports(module_files(package), typed=True)  # the annotation-only import counts for type checkers
    assert [describe(typed, circle) for circle in circles(typed)] == [
        "lit_cbs.data.f (line 3) -> lit_cbs.data.g (line 1) -> lit_cbs.data.f",
        "lit_cbs.rules.a (line 2) -> lit_cbs.rules.b (line 1) -> lit_cbs.rules.a",
    ]
