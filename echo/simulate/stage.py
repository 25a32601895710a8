"""run_simulate: read the trace, classes, kernel times and network model; write the summary,
the timeline and the Perfetto trace.

Only representatives' ops are read and each class is reduced once, so the work grows with the
number of classes (first, middle and last pipeline stage today) and micro-batches; the world size only enters through
the per-rank class table, counted with pyarrow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from echo.artifacts import SUMMARY, TIMELINE
from echo.io import write_json, write_parquet
from echo.simulate.chunk import CommTimer, RankCosts, reduce_rank, slowest
from echo.simulate.engine import EngineOptions, simulate
from echo.simulate.perfetto import chrome_trace, timeline_table
from echo.simulate.schedule import stage_orders
from echo.simulate.summary import ClassInfo, summary_table

log = logging.getLogger(__name__)

OPS_COLUMNS = ["rank", "seq", "name", "kind", "phase", "chunk", "stream", "flops", "kernel_key", "comm_id"]
COMMS_COLUMNS = ["rank", "comm_id", "op", "group", "bytes", "group_kind", "blocking"]


def _rows_by_rank(path: Path, columns: list[str], ranks: set[int]) -> dict[int, list[dict]]:
    """Rows of the given ranks only: other traced ranks are verification re-traces, not classes."""
    table = pq.read_table(path, columns=columns)
    table = table.filter(pc.is_in(table["rank"], pa.array(sorted(ranks), pa.int32())))
    out: dict[int, list[dict]] = {r: [] for r in ranks}
    for row in table.to_pylist():
        out[row["rank"]].append(row)
    return out


def _waits(trace_dir: Path, ranks: set[int], ops: Mapping[int, list[dict]],
           comms: Mapping[int, Mapping[int, dict]]) -> dict[int, dict[int, list[int]]]:
    """Per rank, op seq -> seqs of non-blocking collectives it consumes (the only deps the
    stream-ordered replay cannot infer)."""
    path = trace_dir / "deps.parquet"
    out: dict[int, dict[int, list[int]]] = {r: {} for r in ranks}
    if not path.is_file():
        return out
    async_seqs = {r: {o["seq"] for o in rows if o["kind"] == "collective"
                      and not comms[r][o["comm_id"]]["blocking"]} for r, rows in ops.items()}
    for d in _rows_by_rank(path, ["rank", "src", "dst"], ranks).values():
        for edge in d:
            if edge["src"] in async_seqs[edge["rank"]]:
                out[edge["rank"]].setdefault(edge["dst"], []).append(edge["src"])
    return out


def _class_table(rank_classes_path: Path) -> list[dict]:
    """One row per class: representative, the pipeline stages it covers, its rank count. A class
    may span stages: the middle stages of a pipeline run the same graph up to rank labels."""
    rc = pq.read_table(rank_classes_path, columns=["rank", "class_id", "representative", "pp_rank"])
    rows = rc.group_by(["class_id", "pp_rank"]).aggregate([("representative", "min"), ("representative", "max"),
                                                           ("rank", "count")]).to_pylist()
    out: dict[int, dict] = {}
    for r in sorted(rows, key=lambda r: (r["class_id"], r["pp_rank"])):
        c = out.setdefault(r["class_id"], {"class_id": r["class_id"], "reps": set(), "stages": [], "ranks": 0})
        c["reps"] |= {r["representative_min"], r["representative_max"]}
        c["stages"].append(r["pp_rank"])
        c["ranks"] += r["rank_count"]
    for c in out.values():
        if len(c["reps"]) != 1:
            raise ValueError(f"{rank_classes_path}: class {c['class_id']} has representatives {sorted(c['reps'])}")
        c["representative"] = c["reps"].pop()
    return list(out.values())


def load_classes(workload, trace_dir: Path, rank_classes_path: Path, kernels: Mapping[str, float],
                 network) -> list[ClassInfo]:
    """Every class reduced to its task costs and memory, from its representative's trace."""
    table = _class_table(rank_classes_path)
    total = sum(c["ranks"] for c in table)
    if total != workload.world_size:
        raise ValueError(f"{rank_classes_path}: {total} ranks, but the workload's world size is {workload.world_size}")
    reps = {c["representative"] for c in table}
    ops = _rows_by_rank(trace_dir / "ops.parquet", OPS_COLUMNS, reps)
    comms = {r: {c["comm_id"]: c for c in rows}
             for r, rows in _rows_by_rank(trace_dir / "comms.parquet", COMMS_COLUMNS, reps).items()}
    memory = {r["rank"]: r for r in pq.read_table(trace_dir / "ranks.parquet").to_pylist()}
    waits = _waits(trace_dir, reps, ops, comms)
    timer = CommTimer(network)
    out = []
    for c in table:
        rep = c["representative"]
        if not ops[rep] or rep not in memory:
            raise ValueError(f"class {c['class_id']}: representative rank {rep} is missing from {trace_dir}")
        mem = memory[rep]
        out.append(ClassInfo(
            class_id=c["class_id"], representative=rep, stages=tuple(c["stages"]), ranks=c["ranks"],
            costs=reduce_rank(ops[rep], comms[rep], kernels, timer, waits[rep]),
            state_bytes=mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"],
            activation_bytes=mem["activation_bytes_per_microbatch"]))
    return out


def stage_costs(classes: list[ClassInfo], stages: int, chunks: int) -> list[RankCosts]:
    """One cost set per pipeline stage; refuses a stage without a class or a wrong chunk count."""
    by_stage: dict[int, list[RankCosts]] = {}
    for c in classes:
        if c.costs.chunks != chunks:
            raise ValueError(f"class {c.class_id} traced {c.costs.chunks} chunks, the workload has "
                             f"virtual_stages = {chunks}")
        for s in c.stages:
            by_stage.setdefault(s, []).append(c.costs)
    missing = [s for s in range(stages) if s not in by_stage]
    extra = sorted(s for s in by_stage if not 0 <= s < stages)
    if missing or extra:
        raise ValueError(f"rank classes do not cover pp = {stages}: stages without a class {missing}, "
                         f"stages out of range {extra}")
    return [slowest(by_stage[s]) for s in range(stages)]


def load_kernels(kernels_path: Path) -> dict[str, float]:
    t = pq.read_table(kernels_path, columns=["kernel_key", "duration_us"])
    return dict(zip(t["kernel_key"].to_pylist(), t["duration_us"].to_pylist(), strict=True))


def run_simulate(workload, hardware, topology, trace_dir, rank_classes_path, kernels_path, calib_dir, out_dir,
                 *, network=None, options: EngineOptions | None = None) -> pa.Table:
    """Simulate one step of ``workload`` on ``hardware`` GPUs over ``topology``; write
    summary.parquet, timeline.parquet and trace.json to ``out_dir`` and return the summary.

    ``network``: anything with ``estimate(op, group=, nbytes=)``; default: the calibrated
    ``echo.network.NetworkModel`` in ``calib_dir/network.json``."""
    t0 = time.perf_counter()
    trace_dir, out_dir = Path(trace_dir), Path(out_dir)
    if network is None:
        from echo.network import NetworkModel  # the calibrate stage's model
        network = NetworkModel.load(Path(calib_dir) / "network.json")
    par = workload.parallel
    classes = load_classes(workload, trace_dir, Path(rank_classes_path), load_kernels(Path(kernels_path)), network)
    orders = stage_orders(par.schedule, par.pp, workload.micro_batches, par.virtual_stages)
    result = simulate(stage_costs(classes, par.pp, par.virtual_stages), orders, options or EngineOptions())
    stage_classes: dict[int, list[int]] = {}
    for c in classes:
        for s in c.stages:
            stage_classes.setdefault(s, []).append(c.class_id)
    write_parquet(timeline_table(result.events, stage_classes), out_dir / "timeline.parquet", TIMELINE)
    write_json(chrome_trace(result.events, stage_classes, {"workload": workload.name, "hardware": hardware.name,
                                                          "topology": topology.name}), out_dir / "trace.json")
    summary = summary_table(workload=workload, hardware=hardware, topology=topology, classes=classes,
                            orders=orders, result=result, sim_wall_s=time.perf_counter() - t0)
    write_parquet(summary, out_dir / "summary.parquet", SUMMARY)
    log.info("simulated %s on %s/%s: step %.3f s, %d events, %.2f s wall", workload.name, hardware.name,
             topology.name, result.step_us / 1e6, len(result.events), summary["sim_wall_s"][0].as_py())
    return summary
