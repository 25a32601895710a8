"""The package's layer order (docs/DESIGN.md, "Layers"), checked on the source: a module imports
only from lower layers or from its own package, no import circle exists, and no ``echo`` module
is imported by name at run time (``importlib.import_module``), which would hide it from the
per-stage code versions."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ECHO = Path(__file__).resolve().parents[1] / "echo"

# Lowest first. A unit is a package (echo.trace) or a top-level module (echo.dedup); a unit may
# import units of lower layers and itself, never one of its own layer or above.
LAYERS: list[tuple[str, ...]] = [
    ("echo", "echo.errors"),
    ("echo.io", "echo.artifacts", "echo.reference", "echo.launch"),  # the base every stage shares
    ("echo.config",),
    ("echo.training",),                      # the training program every stage runs or records
    ("echo.trace", "echo.network", "echo.overlap"),
    ("echo.dedup", "echo.profile"),          # both read what the tracer records
    ("echo.simulate",),                      # costs collectives with the network model
    ("echo.plan",),                          # a whole run from a simulated step (failures, cost, energy)
    ("echo.report",),
    ("echo.validate",),
    ("echo.sweep",),                         # searches; their ranking of published layouts (published.py)
    ("echo.fit",),                           # fits hardware figures by tracing and simulating
    ("echo.workflow",),                      # the seams to Snakemake: paths, settings, params
    ("echo.cli",),
    ("echo.__main__",),
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path, root: Path = ECHO) -> str:
    parts = ["echo", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imports_of(path: Path, modules: set[str], root: Path = ECHO) -> tuple[set[str], list[str]]:
    """(echo modules the file imports, anywhere in it; dynamic import_module calls)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found, dynamic = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "echo")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base.split(".")[0] != "echo":
                continue
            # `from echo.trace import recorder` imports the submodule; `from echo.x import name` the module
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found.update(subs or {base})
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            arg = node.args[0] if node.args else None
            if not (isinstance(arg, ast.Constant) and not str(arg.value).startswith("echo")):
                dynamic.append(f"{me}:{node.lineno}")
    return {m for m in found if m in modules and m != me}, dynamic


def import_graph(root: Path = ECHO) -> tuple[nx.DiGraph, list[str]]:
    files = [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
    modules = {module_name(p, root) for p in files}
    graph, dynamic = nx.DiGraph(), []
    for p in files:
        found, dyn = imports_of(p, modules, root)
        graph.add_node(module_name(p, root))
        graph.add_edges_from((module_name(p, root), m) for m in found)
        dynamic += dyn
    return graph, dynamic


def back_edges(graph: nx.DiGraph) -> list[str]:
    """Imports from a unit to one of its own layer or above (other than itself)."""
    out = []
    for src, dst in graph.edges:
        a, b = unit_of(src), unit_of(dst)
        if a not in LAYER or b not in LAYER:
            out.append(f"{src} -> {dst}: {a if a not in LAYER else b} is in no layer (add it to LAYERS)")
        elif a != b and LAYER[b] >= LAYER[a]:
            out.append(f"{src} -> {dst}: layer {LAYER[a]} imports layer {LAYER[b]}")
    return sorted(out)


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_import_goes_down_the_layers(graph):
    g, _ = graph
    assert back_edges(g) == []


def test_no_import_circles(graph):
    g, _ = graph
    assert cycles(g) == []


def test_no_echo_module_is_imported_by_name(graph):
    _, dynamic = graph
    assert dynamic == []


@pytest.mark.parametrize("src,dst", [
    ("echo.profile.eager", "echo.validate.measure"),        # profile's code version spanning validate
    ("echo.trace.runner", "echo.simulate.stage"),           # the tracer reading the simulator's schedule
    ("echo.network.model", "echo.workflow.paths"),          # a stage rebuilding workflow paths
    ("echo.training.model", "echo.trace.recorder"),         # the training program knowing its tracer
])
def test_a_planted_back_edge_is_caught(graph, src, dst):
    g, _ = graph
    planted = g.copy()
    planted.add_edge(src, dst)
    assert any(line.startswith(f"{src} -> {dst}") for line in back_edges(planted))


def test_a_planted_circle_and_dynamic_import_are_caught(graph, tmp_path):
    g, _ = graph
    planted = g.copy()
    planted.add_edge("echo.training.layers", "echo.training.llama")  # llama imports layers already
    assert any({"echo.training.layers", "echo.training.llama"} <= set(c) for c in cycles(planted))
    pkg = tmp_path / "echo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lazy.py").write_text("import importlib\nm = importlib.import_module('echo.trace')\n")
    assert import_graph(pkg)[1] == ["echo.lazy:2"]
