"""One class's traced graph as a networkx DiGraph: ops as nodes, dependencies as edges.

Exported as GraphML or Graphviz dot (``python -m echo graph``) for inspection in other tools.
Nodes carry the op's name, class, phase, chunk, stream, shapes, FLOPs and bytes; collectives also
their op, group kind, size and bytes. Edges carry the dependency kind (data, or stream order).
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pyarrow.compute as pc

from echo.artifacts import RANK_CLASSES
from echo.io import atomic_path, read_parquet

_NODE_COLUMNS = ("name", "op_class", "kind", "phase", "chunk", "stream", "shapes", "dtype", "flops", "bytes")


def class_graph(trace_dir: Path, rank_classes: Path, class_id: int) -> nx.DiGraph:
    """The graph of ``class_id``'s representative rank."""
    classes = read_parquet(rank_classes, RANK_CLASSES)
    reps = classes.filter(pc.equal(classes["class_id"], class_id))["representative"].to_pylist()
    if not reps:
        known = sorted(set(classes["class_id"].to_pylist()))
        raise ValueError(f"{rank_classes}: no class {class_id}; classes: {known}")
    rank = reps[0]
    ops = _rows(trace_dir / "ops.parquet", rank)
    comms = {r["comm_id"]: r for r in _rows(trace_dir / "comms.parquet", rank)}
    g = nx.DiGraph(rank=rank, class_id=class_id)
    last_on_stream: dict[str, int] = {}
    for op in ops:
        attrs = {k: op[k] for k in _NODE_COLUMNS}
        if op["comm_id"] >= 0:
            c = comms[op["comm_id"]]
            attrs |= {"collective": c["op"], "group_kind": c["group_kind"], "group_size": c["group_size"],
                      "comm_bytes": c["bytes"], "peer": c["peer"]}
        g.add_node(op["seq"], **attrs)
        prev = last_on_stream.get(op["stream"])
        if prev is not None:
            g.add_edge(prev, op["seq"], kind="stream")
        last_on_stream[op["stream"]] = op["seq"]
    for d in _rows(trace_dir / "deps.parquet", rank):
        g.add_edge(d["src"], d["dst"], kind=d["kind"])
    return g


def write_graph(g: nx.DiGraph, path: Path, fmt: str) -> None:
    with atomic_path(path) as tmp:
        if fmt == "graphml":
            nx.write_graphml(g, tmp)
        elif fmt == "dot":
            tmp.write_text(_dot(g))
        else:
            raise ValueError(f"unknown graph format '{fmt}'; use graphml or dot")


def _dot(g: nx.DiGraph) -> str:
    lines = [f'digraph "rank{g.graph["rank"]}" {{', "  node [shape=box, fontsize=9];"]
    for n, a in g.nodes(data=True):
        label = f'{a["name"]}\\n{a["phase"]} {a["stream"]} {a["shapes"]}'.replace('"', "'")
        lines.append(f'  {n} [label="{label}"];')
    for u, v, a in g.edges(data=True):
        style = "dashed" if a["kind"] == "stream" else "solid"
        lines.append(f"  {u} -> {v} [style={style}];")
    return "\n".join(lines + ["}"]) + "\n"


def _rows(path: Path, rank: int) -> list[dict]:
    t = read_parquet(path)
    return t.filter(pc.equal(t["rank"], rank)).to_pylist()
