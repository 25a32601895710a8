"""The compare stage: a simulated step next to a real one, item by item.

``run_compare`` reads the measure stage's ``measured.parquet`` and ``phases.parquet`` and the
simulate stage's ``summary.parquet`` and ``timeline.parquet`` of the same workload, and writes
one row per item (COMPARE):

- ``step_time`` (stage -1): the headline, simulated step vs the median measured step;
- per pipeline stage: ``forward``, ``backward`` (all micro-batches, blocking TP collectives
  included, recomputation in backward), ``optimizer``, ``grad_sync`` (the data-parallel reduction),
  ``wait`` (the rest of the step: the stage idle in the pipeline bubble, waiting for p2p
  transfers, or for the slowest stage);
- on the critical stage (stage -1): ``kernels`` (the simulator's compute time vs the operators
  timed by torch.profiler in one real step: their excess over the prediction is what kernels
  cost inside a training loop beyond their isolated timings, plus framework dispatch that runs
  inside operators, e.g. DTensor's) and ``tp_comm`` (exposed tensor-parallel collectives vs the
  collectives timed inside forward and backward).

Measured per-stage figures are the median over the stage's ranks of each phase's median time per
step; ``error`` = predicted / measured - 1.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pyarrow as pa

from echo.artifacts import SUMMARY, TIMELINE
from echo.io import read_parquet, write_parquet

COMPARE = pa.schema([
    ("workload", pa.string()),
    ("hardware", pa.string()),
    ("topology", pa.string()),
    ("item", pa.string()),           # step_time | forward | backward | optimizer | grad_sync | wait | kernels | tp_comm
    ("stage", pa.int32()),           # pipeline stage; -1: the whole step / the critical stage
    ("predicted_s", pa.float64()),
    ("measured_s", pa.float64()),
    ("error", pa.float64()),         # predicted / measured - 1
])
STAGE_ITEMS = ("forward", "backward", "optimizer", "grad_sync", "wait")


NEGLIGIBLE_S = 1e-4  # a phase shorter than this in the real run is taken as absent


def _error(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or meas < NEGLIGIBLE_S:
        return None
    return pred / meas - 1.0


def simulated_stages(summary: dict, timeline: pa.Table) -> dict[int, dict[str, float]]:
    """Per pipeline stage: seconds of forward, backward, optimizer and grad_sync tasks in the
    simulated timeline, and ``wait`` = the step time minus those."""
    step = summary["step_time_s"]
    out: dict[int, dict[str, float]] = {}
    for row in timeline.to_pylist():
        stage = out.setdefault(row["pp_rank"], dict.fromkeys(STAGE_ITEMS, 0.0))
        dur = row["end_s"] - row["start_s"]
        if row["stream"] == "compute" and row["kind"] in ("forward", "backward", "optimizer"):
            stage[row["kind"]] += dur
        elif row["kind"] == "collective" and row["name"].startswith("grad_sync"):
            stage["grad_sync"] += dur
    for stage in out.values():
        stage["wait"] = max(0.0, step - stage["forward"] - stage["backward"] - stage["optimizer"] - stage["grad_sync"])
    return out


def measured_stages(phases: pa.Table, step_s: float) -> dict[int, dict[str, float]]:
    """Per pipeline stage (median over its ranks): the same items from the real run; ``wait`` is
    the step time minus them (pipeline receives and sends, zeroing gradients, barrier skew)."""
    by_rank: dict[tuple[int, int], dict[str, float]] = {}
    for row in phases.to_pylist():
        by_rank.setdefault((row["pp_rank"], row["rank"]), {})[row["phase"]] = row["wall_s"]
    stages: dict[int, list[dict[str, float]]] = {}
    for (pp, _), phases_of in sorted(by_rank.items()):
        items = {k: phases_of.get(k, 0.0) for k in ("forward", "backward", "optimizer", "grad_sync")}
        items["wait"] = max(0.0, step_s - sum(items.values()))
        stages.setdefault(pp, []).append(items)
    return {pp: {k: statistics.median(r[k] for r in rows) for k in STAGE_ITEMS} for pp, rows in stages.items()}


def profiled_split(phases: pa.Table, stage: int) -> tuple[float | None, float | None]:
    """(operator seconds, collective seconds in forward/backward) of the profiled real step on
    ``stage``, median over the stage's ranks."""
    ops: dict[int, float] = {}
    comm: dict[int, float] = {}
    for row in phases.to_pylist():
        if row["pp_rank"] != stage:
            continue
        r = row["rank"]
        if row["phase"] in ("forward", "backward", "optimizer", "grad_sync", "zero_grad"):
            ops[r] = ops.get(r, 0.0) + (row["op_s"] or 0.0)
        if row["phase"] in ("forward", "backward"):
            comm[r] = comm.get(r, 0.0) + (row["comm_s"] or 0.0)
    med = (lambda d: statistics.median(d.values()) if d else None)  # noqa: E731
    return med(ops), med(comm)


def compare_table(summary: dict, timeline: pa.Table, measured: pa.Table, phases: pa.Table) -> pa.Table:
    meas_step = measured["median_step_time_s"][0].as_py()
    base = {"workload": summary["workload"], "hardware": summary["hardware"], "topology": summary["topology"]}
    rows = [{**base, "item": "step_time", "stage": -1, "predicted_s": summary["step_time_s"],
             "measured_s": meas_step, "error": _error(summary["step_time_s"], meas_step)}]
    sim, real = simulated_stages(summary, timeline), measured_stages(phases, meas_step)
    for stage in sorted(set(sim) | set(real)):
        for item in STAGE_ITEMS:
            p, m = sim.get(stage, {}).get(item), real.get(stage, {}).get(item)
            rows.append({**base, "item": item, "stage": stage, "predicted_s": p, "measured_s": m,
                         "error": _error(p, m)})
    crit = int(summary.get("critical_stage", 0) or 0)
    ops, comm = profiled_split(phases, crit)
    for item, pred, meas in (("kernels", summary["compute_s"], ops), ("tp_comm", summary.get("exposed_tp_s"), comm)):
        rows.append({**base, "item": item, "stage": -1, "predicted_s": pred, "measured_s": meas,
                     "error": _error(pred, meas)})
    return pa.Table.from_pylist(rows, schema=COMPARE)


def run_compare(measured_dir: Path, simulate_dir: Path, out_path: Path) -> pa.Table:
    """Write ``out_path`` (COMPARE) from a measure stage folder and a simulate stage folder."""
    measured_dir, simulate_dir = Path(measured_dir), Path(simulate_dir)
    summary = read_parquet(simulate_dir / "summary.parquet", SUMMARY).to_pylist()[0]
    measured = read_parquet(measured_dir / "measured.parquet")
    if measured["workload"][0].as_py() != summary["workload"]:
        raise ValueError(f"compare: {measured_dir} measured {measured['workload'][0]}, "
                         f"{simulate_dir} simulated {summary['workload']}")
    table = compare_table(summary, read_parquet(simulate_dir / "timeline.parquet", TIMELINE), measured,
                          read_parquet(measured_dir / "phases.parquet"))
    write_parquet(table, out_path, COMPARE)
    return table
