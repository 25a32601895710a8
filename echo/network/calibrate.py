"""The calibrate stage: a collective cost model for one topology, and a table of its predictions.

``run_calibrate(topology, out_dir, logs=None)`` writes into ``out_dir``
- ``network.json``: the model (topology, parameters, ``source`` nominal | fitted, and what the
  fit saw and how well it matched), which the simulate stage loads with ``NetworkModel.load``;
- ``collectives.parquet`` (COLLECTIVES): predictions of every op over the group shapes that
  matter (sub-node groups, whole nodes, multi-node groups with all or one GPU per node, every
  measured shape) and sizes 1 KiB..16 GiB, with the measurement alongside where one was taken;
- ``measurements.parquet`` (``echo.network.nccl_tests.MEASUREMENTS``): every measured point
  (empty for a nominal topology);
- ``busbw.png``: measured (markers) and predicted (lines) bus bandwidth over message size, one
  colour per GPU count.

Where the costs come from (``topology.calibration.source``):
- ``nominal``: the topology's figures (the artifact says ``source: model``);
- ``gloo_benchmark``: a real torch.distributed gloo benchmark on this machine
  (``echo.network.gloo_bench``), alpha/beta fitted per op (``echo.network.fit.fit_params``);
- ``nccl_tests``: the nccl-tests logs the topology names (``echo.network.nccl_tests``), fitted
  per tier (``echo.network.fit.fit_nccl_tests``). The fit summary holds each log's accuracy
  (mean/max error from 1 MiB, latency floor) and, for every multi-node log, a leave-one-out
  check: refit without it and predict it, and (logs of two or more node counts) a
  leave-one-node-count-out check: refit without every log of one node count and predict them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from echo.artifacts import COLLECTIVES
from echo.config import Topology
from echo.errors import ConfigError
from echo.io import write_parquet
from echo.network.costs import OPS, P2P_OPS, NetworkParams, Shape
from echo.network.fit import (
    fit_api_overheads,
    fit_nccl_tests,
    fit_params,
    leave_node_count_out,
    leave_one_out,
    runs_from_measurements,
)
from echo.network.gloo_bench import FUNCTIONAL, run_gloo_benchmark
from echo.network.model import NetworkModel
from echo.network.nccl_tests import MEASUREMENTS, read_log, resolve_logs
from echo.network.plots import plot_busbw

SIZES = [1024 << i for i in range(25)]  # 1 KiB .. 16 GiB
MULTI_NODE_COUNTS = (2, 4, 16)
_TABLE_SOURCE = {"nominal": "model", "fitted": "fitted"}
OUTPUTS = ("collectives.parquet", "network.json", "measurements.parquet", "busbw.png")


def group_shapes(topology: Topology, extra: tuple[Shape, ...] = ()) -> list[Shape]:
    """Collective group shapes: 2, 4, ... GPUs of one node, then 2/4/16 nodes (full or one GPU
    each), and any ``extra`` (measured) shapes."""
    gpn = topology.node_ranks
    single = {n for n in (2 << i for i in range(gpn.bit_length())) if n <= gpn} | {gpn}
    shapes = {Shape(n, 1, n) for n in single if n >= 2}
    for m in MULTI_NODE_COUNTS:
        shapes.add(Shape(m * gpn, m, gpn))
        if gpn > 1:
            shapes.add(Shape(m, m, 1))  # e.g. a data-parallel group under tensor parallelism
    shapes |= {s for s in extra if s.gpus >= 2}
    return sorted(shapes, key=lambda s: (s.nodes, s.gpus, s.per_node))


def p2p_shapes() -> list[Shape]:
    """A transfer inside a node and one between nodes."""
    return [Shape(2, 1, 2), Shape(2, 2, 1)]


def _config_file(topology: Topology) -> str:
    return f"config/topologies/{topology.name}.yaml"


def _gloo_measurements(bench: pa.Table) -> pa.Table:
    """A gloo benchmark table (op, gpus, bytes, time_us) in the MEASUREMENTS schema."""
    n = bench.num_rows
    gpus = bench["gpus"].to_numpy()
    times = bench["time_us"].to_numpy()
    sizes = bench["bytes"].to_numpy()
    algbw = sizes / (times * 1e3)
    factor = np.array([2 * (g - 1) / g if op == "all_reduce" else (g - 1) / g if op == "all_gather" else 1.0
                       for op, g in zip(bench["op"].to_pylist(), gpus, strict=True)])
    cols = {"source": ["gloo_benchmark"] * n, "line": [-1] * n, "op": bench["op"], "collective": bench["op"],
            "gpus": gpus, "nodes": [1] * n, "gpus_per_node": gpus, "gpus_per_thread": [1] * n, "bytes": sizes, "count": sizes // 4,
            "dtype": ["float"] * n, "redop": ["sum"] * n, "placement": ["out_of_place"] * n, "time_us": times,
            "algbw_GBps": algbw, "busbw_GBps": algbw * factor, "error": [None] * n, "wrong": [None] * n,
            "warmup_iters": [None] * n, "iters": [None] * n, "device": ["cpu"] * n,
            "nccl_algo": [None] * n, "nccl_proto": [None] * n}
    return pa.table(cols, schema=MEASUREMENTS)


def read_topology_logs(topology: Topology, logs: list[str | Path] | None = None, *,
                       config_file: str | Path | None = None, root: str | Path | None = None) -> pa.Table:
    """The measurements of a topology's nccl-tests logs (``logs``: their resolved paths, in the
    order the topology lists them; default: resolved in the reference folder ``root``, see
    ``echo.reference``). Each log's ranks must fit the topology's nodes."""
    config_file = config_file or _config_file(topology)
    names = topology.calibration.logs
    paths = [Path(p) for p in logs] if logs is not None else resolve_logs(names, config_file, root)
    if len(paths) != len(names):
        raise ValueError(f"calibrate: {len(paths)} log paths given for the {len(names)} logs of {config_file}")
    tables = []
    for i, (name, path) in enumerate(zip(names, paths, strict=True)):
        table = read_log(path, source=name)
        per_node = max(table["gpus_per_node"].to_pylist())
        hosts_gpus = table.select(["gpus", "nodes"]).to_pylist()
        if per_node > topology.gpus_per_node or any(r["gpus"] > r["nodes"] * topology.gpus_per_node
                                                   for r in hosts_gpus):
            raise ConfigError(config_file, f"calibration.logs.{i}",
                              f"{name} ran more than gpus_per_node={topology.gpus_per_node} ranks on one host")
        tables.append(table)
    return pa.concat_tables(tables)


def calibrated_model(topology: Topology, logs: list[str | Path] | None = None, *,
                     config_file: str | Path | None = None, root: str | Path | None = None,
                     holdout: bool = True, priority: str = "none") -> tuple[NetworkModel, pa.Table]:
    """The topology's model, benchmarked or fitted when its calibration asks for it, and the
    measurements it came from (empty for a nominal topology). ``holdout``: also refit without
    each multi-node log and record how well that predicts it (``fit["leave_one_out"]``).
    ``priority``: how a local gloo benchmark's ranks are scheduled (echo.launch.prioritize)."""
    base = NetworkParams.from_topology(topology)
    source = topology.calibration.source
    if source == "gloo_benchmark":
        everything = run_gloo_benchmark(topology.calibration, priority=priority)
        # the network's own figures from plain c10d calls; the functional API's extra apart
        is_api = pc.starts_with(everything["op"], FUNCTIONAL)
        bench = everything.filter(pc.invert(is_api))
        params, summary = fit_params(base, bench)
        overheads, summary["api_overheads"] = fit_api_overheads(everything, FUNCTIONAL)
        params = replace(params, api_overheads=overheads)
        summary["measurements"] = everything.to_pylist()
        summary["priority"] = priority
        return NetworkModel(topology, params, "fitted", summary), _gloo_measurements(bench)
    if source == "nccl_tests":
        measured = read_topology_logs(topology, logs, config_file=config_file, root=root)
        runs = runs_from_measurements(measured)
        if not runs:
            raise ConfigError(config_file or _config_file(topology), "calibration.logs",
                              "no log measures a collective the model has (all_reduce, all_gather, reduce_scatter, "
                              "alltoall, broadcast, reduce, sendrecv) on 2 or more GPUs")
        params, summary = fit_nccl_tests(base, runs)
        multi = [r for r in runs if r.shape.nodes > 1]
        if holdout:
            summary["leave_one_out"] = [leave_one_out(base, runs, held) for held in multi if len(multi) > 1]
            summary["leave_node_count_out"] = leave_node_count_out(base, runs)
        return NetworkModel(topology, params, "fitted", summary), measured
    return NetworkModel(topology), MEASUREMENTS.empty_table()


def _measured_lookup(measured: pa.Table) -> dict[tuple[str, int, int, int], float]:
    """(op, gpus, nodes, bytes) -> measured time (mean over placements and repeats); a send
    measurement also stands for its recv."""
    sums: dict[tuple[str, int, int, int], list[float]] = {}
    for op, gpus, nodes, nbytes, t in zip(*measured.select(["op", "gpus", "nodes", "bytes", "time_us"])
                                          .to_pydict().values(), strict=True):
        keys = [(op, gpus, nodes, nbytes)]
        if op == "send":  # the benchmark times the transfer, which is also the recv
            keys.append(("recv", gpus, nodes, nbytes))
        for key in keys:
            sums.setdefault(key, []).append(t)
    return {k: float(np.mean(v)) for k, v in sums.items()}


def prediction_table(model: NetworkModel, measured: pa.Table | None = None) -> pa.Table:
    """Predictions of every op on every relevant shape and size (COLLECTIVES columns + protocol)."""
    measured = measured if measured is not None else MEASUREMENTS.empty_table()
    lookup = _measured_lookup(measured)
    sizes = np.array(sorted(set(SIZES) | {k[3] for k in lookup}), dtype=np.int64)
    extra = tuple(Shape(g, n, p) for g, n, p in set(zip(*measured.select(["gpus", "nodes", "gpus_per_node"])
                                                        .to_pydict().values(), strict=True)))
    parts = []
    for op in OPS:
        shapes = p2p_shapes() if op in P2P_OPS else group_shapes(model.topology, extra)
        for shape in shapes:
            cols = model.predict(op, shape, sizes)
            meas = [lookup.get((op, shape.gpus, shape.nodes, int(b))) for b in sizes]
            parts.append(pa.table({
                "op": [op] * sizes.size, "gpus": np.full(sizes.size, shape.gpus, np.int32),
                "nodes": np.full(sizes.size, shape.nodes, np.int32), "bytes": sizes,
                **{k: cols[k] for k in ("time_us", "algbw_GBps", "busbw_GBps", "algorithm")},
                "source": [_TABLE_SOURCE[model.source]] * sizes.size,
                "measured_time_us": pa.array(meas, pa.float64()), "protocol": cols["protocol"],
            }))
    return pa.concat_tables(parts)


def run_calibrate(topology: Topology, out_dir: Path, logs: list[str | Path] | None = None, *,
                  root: str | Path | None = None, priority: str = "none") -> NetworkModel:
    """Write the calibrate outputs (``OUTPUTS``) for ``topology`` into ``out_dir``.

    ``logs``: resolved paths of the topology's nccl-tests logs (the workflow passes its inputs);
    by default they are looked up in the reference folder ``root`` (``echo.reference``)."""
    out_dir = Path(out_dir)
    model, measured = calibrated_model(topology, logs, root=root, priority=priority)
    table = prediction_table(model, measured)
    rows = {k for k in _measured_lookup(measured) if k[0] in OPS and k[1] >= 2}
    matched = table.filter(pc.is_valid(table["measured_time_us"])).num_rows
    if matched < len(rows):
        raise RuntimeError(f"calibrate: {len(rows) - matched} measured points found no row of the prediction table")
    write_parquet(measured, out_dir / "measurements.parquet", MEASUREMENTS)
    write_parquet(table, out_dir / "collectives.parquet", COLLECTIVES)
    plot_busbw(model, measured, out_dir / "busbw.png")
    model.save(out_dir / "network.json")
    return model
