"""The calibrate stage: a collective cost model for one topology, and a table of its predictions.

``run_calibrate(topology, out_dir)`` writes
- ``network.json``: the model (topology, parameters, ``source`` nominal | fitted), which
  the simulate stage loads with ``NetworkModel.load``;
- ``collectives.parquet`` (COLLECTIVES): predictions of every op over the group shapes that
  matter (sub-node groups, whole nodes, multi-node groups with all or one GPU per node) and
  sizes 1 KiB..16 GiB, with the measurement alongside where one was taken.

Topologies with ``calibration.source: gloo_benchmark`` are measured on this machine first
(``echo.network.gloo_bench``) and the model's alpha/beta fitted to the measurements.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from echo.artifacts import COLLECTIVES
from echo.config import Topology
from echo.io import write_parquet
from echo.network.costs import OPS, P2P_OPS, NetworkParams, Shape
from echo.network.fit import fit_params
from echo.network.gloo_bench import run_gloo_benchmark
from echo.network.model import NetworkModel

SIZES = [1024 << i for i in range(25)]  # 1 KiB .. 16 GiB
MULTI_NODE_COUNTS = (2, 4, 16)
_TABLE_SOURCE = {"nominal": "model", "fitted": "fitted"}


def group_shapes(topology: Topology, extra_single_node: tuple[int, ...] = ()) -> list[Shape]:
    """Collective group shapes: 2, 4, ... GPUs of one node, then 2/4/16 nodes, full or one GPU each."""
    gpn = topology.gpus_per_node
    single = {n for n in (2 << i for i in range(gpn.bit_length())) if n <= gpn}
    single |= {gpn} | {n for n in extra_single_node if 2 <= n <= gpn}
    shapes = [Shape(n, 1, n) for n in sorted(single) if n >= 2]
    for m in MULTI_NODE_COUNTS:
        shapes.append(Shape(m * gpn, m, gpn))
        if gpn > 1:
            shapes.append(Shape(m, m, 1))  # e.g. a data-parallel group under tensor parallelism
    return shapes


def p2p_shapes() -> list[Shape]:
    """A transfer inside a node and one between nodes."""
    return [Shape(2, 1, 2), Shape(2, 2, 1)]


def calibrated_model(topology: Topology) -> tuple[NetworkModel, pa.Table | None]:
    """The topology's model, benchmarked and fitted when its calibration asks for it."""
    if topology.calibration.source != "gloo_benchmark":
        return NetworkModel(topology), None
    measured = run_gloo_benchmark(topology.calibration)
    params, summary = fit_params(NetworkParams.from_topology(topology), measured)
    summary["measurements"] = measured.to_pylist()
    return NetworkModel(topology, params, "fitted", summary), measured


def _measured_lookup(measured: pa.Table | None) -> dict[tuple[str, int, int], float]:
    """(op, gpus, bytes) -> measured time; a send measurement also stands for its recv."""
    lookup: dict[tuple[str, int, int], float] = {}
    for row in (measured.to_pylist() if measured is not None else []):
        lookup[(row["op"], row["gpus"], row["bytes"])] = row["time_us"]
        if row["op"] == "send":  # the benchmark times the transfer, which is also the recv
            lookup[("recv", row["gpus"], row["bytes"])] = row["time_us"]
    return lookup


def prediction_table(model: NetworkModel, measured: pa.Table | None = None) -> pa.Table:
    """Predictions of every op on every relevant shape and size (COLLECTIVES columns + protocol)."""
    lookup = _measured_lookup(measured)
    sizes = np.array(sorted(set(SIZES) | {b for _, _, b in lookup}), dtype=np.int64)
    measured_gpus = tuple({g for _, g, _ in lookup})
    parts = []
    for op in OPS:
        shapes = p2p_shapes() if op in P2P_OPS else group_shapes(model.topology, measured_gpus)
        for shape in shapes:
            cols = model.predict(op, shape, sizes)
            meas = [lookup.get((op, shape.gpus, int(b))) if shape.nodes == 1 else None for b in sizes]
            parts.append(pa.table({
                "op": [op] * sizes.size, "gpus": np.full(sizes.size, shape.gpus, np.int32),
                "nodes": np.full(sizes.size, shape.nodes, np.int32), "bytes": sizes,
                **{k: cols[k] for k in ("time_us", "algbw_GBps", "busbw_GBps", "algorithm")},
                "source": [_TABLE_SOURCE[model.source]] * sizes.size,
                "measured_time_us": pa.array(meas, pa.float64()), "protocol": cols["protocol"],
            }))
    return pa.concat_tables(parts)


def run_calibrate(topology: Topology, out_dir: Path) -> None:
    """Write ``collectives.parquet`` and ``network.json`` for ``topology`` into ``out_dir``."""
    out_dir = Path(out_dir)
    model, measured = calibrated_model(topology)
    table = prediction_table(model, measured)
    if measured is not None and pc.sum(pc.is_valid(table["measured_time_us"])).as_py() < measured.num_rows:
        raise RuntimeError("calibrate: some measurements found no row of the prediction table")
    write_parquet(table, out_dir / "collectives.parquet", COLLECTIVES)
    model.save(out_dir / "network.json")
