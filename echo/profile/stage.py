"""The profile stage: one duration per distinct kernel of a trace, on the target hardware.

Three sources, one table (``source`` says which gave each row):

- ``imported``: read from a PyTorch profiler (Kineto) Chrome trace of a real run of the workload
  (``kineto``), when one is given; kernels it does not cover fall through to the next two;
- ``model``: a GPU target is modelled (``roofline``); a real job's overlay (``overlay``), when
  given, replaces the kernels it covers (``overlay``: measured, same call; ``model+overlay``:
  the model times its shape regime's measured factor);
- ``measured``: the local CPU (``kind: cpu``) is timed (``measure``), cached across workloads:
  each kernel alone, scaled by how much slower its op class runs inside the loop (``inloop``:
  the trace's tasks replayed in order).

On a host-synchronous device (``Hardware.host_synchronous``: the local CPU, whose kernels run on
the thread that dispatches them) host overheads add to the kernels: every measured kernel gets
the eager engine's time per op, and a kernel that the tracer found behind DTensor-level calls
(``dtensor`` in the trace, part of its kernel key) that many times DTensor's dispatch time per
call, both measured here (``eager``, ``host``). The run's ranks share this CPU's caches and memory
bus, so every measured kernel is then scaled by the slowdown measured with that many ranks busy
side by side (``eager``). GPU targets ignore all three: their kernels run from a queue the host
fills ahead of time on a device of their own, and Megatron-LM, which they stand for, runs tensor
parallelism without DTensor.

Only compute and memcpy ops are kernels here; collectives and p2p belong to the network model.
Next to ``kernels.parquet`` the stage writes ``profile.json``: how many rows came from each
source, what the cache saved, and which kernels an import could not match.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from echo.artifacts import KERNELS
from echo.config import Hardware
from echo.io import read_parquet, write_json, write_parquet
from echo.profile import roofline
from echo.profile.kernel import Kernel, Result

log = logging.getLogger(__name__)

PROFILED_KINDS = ("compute", "memcpy")
_FIELDS = ("name", "op_class", "kind", "shapes", "dtype", "flops", "bytes", "args")
# Columns written besides the KERNELS contract: the roofline bound of modelled rows and the
# thread count of measured ones (0 when modelled or imported).
# Measured rows also carry their isolated timing and in-loop factor; host_us is the host
# overhead included in duration_us (the eager engine's per op, and dtensor: the DTensor-level
# calls it stands for); colocation_factor the slowdown from the run's other ranks, applied.
EXTRA = pa.schema([("kind", pa.string()), ("bound", pa.string()), ("threads", pa.int32()),
                   ("isolated_us", pa.float64()), ("inloop_factor", pa.float64()), ("host_us", pa.float64()),
                   ("dtensor", pa.int32()), ("colocation_factor", pa.float64())])
NOTE = "profile.json"


def run_profile(hardware: Hardware, trace_dir: Path, out_path: Path, cache_dir: Path | None = None,
                imported: Path | None = None, ranks_on_host: int = 1, overlay: Path | None = None) -> dict:
    """Write ``out_path`` (KERNELS): each distinct kernel of ``trace_dir/ops.parquet`` with its
    duration on ``hardware``: imported from the Kineto trace ``imported`` where it has the kernel,
    else modelled for a GPU or measured (and cached in ``cache_dir``) for the local CPU, whose
    run has ``ranks_on_host`` ranks busy at once (``eager.colocated_ranks``). Also writes the
    note ``profile.json`` next to ``out_path``, and returns it. ``overlay`` (echo.profile.overlay,
    GPU hardware only) replaces the model's time of the kernels a real job's measurements cover."""
    t0 = time.perf_counter()
    overlay_doc = None
    if overlay is not None:
        from echo.profile.overlay import load_overlay

        if hardware.kind != "gpu":
            raise ValueError(f"{overlay}: an overlay corrects a GPU model; hardware '{hardware.name}' is timed here")
        overlay_doc = load_overlay(Path(overlay), hardware)  # refused before any kernel is timed
    out_path = Path(out_path)
    kernels = distinct_kernels(read_parquet(Path(trace_dir) / "ops.parquet"))
    note: dict = {"hardware": hardware.name, "kind": hardware.kind, "kernels": len(kernels)}
    results: dict[str, Result] = {}
    todo = kernels
    if imported is not None:
        from echo.profile.kineto import import_trace

        imp = import_trace(kernels, Path(imported))
        results.update({key: Result(us, "imported", 0, None) for key, us in imp.durations_us.items()})
        todo = imp.unmatched
        note["imported"] = {"file": str(imported), **imp.note()}
        if imp.unmatched:
            log.warning("profile: %d of %d kernels are not in %s (%s); they are %s instead",
                        len(imp.unmatched), len(kernels), imported,
                        ", ".join(f"{n} x{c}" for n, c in list(note["imported"]["unmatched_by_op"].items())[:8]),
                        "modelled" if hardware.kind == "gpu" else "measured here")
    if hardware.kind == "gpu":
        results.update(model_kernels(todo, hardware))
        if overlay_doc is not None:
            from echo.profile.overlay import apply_overlay

            covered = apply_overlay(overlay_doc, todo, hardware)
            results.update(covered)
            note["overlay"] = {"file": str(overlay), "sources": overlay_doc["sources"],
                               "covered": dict(Counter(r.source for r in covered.values())),
                               "modelled": len(todo) - len(covered)}
    else:
        from echo.profile.measure import measure_kernels  # imports torch; GPU targets need not

        stats: dict = {}
        results.update(measure_kernels(todo, hardware, Path(cache_dir) if cache_dir else None, stats,
                                       trace_dir=Path(trace_dir)))
        note["measure"] = stats
    if hardware.host_synchronous:
        results = add_host_overhead(kernels, results, Path(cache_dir) if cache_dir else None, note)
        results = add_eager_step(kernels, results, Path(cache_dir) if cache_dir else None, note, ranks_on_host)
    table = kernels_table(kernels, results)
    write_parquet(table, out_path, KERNELS)
    note["sources"] = dict(Counter(results[k.kernel_key].source for k in kernels))
    note["kernel_time_ms"] = sum(k.count * results[k.kernel_key].duration_us for k in kernels) / 1e3
    note["wall_s"] = time.perf_counter() - t0
    write_json(note, out_path.with_name(NOTE))
    log.info("profile %s: %d kernels (%s), %.1f ms of kernel time over the traced ops -> %s",
             hardware.name, len(kernels), note["sources"], note["kernel_time_ms"], out_path)
    return note


def distinct_kernels(ops: pa.Table) -> list[Kernel]:
    """One Kernel per distinct kernel_key of the compute/memcpy ops, with its occurrence count,
    in order of first appearance."""
    ops = ops.filter(pc.is_in(ops["kind"], pa.array(PROFILED_KINDS)))
    ops = ops.select(["kernel_key", *_FIELDS, *(["dtensor"] if "dtensor" in ops.column_names else [])])
    first: dict[str, dict] = {}
    counts: dict[str, int] = {}
    for row in ops.to_pylist():
        key = row["kernel_key"]
        counts[key] = counts.get(key, 0) + 1
        row["dtensor"] = row.get("dtensor") or 0  # traces from before the column, or rows without it
        first.setdefault(key, row)
    return [Kernel(**first[key], count=counts[key]) for key in first]


def add_host_overhead(kernels: list[Kernel], results: dict[str, Result], cache_dir: Path | None,
                      note: dict) -> dict[str, Result]:
    """``results`` with DTensor's host overhead added to every kernel behind DTensor-level calls
    (``Kernel.dtensor`` calls x the per-call time of ``echo.profile.host``, measured here or
    cached), except imported ones (a real run's timings include whatever the host did). Records
    the figure and its provenance in ``note["host"]``."""
    flagged = [k for k in kernels if k.dtensor and results[k.kernel_key].source != "imported"]
    if not flagged:
        note["host"] = {"dtensor_calls": 0}
        return results
    from echo.profile.host import dtensor_call_us

    measured = dtensor_call_us(cache_dir)
    per_call = measured["dtensor_call_us"]
    out = dict(results)
    for k in flagged:
        r = out[k.kernel_key]
        host = k.dtensor * per_call
        out[k.kernel_key] = replace(r, duration_us=r.duration_us + host, host_us=host)
    calls = sum(k.count * k.dtensor for k in flagged)
    note["host"] = {"dtensor_call_us": per_call, "dtensor_calls": calls, "kernels": len(flagged),
                    "added_ms": calls * per_call / 1e3, "measurement": measured}
    log.info("profile: DTensor dispatch %.1f us per call (%s) on %d kernels: +%.1f ms over the traced ops",
             per_call, "cached" if measured.get("cached") else "measured now", len(flagged), calls * per_call / 1e3)
    return out


def add_eager_step(kernels: list[Kernel], results: dict[str, Result], cache_dir: Path | None,
                   note: dict, ranks_on_host: int) -> dict[str, Result]:
    """``results`` with the eager engine's time per op added to every measured kernel, then scaled
    by the slowdown of ``ranks_on_host`` ranks side by side (``echo.profile.eager``, measured here
    or cached). Imported kernels are a real run's timings and keep them. Records the figures and
    their provenance in ``note["eager"]``."""
    measured_keys = [k for k in kernels if results[k.kernel_key].source == "measured"]
    if not measured_keys:
        note["eager"] = {"kernels": 0}
        return results
    from echo.profile import eager

    measured = eager.step_overheads(cache_dir)
    per_op, colocation = measured["eager_op_us"], eager.colocation_factor(measured, ranks_on_host)
    out = dict(results)
    for k in measured_keys:
        r = out[k.kernel_key]
        out[k.kernel_key] = replace(r, duration_us=(r.duration_us + per_op) * colocation,
                                    host_us=(r.host_us + per_op) * colocation, colocation_factor=colocation)
    ops = sum(k.count for k in measured_keys)
    note["eager"] = {"eager_op_us": per_op, "ranks_on_host": ranks_on_host, "colocation_factor": colocation,
                     "kernels": len(measured_keys), "added_ms": ops * per_op / 1e3, "measurement": measured}
    log.info("profile: eager engine %.1f us per op (%s), %d ranks on this CPU: kernels x %.3f",
             per_op, "cached" if measured.get("cached") else "measured now", ranks_on_host, colocation)
    return out


def model_kernels(kernels: list[Kernel], hardware: Hardware) -> dict[str, Result]:
    """kernel_key -> Result from the roofline model."""
    out = {}
    for k in kernels:
        est = roofline.estimate(hardware, k)
        out[k.kernel_key] = Result(est.duration_us, "model", 0, est.bound)
    return out


def kernels_table(kernels: list[Kernel], results: dict[str, Result]) -> pa.Table:
    """The KERNELS table (plus EXTRA columns), one row per kernel, in ``kernels`` order.

    ``achieved_tflops`` is the rate of the FLOPs the kernel executes: a causal flash kernel runs
    half its model FLOPs (``flops``, the MFU convention), and counting those would show rates
    above the GPU's peak."""
    rows = []
    for k in kernels:
        r = results[k.kernel_key]
        per_us = 1.0 / r.duration_us if r.duration_us > 0 else 0.0  # a zero-cost model (no launch floor)
        rows.append(dict(
            kernel_key=k.kernel_key, name=k.name, op_class=k.op_class, shapes=k.shapes, dtype=k.dtype,
            flops=k.flops, bytes=k.bytes, duration_us=r.duration_us,
            achieved_tflops=roofline.executed_flops(k) * per_us / 1e6, achieved_GBps=k.bytes * per_us / 1e3,
            source=r.source, count=k.count, kind=k.kind, bound=r.bound, threads=r.threads,
            isolated_us=r.isolated_us, inloop_factor=r.inloop_factor, host_us=r.host_us, dtensor=k.dtensor,
            colocation_factor=r.colocation_factor,
        ))
    schema = pa.schema(list(KERNELS) + list(EXTRA))
    return pa.Table.from_pylist(rows, schema=schema)
