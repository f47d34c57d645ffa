"""vsim's layers: every import, at module level or inside a function, goes down (or sideways
within a layer), and no two of vsim's packages or top-level modules import each other, directly
or round a longer cycle. Imports are read from the source (ast), so an import hidden inside a
function to break a cycle at run time counts like any other.

A new module or package must be placed in LAYERS below (the test says so), which is the point:
deciding where it sits decides what it may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "vsim"

# Lowest first. A unit is a package under vsim/ or a top-level module (vsim/X.py -> "X";
# "__init__" is vsim/__init__.py). A unit may import units of its own layer or below.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "errors", "units", "spec", "fileio", "safeload"),  # spec strings; atomic writes;
                                               # bounded YAML/JSON reading
    ("trace",),                                # schema, io, migrate, importers
    ("hardware", "host", "compute", "compute_fit", "metrics", "inspect", "synthcheck", "retarget"),
    ("allocator",),
    ("plan", "workspace_free", "plan_io"),     # what the engine runs; the fallback's times
    ("engine",),                               # run_plan, simulate
    ("policies",),                             # plans; profiling runs through run_plan given
    ("search", "sweep", "sweep_output", "validate", "bench", "paper", "compare", "plots"),
    # the top: torch code (recording, and plans run for real: vsim/runtime where it exists)
    # and the command line
    ("record", "runtime", "cli", "__main__"),
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, root: Path) -> list[tuple[str, int]]:
    """(absolute module imported, line) for every import of vsim code in the file, anywhere in
    it (module level, functions, TYPE_CHECKING blocks)."""
    pkg = root.name
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names
                    if a.name == pkg or a.name.startswith(pkg + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == pkg or node.module.startswith(pkg + ".")):
                target = node.module
            else:
                continue
            for a in node.names:  # `from . import metrics` imports the module vsim.metrics
                sub = f"{target}.{a.name}"
                rel = Path(*sub.split(".")[1:])
                is_module = (root / rel).with_suffix(".py").is_file() or \
                    (root / rel / "__init__.py").is_file()
                out.append((sub if is_module else target, node.lineno))
    return out


def unit_graph(root: Path) -> dict[str, dict[str, str]]:
    """unit -> {imported unit: 'file:line' of the first such import}, other units only."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(root.rglob("*.py")):
        src = unit_of(module_name(path, root))
        graph.setdefault(src, {})
        for target, line in imports_of(path, root):
            dst = unit_of(target)
            if dst != src:
                graph[src].setdefault(dst, f"{path.relative_to(root.parent)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Each strongly connected group of more than one unit (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def upward(graph: dict[str, dict[str, str]], layer_of: dict[str, int]) -> list[str]:
    return [f"{where}: {src} (layer {layer_of[src]}) imports {dst} (layer {layer_of[dst]})"
            for src, targets in sorted(graph.items()) for dst, where in sorted(targets.items())
            if src in layer_of and dst in layer_of and layer_of[dst] > layer_of[src]]


GRAPH = unit_graph(ROOT)


def test_every_unit_has_a_layer():
    missing = sorted(set(GRAPH) - set(LAYER_OF))
    assert not missing, f"place these in LAYERS (tests/test_architecture.py): {missing}"


def test_no_cycle_between_vsims_packages_and_modules():
    found = cycles(GRAPH)
    detail = [f"{' <-> '.join(c)}: " + "; ".join(
        f"{a}->{b} at {GRAPH[a][b]}" for a in c for b in c if b in GRAPH[a]) for c in found]
    assert not found, "\n".join(detail)


def test_every_import_goes_down_the_layers():
    bad = upward(GRAPH, LAYER_OF)
    assert not bad, "\n".join(bad)


def test_the_engine_and_the_policies_meet_only_through_plans():
    # The engine runs plans and knows no policy; the policies reach the engine only through
    # the run_plan they are given, or the one default in policies/base.py (default_run_plan).
    assert "policies" not in GRAPH["engine"]
    assert "policies" not in GRAPH["allocator"]
    sites = sorted(path.name for path in (ROOT / "policies").rglob("*.py")
                   if any(unit_of(m) == "engine" for m, _ in imports_of(path, ROOT)))
    assert sites in ([], ["base.py"]), sites


# ---------------------------------------------------------------- the checker itself

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_checker_finds_a_cycle_hidden_in_a_function_and_an_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "low.py": "def f():\n    from .high import g\n",
        "high/__init__.py": "from ..low import f\n",
        "high/part.py": "from .. import low\nimport pkg.mid\n",
        "mid.py": "",
    })
    graph = unit_graph(root)
    assert graph["low"] == {"high": "pkg/low.py:2"}
    assert set(graph["high"]) == {"low", "mid"}
    assert cycles(graph) == [["high", "low"]]
    assert upward(graph, {"low": 0, "mid": 1, "high": 2}) == [
        "pkg/low.py:2: low (layer 0) imports high (layer 2)"]


@pytest.mark.parametrize("unit", ["record", "runtime"])
def test_torch_code_is_imported_only_from_the_top(unit):
    importers = sorted(src for src, targets in GRAPH.items() if unit in targets)
    assert all(LAYER_OF[s] == len(LAYERS) - 1 for s in importers), importers
