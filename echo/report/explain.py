"""Why is a real job slower than it should be: its measured step, phase by phase, beside what
Echo's models say the same work takes.

From an import (echo.profile.gpu_import: every GPU kernel of each rank with its op, shapes and
collective), per rank and averaged over the profiled steps:

- ``compute:<op class>``: the kernel time of each op class, measured, and the hardware model's time
  for the same op events (echo.profile.kineto_check.estimate_event); op classes the model cannot
  read from a trace (embedding lookups of other libraries, fused optimizers launched outside the
  dispatcher) are measured only;
- ``comm:<collective> x<group size>``: the NCCL kernel time of each collective, measured, and the
  topology's collective model for the same messages (a group the trace does not record is taken as
  the whole job: said in the note). An NCCL kernel starts when its stream reaches it and ends when
  the last peer's data has arrived: its measured time includes waiting for the slowest rank (a
  3 kB all-to-all that takes 30 ms waited), which the model's transfer time does not;
- ``exposed_comm``: NCCL time with no compute kernel beside it (measured; a prediction needs the
  job's schedule, which only a simulated workload has);
- ``memcpy``: copies and memsets on the GPU;
- ``idle``: the step's wall time during which the GPU ran nothing: what it waited for the host
  (launches, data loading, synchronization). Echo's model of a GPU-bound step has none, so its
  predicted idle is 0 and the difference is the host's share.

Given the simulation of the job's workload (``--workload``: Echo's trace of the same training
step), the step-level rows get Echo's predictions too: ``step``, ``compute`` (GPU time with a
compute kernel running), ``exposed_comm`` and ``idle`` against the simulated bubble.

Rows are listed by the size of the difference, largest first: the place to look.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass

import pyarrow as pa

from echo.config import Hardware
from echo.network.model import NetworkModel
from echo.profile.intervals import length, merge, overlap
from echo.profile.kineto_check import estimate_event, gemm_format

EXPLAIN = pa.schema([
    ("rank", pa.int32()),
    ("phase", pa.string()),          # compute:<class> | comm:<collective> x<n> | exposed_comm | memcpy | idle | step
    ("measured_ms", pa.float64()),   # per step, averaged over the profiled steps
    ("predicted_ms", pa.float64()),  # the same work on the models; null where they have none
    ("difference_ms", pa.float64()),  # measured - predicted
    ("share_of_step", pa.float64()),  # measured / the measured step
    ("note", pa.string()),
])


@dataclass(frozen=True)
class _Step:
    number: int
    start: float
    dur: float


def explain(activity: pa.Table, summary: dict, hardware: Hardware, network: NetworkModel | None,
            simulated: dict | None = None) -> pa.Table:
    """The EXPLAIN rows of every rank of an import (``activity.parquet``, ``import.json``);
    ``simulated``, a simulate summary row of the job's workload, fills the step-level predictions
    (step, compute, exposed communication, and the bubble as the predicted idle)."""
    rows = activity.to_pylist()
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for a in rows:
        by_rank[a["rank"]].append(a)
    out = []
    for r in summary["ranks"]:
        steps = [_Step(*s) for s in r.get("step_spans_us", [])]
        acts = [a for a in by_rank.get(r["rank"], []) if a["launched"] and a["step"] >= 0]
        if not steps or not acts:
            continue
        out += _rank_rows(r["rank"], r.get("world_size") or 1, steps, acts, hardware, network, simulated)
    return pa.Table.from_pylist(out, schema=EXPLAIN)


def _rank_rows(rank, world, steps, acts, hw, network, simulated=None) -> list[dict]:
    n_steps = len({a["step"] for a in acts})
    step_ms = statistics.fmean(s.dur for s in steps if s.number in {a["step"] for a in acts}) / 1e3
    per_step = 1.0 / n_steps / 1e3  # us summed over the steps -> ms per step
    measured: dict[str, float] = defaultdict(float)
    predicted: dict[str, float] = defaultdict(float)
    unread: dict[str, float] = defaultdict(float)
    notes: dict[str, str] = {}
    for ev in _events(acts).values():
        phase, us = ev["phase"], ev["us"]
        measured[phase] += us
        guess = _predict(ev, hw, network, world)
        if guess is None:
            unread[phase] += us
        else:
            predicted[phase] += guess[0]
            if guess[1]:
                notes[phase] = guess[1]
    exposed, busy, compute = _exposed_and_busy(acts)
    rows = []
    for phase, us in measured.items():
        p = predicted.get(phase)
        note = notes.get(phase, "")
        if p is None:  # nothing of this phase has a model reading (memcpy, unread op classes)
            note = note or "no model of this work from a trace: measured only"
        elif unread.get(phase):
            note = (note + "; " if note else "") + (f"{unread[phase] * per_step:.2f} ms of it not modelled, "
                                                    "counted as measured")
            p += unread[phase]
        rows.append(_row(rank, phase, us * per_step, None if p is None else p * per_step, step_ms, note))
    idle = max(0.0, step_ms - busy * per_step)
    sim = simulated or {}
    if sim:
        rows.append(_row(rank, "compute", compute * per_step, sim["compute_s"] * 1e3, step_ms,
                         f"GPU time with a compute kernel running; predicted: {sim['workload']}'s simulated compute"))
        rows.append(_row(rank, "exposed_comm", exposed * per_step, sim["exposed_comm_s"] * 1e3, step_ms,
                         "NCCL time with no compute kernel beside it; predicted: the simulated step's"))
        rows.append(_row(rank, "idle", idle, sim["bubble_s"] * 1e3, step_ms, "the GPU ran nothing; predicted: "
                         "the simulated pipeline bubble (the measured idle adds the host's waits)"))
    else:
        rows.append(_row(rank, "exposed_comm", exposed * per_step, None, step_ms,
                         "NCCL time with no compute kernel beside it; its prediction needs the job's schedule "
                         "(simulate the workload)"))
        rows.append(_row(rank, "idle", idle, 0.0, step_ms, "the GPU ran nothing: it waited for the host "
                         "(launches, data loading, synchronization); a GPU-bound step has none"))
    rows.sort(key=lambda x: (x["difference_ms"] is None, -abs(x["difference_ms"] or 0.0)))
    rows.insert(0, _row(rank, "step", step_ms, sim["step_time_s"] * 1e3 if sim else None, step_ms,
                        f"ProfilerStep wall time, mean of {n_steps} steps"
                        + (f"; predicted: {sim['workload']} on {sim['topology']}" if sim else "")))
    return rows


def _row(rank, phase, measured_ms, predicted_ms, step_ms, note) -> dict:
    return {"rank": rank, "phase": phase, "measured_ms": measured_ms, "predicted_ms": predicted_ms,
            "difference_ms": None if predicted_ms is None else measured_ms - predicted_ms,
            "share_of_step": measured_ms / step_ms if step_ms else None, "note": note}


def _events(acts: list[dict]) -> dict[tuple, dict]:
    """Activities pooled into op events (one op launching a GEMM and its split-K reduction is one
    event; so is one collective's kernels), each with its phase."""
    events: dict[tuple, dict] = {}
    for a in acts:
        if a["kind"] != "kernel":
            phase = "memcpy"
        elif a["collective"]:
            size = a["group_size"]
            phase = f"comm:{a['collective']} x{size}" if size else f"comm:{a['collective']}"
        else:
            phase = f"compute:{a['op_class'] or 'unmatched'}"
        key = (a["step"], a["op_ts_us"], a["op"], phase) if a["op_ts_us"] is not None else (a["correlation"], phase)
        ev = events.setdefault(key, {"phase": phase, "us": 0.0, "kernels": [], "row": a})
        ev["us"] += a["dur_us"]
        ev["kernels"].append(a["kernel"])
    return events


def _predict(ev: dict, hw: Hardware, network: NetworkModel | None, world: int) -> tuple[float, str] | None:
    """(predicted us, note) of one event, None where the models cannot read it."""
    a = ev["row"]
    if ev["phase"].startswith("comm:"):
        if network is None or a["bytes"] is None or a["collective"] not in _NETWORK_OPS:
            return None
        group = json.loads(a["group_ranks"]) if a["group_ranks"] else None
        gpus = a["group_size"] or (len(group) if group else world)
        note = "" if (a["group_size"] or group) else f"group not in the trace: taken as the whole job ({world} ranks)"
        op = _NETWORK_OPS[a["collective"]]
        return network.estimate(op, gpus=gpus, nbytes=int(a["bytes"])).time_us, note
    if ev["phase"] == "memcpy" or not a["with_shapes"]:
        return None
    fmt = gemm_format(a["dtype"], ev["kernels"]) if a["op_class"] == "gemm" else ""
    est = estimate_event(hw, a["op"], a["op_class"], json.loads(a["shapes"]), a["dtype"], fmt, a["input_bytes"] or 0)
    return None if est is None else (est.duration_us, "")


# collectives of an import -> the network model's ops (a c10d all-to-all runs as NCCL send/recv pairs)
_NETWORK_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
                "all_to_all": "all_to_all", "broadcast": "broadcast", "send": "send", "recv": "recv"}


def _exposed_and_busy(acts: list[dict]) -> tuple[float, float, float]:
    """(NCCL time not overlapped by any compute kernel, union of all GPU activity, union of the
    compute kernels), summed over steps."""
    exposed = busy = compute_us = 0.0
    for step in {a["step"] for a in acts}:
        sa = [a for a in acts if a["step"] == step]
        compute = merge([(a["ts_us"], a["ts_us"] + a["dur_us"]) for a in sa
                          if a["kind"] == "kernel" and not a["collective"]])
        nccl = merge([(a["ts_us"], a["ts_us"] + a["dur_us"]) for a in sa if a["collective"]])
        busy += length(merge([(a["ts_us"], a["ts_us"] + a["dur_us"]) for a in sa]))
        exposed += length(nccl) - overlap(nccl, compute)
        compute_us += length(compute)
    return exposed, busy, compute_us


def describe(table: pa.Table) -> str:
    """A text table per rank: phase, measured, predicted, difference, share of the step, note."""
    lines = []
    for rank in sorted(set(table.column("rank").to_pylist())):
        lines.append(f"rank {rank}:  {'phase':<34}{'measured ms':>12}{'predicted ms':>13}{'diff ms':>9}{'step %':>8}")
        for r in table.filter(pa.compute.equal(table["rank"], rank)).to_pylist():
            pred = f"{r['predicted_ms']:13.2f}" if r["predicted_ms"] is not None else f"{'-':>13}"
            diff = f"{r['difference_ms']:+9.2f}" if r["difference_ms"] is not None else f"{'':>9}"
            lines.append(f"         {r['phase']:<34}{r['measured_ms']:12.2f}{pred}{diff}"
                         f"{100 * (r['share_of_step'] or 0):7.1f}%  {r['note']}")
    return "\n".join(lines)
