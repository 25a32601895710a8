"""Cost of the profile stage: kernels timed per second on this CPU, the cache, the GPU model,
and a Kineto import; plus the repeatability of measured mode.

Traces of the tiny workloads (and of Korthikanti's 22B layer, for the GPU model) are made once
and kept under benchmarks/out/ (keyed by the trace stage's code version). Then:

1. measured mode, no cache: each tiny workload's distinct kernels timed on this CPU (1 thread);
   kernels per second timed is the cost figure;
2. the same workloads again, sharing one cache: only kernels no earlier workload had are timed;
3. tiny-tp2 profiled a second time without the cache: the worst per-kernel ratio between the
   two profiles (the repeatability figure; compare with the machine's load, printed);
4. the GPU roofline model on the layer traces: kernels modelled per second;
5. a Kineto import: a real run's Chrome trace matched against its Echo trace, events per second.

    .venv/bin/python benchmarks/bench_profile.py          # or: make bench

About three minutes on 2 cores (most of it timing kernels, which is the point).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(__file__).resolve().parent / "out" / "profile"
TINY = ("tiny-dp2", "tiny-tp2", "tiny-pp2")


def traced(name: str) -> Path:
    """The trace of a shipped workload, made once per trace code version."""
    from echo.config import load_workload
    from echo.trace import run_trace
    from echo.workflow.versions import code_version

    key = hashlib.sha256((name + code_version("trace")).encode()).hexdigest()[:10]
    d = OUT / f"{name}-{key}"
    if not (d / "ops.parquet").is_file():
        run_trace(load_workload(name), d)
    return d


def rows(path: Path) -> dict[str, dict]:
    from echo.io import read_parquet

    return {r["kernel_key"]: r for r in read_parquet(path).to_pylist()}


def main() -> int:
    import logging

    from echo.config import load_hardware
    from echo.profile import run_profile

    logging.basicConfig(level=logging.WARNING)
    cpu = load_hardware("local-cpu")
    traces = {name: traced(name) for name in TINY}
    print(f"machine: {os.cpu_count()} cores, 1-min load {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        tmp = Path(tmp)
        print("\n1. measured mode, no cache (1 thread)")
        print(f"   {'workload':<10} {'kernels':>7} {'timed':>6} {'modelled':>8} {'wall s':>7} {'kernels/s':>9}")
        timed = wall = 0.0
        for name, trace in traces.items():
            note = run_profile(cpu, trace, tmp / f"{name}.parquet", cache_dir=tmp / f"nocache-{name}")
            m = note["measure"]
            timed, wall = timed + m["timed"], wall + m["timing_s"]
            print(f"   {name:<10} {note['kernels']:>7} {m['timed']:>6} {m['modelled']:>8} {m['timing_s']:>7.1f} "
                  f"{m['kernels_per_s']:>9.2f}")
        print(f"   all: {timed:.0f} kernels timed in {wall:.1f} s = {timed / wall:.2f} kernels/s")

        print("\n2. the same workloads sharing one cache")
        for name, trace in traces.items():
            note = run_profile(cpu, trace, tmp / f"{name}-shared.parquet", cache_dir=tmp / "shared")
            m = note["measure"]
            print(f"   {name:<10} {note['kernels']:>3} kernels: {m['cached']:>3} from the cache, {m['timed']:>3} timed, "
                  f"{m['timing_s']:.1f} s")

        print("\n3. repeatability: tiny-tp2 profiled again, no cache")
        load0 = os.getloadavg()[0]
        run_profile(cpu, traces["tiny-tp2"], tmp / "tiny-tp2-again.parquet", cache_dir=tmp / "again")
        a, b = rows(tmp / "tiny-tp2.parquet"), rows(tmp / "tiny-tp2-again.parquet")
        both = [k for k in a if a[k]["source"] == b[k]["source"] == "measured"]
        ratios = sorted(((max(a[k]["duration_us"], b[k]["duration_us"]) / min(a[k]["duration_us"], b[k]["duration_us"]),
                          a[k]["name"], a[k]["shapes"]) for k in both), reverse=True)
        within = sum(r[0] <= 1.10 for r in ratios)
        print(f"   {within} of {len(ratios)} kernels within 10%; worst {ratios[0][0]:.3f} ({ratios[0][1]} {ratios[0][2][:40]}); "
              f"median {ratios[len(ratios) // 2][0]:.3f}; 1-min load {load0:.1f} -> {os.getloadavg()[0]:.1f}")

        print("\n4. GPU roofline model (a100-sxm-80gb) on traced layers of a 22B GPT")
        model_cost(tmp)

        print("\n5. Kineto import of a real run")
        import_cost(tmp)
    return 0


def model_cost(tmp: Path) -> None:
    from echo.config import load_hardware
    from echo.profile import calibration as cal
    from echo.profile import distinct_kernels
    from echo.profile.stage import model_kernels

    hw = load_hardware("a100-sxm-80gb")
    lt = cal.trace_layer(cal.KORTHIKANTI_TABLE4[0], OUT / "layers")
    kernels = distinct_kernels(lt.ops[2])
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 1.0:
        model_kernels(kernels, hw)
        n += len(kernels)
    print(f"   {n / (time.perf_counter() - t0):,.0f} kernels modelled per second ({len(kernels)} distinct kernels)")


def import_cost(tmp: Path) -> None:
    from echo.config.workload import Workload
    from echo.io import read_parquet
    from echo.profile import distinct_kernels, kineto, realrun
    from echo.trace import run_trace

    w = Workload.model_validate(dict(
        name="bench-kineto", model=dict(arch="gpt", layers=2, hidden=384, heads=6, vocab=2048, seq_len=256),
        parallel=dict(tp=1, pp=1, dp=1, zero=0), training=dict(global_batch=4, micro_batch=4, dtype="fp32")))
    run_trace(w, tmp / "kt")
    run = realrun.profile_step(w, tmp / "kt.json", steps=3, warmup=1)
    kernels = distinct_kernels(read_parquet(tmp / "kt" / "ops.parquet"))
    t0 = time.perf_counter()
    imp = kineto.import_trace(kernels, run.trace)
    dt = time.perf_counter() - t0
    print(f"   {imp.cpu_ops} cpu_op events, {len(kernels)} kernels ({len(imp.unmatched)} unmatched) in {dt:.2f} s "
          f"= {imp.cpu_ops / dt:,.0f} events/s")


if __name__ == "__main__":
    raise SystemExit(main())
