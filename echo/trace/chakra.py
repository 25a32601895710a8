"""Chakra execution traces out of and into Echo's trace tables (echo.trace.chakra_schema).

Export (``export_trace``): one file per traced rank, ``{workload}.{rank}.et``, each with its
ops as nodes, in trace order (node id = the op's seq):

- compute and memcpy ops: ``COMP_NODE`` (memcpy: ``MEM_LOAD_NODE``) with ``num_ops`` (FLOPs),
  ``tensor_size`` (bytes read and written), ``is_cpu_op`` false and, when the workload's profile is
  given, ``duration_micros`` (the costed duration, rounded to the microsecond as the field is);
- collectives: ``COMM_COLL_NODE`` with ``comm_type``, ``comm_size`` (bytes, nccl-tests' count) and
  ``pg_name`` (a key of ``comm_groups.json``: the group's global ranks, as ASTRA-sim reads it);
- pipeline send / recv: ``COMM_SEND_NODE`` / ``COMM_RECV_NODE`` with ``comm_src``, ``comm_dst``,
  ``comm_tag`` (the comm id) and ``comm_size``;
- dependencies: data dependencies in ``data_deps``; stream order and waits in ``ctrl_deps``,
  including each op's predecessor on its own stream, which Echo's tables leave implicit and a
  simulator that reads only the graph needs.

Each node also carries its Echo row (``echo.op``, ``echo.comm``, ``echo.deps``, JSON strings), and
the metadata the traced rank's row and the tables' Arrow schemas, so that ``import_trace`` rebuilds
the very tables that were exported: the round trip loses no node, dependency or column.
``manifest.json`` lists the files, the rank classes (which world rank runs which file's graph)
and the schema version.

Import of another tool's graph (no ``echo.*`` attributes): nodes become ops of the rank the file
names (``prefix.{rank}.et``), phase forward, costed by the hardware model from ``num_ops`` and
``tensor_size`` (their ``duration_micros`` is not used); each role of the workload's layout needs a
file, and the graph is that role's whole step (one micro-batch, no pipeline schedule around it).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pyarrow as pa

from echo.artifacts import COMMS, DEPS, OPS, TRACED_RANKS
from echo.io import atomic_path, read_parquet, write_json, write_parquet
from echo.trace import chakra_schema as cs
from echo.trace.chakra_schema import COLLECTIVE_TYPE, NODE_TYPE, ChakraError, attr, attr_value
from echo.trace.hashing import kernel_key

MANIFEST = "manifest.json"
COMM_GROUPS = "comm_groups.json"
_TABLES = {"ops": OPS, "comms": COMMS, "deps": DEPS, "ranks": TRACED_RANKS}
# Echo's collective names -> Chakra's CollectiveCommType, and back
_TO_CHAKRA = {"all_reduce": "ALL_REDUCE", "all_gather": "ALL_GATHER", "reduce_scatter": "REDUCE_SCATTER",
              "all_to_all": "ALL_TO_ALL", "broadcast": "BROADCAST", "reduce": "REDUCE", "gather": "GATHER",
              "scatter": "SCATTER", "barrier": "BARRIER"}
_FROM_CHAKRA = {v: k for k, v in _TO_CHAKRA.items()} | {"REDUCE_SCATTER_BLOCK": "reduce_scatter"}
_RANK_IN_NAME = re.compile(r"\.(\d+)\.et$")


# --- export ---------------------------------------------------------------------------------
def export_trace(trace_dir: Path, out_dir: Path, workload: str, rank_classes: Path | None = None,
                 durations_us: dict[str, float] | None = None) -> dict:
    """Write every traced rank of ``trace_dir`` as a Chakra ET file under ``out_dir``; the manifest."""
    tables = {name: read_parquet(Path(trace_dir) / f"{name}.parquet") for name in _TABLES}
    groups: dict[tuple[int, ...], str] = {}
    files = {}
    for rank_row in tables["ranks"].to_pylist():
        rank = rank_row["rank"]
        path = Path(out_dir) / f"{workload}.{rank}.et"
        nodes = _rank_nodes(rank, tables, groups, durations_us or {})
        meta = cs.messages()["GlobalMetadata"](version=cs.SCHEMA_VERSION)
        meta.attr.append(attr("echo.workload", workload))
        meta.attr.append(attr("echo.rank", json.dumps(rank_row)))
        for name, table in tables.items():
            meta.attr.append(attr(f"echo.schema.{name}", table.schema.serialize().to_pybytes(), "bytes"))
        with atomic_path(path) as tmp, open(tmp, "wb") as fh:
            cs.write_messages(fh, [meta, *nodes])
        files[str(rank)] = path.name
    write_json({pg: list(g) for g, pg in groups.items()}, Path(out_dir) / COMM_GROUPS)
    manifest = {"schema": f"chakra-et {cs.SCHEMA_VERSION}", "workload": workload, "files": files,
                "comm_groups": COMM_GROUPS, "costed": bool(durations_us)}
    if rank_classes is not None and Path(rank_classes).is_file():
        rc = read_parquet(rank_classes)
        manifest["rank_files"] = {str(r): files[str(rep)] for r, rep in
                                  zip(rc["rank"].to_pylist(), rc["representative"].to_pylist(), strict=True)}
    write_json(manifest, Path(out_dir) / MANIFEST)
    return manifest


def _rank_nodes(rank: int, tables: dict[str, pa.Table], groups: dict, durations: dict[str, float]) -> list:
    ops = [r for r in tables["ops"].to_pylist() if r["rank"] == rank]
    comms = {r["comm_id"]: r for r in tables["comms"].to_pylist() if r["rank"] == rank}
    deps: dict[int, list[tuple[int, str]]] = {}
    for d in tables["deps"].to_pylist():
        if d["rank"] == rank:
            deps.setdefault(d["dst"], []).append((d["src"], d["kind"]))
    Node = cs.messages()["Node"]
    last_on_stream: dict[str, int] = {}
    nodes = []
    for op in ops:
        seq = op["seq"]
        node = Node(id=seq, name=op["name"])
        mine = deps.get(seq, [])
        node.data_deps.extend(sorted({s for s, k in mine if k == "data"}))
        ctrl = {s for s, k in mine if k != "data"}
        if op["stream"] in last_on_stream:
            ctrl.add(last_on_stream[op["stream"]])
        node.ctrl_deps.extend(sorted(ctrl - set(node.data_deps)))
        last_on_stream[op["stream"]] = seq
        node.attr.append(attr("echo.op", json.dumps(op)))
        node.attr.append(attr("echo.deps", json.dumps(mine)))
        comm = comms.get(op["comm_id"]) if op["comm_id"] >= 0 else None
        if comm is None:
            node.type = NODE_TYPE["MEM_LOAD_NODE" if op["kind"] == "memcpy" else "COMP_NODE"]
            node.attr.append(attr("is_cpu_op", False))
            node.attr.append(attr("num_ops", int(op["flops"])))
            node.attr.append(attr("tensor_size", int(op["bytes"]), "uint64"))
            if op["kernel_key"] in durations:
                us = float(durations[op["kernel_key"]])
                node.duration_micros = round(us)
                node.attr.append(attr("echo.duration_us", us))
        else:
            node.attr.append(attr("echo.comm", json.dumps(comm)))
            node.attr.append(attr("is_cpu_op", False))
            if comm["op"] in ("send", "recv"):
                node.type = NODE_TYPE["COMM_SEND_NODE" if comm["op"] == "send" else "COMM_RECV_NODE"]
                src, dst = (rank, comm["peer"]) if comm["op"] == "send" else (comm["peer"], rank)
                node.attr.extend([attr("comm_src", src, "int32"), attr("comm_dst", dst, "int32"),
                                  attr("comm_tag", comm["comm_id"], "int32")])
            else:
                node.type = NODE_TYPE["COMM_COLL_NODE"]
                node.attr.append(attr("comm_type", COLLECTIVE_TYPE[_TO_CHAKRA[comm["op"]]]))
                pg = groups.setdefault(tuple(comm["group"]), str(len(groups)))
                node.attr.append(attr("pg_name", pg))
            node.attr.append(attr("comm_size", int(comm["bytes"])))
        nodes.append(node)
    return nodes


# --- import ---------------------------------------------------------------------------------
def read_et(path: Path) -> tuple[object, list]:
    """(GlobalMetadata, nodes) of one Chakra ET file; ChakraError naming it when unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ChakraError(f"{path}: no such file")
    meta, nodes = cs.read_file(path.read_bytes(), str(path))
    return meta, list(nodes)


def et_files(path: Path) -> list[Path]:
    """The .et files of a folder (an export's, or another tool's ``prefix.{rank}.et``), or one file."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.et")) if path.is_dir() else []
    if not files:
        raise ChakraError(f"{path}: no Chakra ET files (*.et)")
    return files


def import_trace(path: Path, out_dir: Path, workload=None, comm_groups: dict[str, list[int]] | None = None) -> dict:
    """Rebuild trace tables (ops, comms, deps, ranks .parquet) under ``out_dir`` from Chakra ET
    files; ``workload`` (echo.config.Workload) gives another tool's graphs their roles and is
    checked to run each once per step. Every file is read and checked before any table is written."""
    from echo.training.layout import Layout

    files = et_files(path)
    layout = Layout(workload.parallel) if workload is not None else None
    groups = comm_groups
    if groups is None and (Path(path) / COMM_GROUPS).is_file():
        groups = json.loads((Path(path) / COMM_GROUPS).read_text())
    rows: dict[str, list[dict]] = {name: [] for name in _TABLES}
    schemas: dict[str, pa.Schema] = {}
    foreign = False
    for f in files:
        meta, nodes = read_et(f)
        mattrs = {a.name: attr_value(a) for a in meta.attr}
        if "echo.rank" in mattrs:
            _echo_rows(f, mattrs, nodes, rows, schemas)
        else:
            foreign = True
            _foreign_rows(f, nodes, rows, layout, groups or {})
    if foreign and workload is not None and (workload.micro_batches != 1 or workload.parallel.pp != 1):
        raise ChakraError(f"{path}: another tool's graph is a whole step: its workload must run one "
                          f"micro-batch on one pipeline stage (has {workload.micro_batches} micro-batches, "
                          f"pp {workload.parallel.pp}); set training.global_batch = micro_batch x dp and pp = 1")
    ranks = [r["rank"] for r in rows["ranks"]]
    if len(set(ranks)) != len(ranks):
        raise ChakraError(f"{path}: two files hold rank {sorted(r for r in ranks if ranks.count(r) > 1)[0]}")
    if layout is not None:
        roles = {r["role"] for r in rows["ranks"]}
        missing = sorted({layout.role_of(r) for r in range(layout.world_size)} - roles)
        if missing:
            raise ChakraError(f"{path}: no graph for role(s) {missing} of the workload's layout: "
                              "each role needs a file (prefix.{rank}.et of one of its ranks)")
    for name, contract in _TABLES.items():
        schema = schemas.get(name, contract)
        table = pa.Table.from_pylist(rows[name], schema=schema)
        write_parquet(table, Path(out_dir) / f"{name}.parquet", contract)
    return {"files": [str(f) for f in files], "ranks": sorted(ranks), "ops": len(rows["ops"]),
            "deps": len(rows["deps"]), "comms": len(rows["comms"])}


def _echo_rows(f: Path, mattrs: dict, nodes: list, rows: dict, schemas: dict) -> None:
    """An Echo export: its rows as they were."""
    rank_row = json.loads(mattrs["echo.rank"])
    rows["ranks"].append(rank_row)
    for name in _TABLES:
        blob = mattrs.get(f"echo.schema.{name}")
        if blob:
            schemas.setdefault(name, pa.ipc.read_schema(pa.py_buffer(blob)))
    for n in nodes:
        a = {x.name: attr_value(x) for x in n.attr}
        if "echo.op" not in a:
            raise ChakraError(f"{f}: node {n.id} has no echo.op attribute (a node added by another tool "
                              "to an Echo export is not supported)")
        rows["ops"].append(json.loads(a["echo.op"]))
        if "echo.comm" in a:
            rows["comms"].append(json.loads(a["echo.comm"]))
        rows["deps"] += [{"rank": rank_row["rank"], "src": s, "dst": n.id, "kind": k}
                         for s, k in json.loads(a["echo.deps"])]


def _foreign_rows(f: Path, nodes: list, rows: dict, layout, groups: dict) -> None:
    """Another tool's graph: nodes in file order, costed from num_ops / tensor_size."""
    m = _RANK_IN_NAME.search(f.name)
    if m is None:
        raise ChakraError(f"{f}: name it prefix.{{rank}}.et (the rank whose graph it is)")
    rank = int(m.group(1))
    if layout is None:
        raise ChakraError(f"{f}: a graph from another tool needs the workload (its layout names the roles)")
    if rank >= layout.world_size:
        raise ChakraError(f"{f}: rank {rank} is not in the workload's world of {layout.world_size}")
    seq_of = {n.id: i for i, n in enumerate(nodes)}
    c = layout.coords(rank)
    for i, n in enumerate(nodes):
        a = {x.name: attr_value(x) for x in n.attr}
        kind, stream, comm_id = _foreign_kind(f, n), "compute", -1
        flops, nbytes = float(a.get("num_ops") or 0), float(a.get("tensor_size") or a.get("comm_size") or 0)
        if kind in ("collective", "p2p"):
            comm_id, stream = len([r for r in rows["comms"] if r["rank"] == rank]), "comm" if kind == "collective" else "p2p"
            rows["comms"].append(_foreign_comm(f, n, a, rank, comm_id, i, layout, groups))
        args = json.dumps({"chakra": {"num_ops": flops, "tensor_size": nbytes}})
        name = f"chakra.{n.name or 'node'}"
        rows["ops"].append({"rank": rank, "seq": i, "name": name, "op_class": "other" if kind == "compute" else kind,
                            "kind": kind, "phase": "forward", "chunk": 0, "microbatch": -1, "stream": stream,
                            "shapes": "[]", "args": args, "dtype": "bfloat16", "flops": flops, "bytes": nbytes,
                            "kernel_key": kernel_key(name, args), "comm_id": comm_id, "dtensor": 0})
        for dep, dkind in [(d, "data") for d in n.data_deps] + [(d, "stream") for d in n.ctrl_deps]:
            if dep not in seq_of:
                raise ChakraError(f"{f}: node {n.id} depends on node {dep}, which the file does not hold")
            rows["deps"].append({"rank": rank, "src": seq_of[dep], "dst": i, "kind": dkind})
    digest = hashlib.sha256(f.read_bytes()).hexdigest()[:20]
    rows["ranks"].append({"rank": rank, "role": layout.role_of(rank), "pp_rank": c.pp, "tp_rank": c.tp,
                          "dp_rank": c.dp, "cp_rank": c.cp, "graph_hash": digest, "param_bytes": 0, "grad_bytes": 0,
                          "optimizer_bytes": 0, "activation_bytes_per_microbatch": 0, "trace_wall_s": 0.0})


def _foreign_kind(f: Path, n) -> str:
    kinds = {NODE_TYPE["COMP_NODE"]: "compute", NODE_TYPE["MEM_LOAD_NODE"]: "memcpy",
             NODE_TYPE["MEM_STORE_NODE"]: "memcpy", NODE_TYPE["COMM_COLL_NODE"]: "collective",
             NODE_TYPE["COMM_SEND_NODE"]: "p2p", NODE_TYPE["COMM_RECV_NODE"]: "p2p"}
    if n.type not in kinds:
        raise ChakraError(f"{f}: node {n.id} has type {cs.NODE_TYPES[n.type] if n.type < len(cs.NODE_TYPES) else n.type}, "
                          "which Echo does not simulate")
    return kinds[n.type]


def _foreign_comm(f, n, a, rank, comm_id, seq, layout, groups) -> dict:
    world = list(range(layout.world_size))
    size = int(a.get("comm_size") or 0)
    if n.type == NODE_TYPE["COMM_COLL_NODE"]:
        ctype = a.get("comm_type", 0)
        op = _FROM_CHAKRA.get(cs.COLLECTIVE_TYPES[ctype] if ctype < len(cs.COLLECTIVE_TYPES) else "")
        if op is None:
            raise ChakraError(f"{f}: node {n.id}: comm_type {ctype} is no collective Echo models")
        pg = a.get("pg_name")
        group = groups.get(pg) if pg else world
        if group is None:
            raise ChakraError(f"{f}: node {n.id}: pg_name '{pg}' is not in {COMM_GROUPS}")
        return {"rank": rank, "comm_id": comm_id, "seq": seq, "op": op, "group": list(group),
                "group_size": len(group), "group_kind": group_kind(layout, rank, list(group)),
                "bytes": size, "peer": -1, "dtype": "bfloat16", "phase": "forward", "chunk": 0, "blocking": False}
    send = n.type == NODE_TYPE["COMM_SEND_NODE"]
    peer = int(a.get("comm_dst") if send else a.get("comm_src", 0))
    return {"rank": rank, "comm_id": comm_id, "seq": seq, "op": "send" if send else "recv",
            "group": [rank, peer], "group_size": 2, "group_kind": "pp", "bytes": size, "peer": peer,
            "dtype": "bfloat16", "phase": "forward", "chunk": 0, "blocking": False}


def group_kind(layout, rank: int, group: list[int]) -> str:
    """The mesh dimension whose group of ``rank`` is ``group`` (tp, cp, dp, pp, ep, edp, dpcp,
    stage, world); "other" for a group the layout does not form."""
    for dim in ("tp", "cp", "dp", "pp", "dpcp", "stage", "world"):
        if layout.group(rank, dim) == sorted(group):
            return dim
    for dim in ("ep", "edp"):
        if layout.expert_group(rank, dim) == sorted(group):
            return dim
    return "other"
