"""The host's launch pace (``Hardware.host.launch_us``) from real Kineto traces of GPU jobs.

A training step's host thread puts each op on the GPU through a runtime call (cudaLaunchKernel,
cudaMemcpyAsync, cudaMemsetAsync); between two calls it runs the framework (Python, the
dispatcher, the allocator). While it does not wait for the GPU, the interval between its
consecutive calls is the host time per launched op, whatever the GPU is doing: the queue
decouples the two. Waits show up as long intervals (a synchronizing copy, a barrier, the data
loader), so a thread's pace is the median interval of its runs of calls, ignoring intervals of
``BURST_GAP_US`` or more.

The reference folder's ``kineto/`` traces (HolisticTraceAnalysis's test data, A100 jobs) give one
pace per launching thread (the forward thread and autograd's backward thread); they differ by
job, from about 20 us to 110 us, with the framework code each op runs. ``launch_pace_us`` takes
the fastest job's threads: the least host time per op seen in an eager PyTorch step on those
hosts, the floor of the range.

No trace of Megatron-Core with Transformer Engine (the framework of the published Megatron rows)
is in the reference folder, so its pace is the per-job term the compute-model issue allows:
``fit_launch_us`` fits it on the Megatron-Bridge table's declared fit rows only
(config/splits/megatron_bridge_perf_all.csv) that have results here (the others are listed as
skipped), simulating each with its traced results at every
pace of ``GRID_US`` and keeping the one of least mean |error|; the validation rows then score it.
It must land inside the traces' range (``PLAUSIBLE_US``), or the fit is refused: a pace outside
what real PyTorch jobs show would be absorbing some other error.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from echo.profile.kineto import load_document
from echo.reference import reference_root

GRID_US = tuple(float(x) for x in range(20, 161, 5))  # the paces fit_launch_us tries
PLAUSIBLE_US = (15.0, 150.0)  # the Kineto traces' per-op paces, 21.5 to 112 us, with a margin
MIN_ROWS = 3  # fit rows with results needed

# The runtime calls that put one op on a GPU stream.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaMemcpyAsync", "cudaMemsetAsync"})
BURST_GAP_US = 1000.0  # an interval this long is the host waiting, not launching
MIN_LAUNCHES = 50      # a thread with fewer intervals says little about a pace


def thread_paces(path: Path) -> dict[int, tuple[int, float]]:
    """Per launching thread of the trace at ``path``: (intervals used, median interval in us)."""
    starts: dict[int, list[float]] = defaultdict(list)
    for ev in load_document(path)["traceEvents"]:
        if ev.get("cat") == "cuda_runtime" and ev.get("name") in LAUNCH_CALLS:
            starts[ev["tid"]].append(float(ev["ts"]))
    out = {}
    for tid, ts in starts.items():
        ts.sort()
        gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b - a < BURST_GAP_US]
        if len(gaps) >= MIN_LAUNCHES:
            out[tid] = (len(gaps), statistics.median(gaps))
    return out


def job_paces(reference: Path | None = None) -> dict[str, float]:
    """Per trace of the reference folder's kineto/: the mean over its launching threads of their
    median interval (us)."""
    folder = reference_root(reference) / "kineto"
    paths = sorted(folder.glob("*.json.gz")) + sorted(folder.glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"{folder}: no Kineto traces (*.json.gz) to derive the host launch pace from")
    out = {}
    for p in paths:
        paces = thread_paces(p)
        if paces:
            out[p.name] = statistics.mean(m for _, m in paces.values())
    return out


def launch_pace_us(reference: Path | None = None) -> tuple[float, str]:
    """(the host launch pace in us, the sentence saying where it comes from): the fastest job's."""
    paces = job_paces(reference)
    name = min(paces, key=paces.get)
    others = ", ".join(f"{n} {v:.0f}" for n, v in sorted(paces.items()) if n != name)
    return paces[name], (f"median interval between a launching thread's consecutive runtime launch calls "
                         f"(intervals under {BURST_GAP_US:.0f} us), mean over the threads of {name}, the fastest "
                         f"of the reference folder's Kineto traces (echo.fit.host_launch; the others, us: {others})")


def fit_launch_us(results: Path, reference: Path | None = None, grid: tuple[float, ...] = GRID_US,
                  config_root: Path | None = None) -> dict:
    """Fit the host pace on the Megatron-Bridge fit rows (see the module docstring) from their
    traced, profiled and calibrated results under ``results`` (``snakemake
    results/validate/published.parquet`` with those rows). Returns the pace, the curve (pace,
    mean |error| over the fit rows) and each fit row's error at the pace chosen."""
    import tempfile

    from echo.config import load_hardware, load_topology, load_workload
    from echo.simulate import run_simulate
    from echo.validate.published import published_rows

    rows = [r for r in published_rows(reference) if r.source.key == "mbridge" and r.split == "fit"]
    if not rows:
        raise ValueError("no Megatron-Bridge fit rows (config/splits/megatron_bridge_perf_all.csv)")
    results = Path(results)
    jobs, used, skipped = {}, [], []
    for r in rows:
        dirs = {"trace": results / "trace" / r.name, "classes": results / "dedup" / r.name / "rank_classes.parquet",
                "kernels": results / "profile" / r.name / r.hardware / "kernels.parquet",
                "calib": results / "calibrate" / r.topology}
        if not all(p.exists() for p in dirs.values()):  # a fit row not traced here: listed, not used
            skipped.append(f"{r.name} {r.label}")
            continue
        used.append(r)
        jobs[r.name] = (load_workload(r.name, config_root), load_hardware(r.hardware, config_root),
                        load_topology(r.topology, config_root), dirs)
    if len(used) < MIN_ROWS:
        raise FileNotFoundError(f"{len(used)} of {len(rows)} Megatron-Bridge fit rows have results under {results} "
                                f"(at least {MIN_ROWS} needed): run snakemake results/validate/published.parquet "
                                "with the fit rows")
    rows = used
    curve, errors = [], {}
    with tempfile.TemporaryDirectory(prefix="echo-host-fit-") as tmp:
        for pace in grid:
            step = {}
            for name, (w, hw, topo, d) in jobs.items():
                host = {"launch_us": {"value": pace, "status": "assumed", "basis": "fit_launch_us grid"}}
                hw = type(hw).model_validate(hw.model_dump() | {"host": host})
                step[name] = run_simulate(w, hw, topo, d["trace"], d["classes"], d["kernels"], d["calib"],
                                          Path(tmp) / name, summary_only=True).column("step_time_s")[0].as_py()
            errs = [step[r.name] / r.measured_step_s - 1 for r in rows]
            curve.append((pace, statistics.mean(abs(e) for e in errs)))
            errors[pace] = errs
    best = min(curve, key=lambda c: c[1])[0]
    if not PLAUSIBLE_US[0] <= best <= PLAUSIBLE_US[1] or best in (grid[0], grid[-1]):
        raise ValueError(f"the fit rows want a host pace of {best} us, at the edge of the grid or outside what "
                         f"real jobs' traces show ({PLAUSIBLE_US[0]}-{PLAUSIBLE_US[1]} us): not a host effect")
    return {"launch_us": best, "curve": curve, "skipped": skipped,
            "rows": [{"workload": r.name, "row": r.label, "measured_s": r.measured_step_s, "error": e}
                     for r, e in zip(rows, errors[best], strict=True)]}


def main(argv: list[str] | None = None) -> None:
    """``python -m echo.fit.host_launch [RESULTS]``: the Kineto floor, then the fit on the
    Megatron-Bridge fit rows (written to RESULTS/fit/host_launch.json)."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    results = Path(args[0] if args else "results")
    floor, basis = launch_pace_us()
    print(f"Kineto floor: {floor:.1f} us ({basis})")
    fit = fit_launch_us(results)
    print(f"fitted on {len(fit['rows'])} Megatron-Bridge fit rows: {fit['launch_us']:.0f} us "
          f"({len(fit['skipped'])} fit rows without results skipped)")
    for pace, mae in fit["curve"]:
        print(f"  {pace:6.1f} us: mean |error| {mae:.1%}")
    for r in fit["rows"]:
        print(f"  {r['workload']} {r['row']}: {r['error']:+.1%}")
    out = results / "fit" / "host_launch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"floor_us": floor, "floor_basis": basis, **fit}, indent=1))


if __name__ == "__main__":
    main()
