"""Design-space search against today's per-layout tracing, side by side in one run.

For each search spec (GPT-3 175B on 1,024 A100s, Llama 3 70B on 512 H100s; config/sweeps/*-search.yaml):

1. ``python -m echo search`` from a cold template cache (a fresh folder): wall time, layouts
   ranked, the best three, composition checks;
2. in the same run, ``SAMPLE`` of its layouts traced in full as the workflow traces them
   (``echo.trace.run_trace``: every role, one process each) and composed from the now warm
   templates (``echo.trace.compose.compose_trace``), timed both ways and compared table by table
   (every op, collective, dependency and memory figure must agree).

The speed-up is the full trace's mean time per layout against the search's wall time per layout
(templates, tails, composition, costing, simulation and checks all included), and, for the
tracing alone, against composition's time per layout.

Then the shipped 12-layout GPT-3 sweep (config/sweeps/gpt3-175b-a100-1024.yaml) is ranked twice,
from composed and from fully traced graphs, and the two rankings and step times compared.

    .venv/bin/python benchmarks/bench_search.py            # both specs, then the 12-layout check
    .venv/bin/python benchmarks/bench_search.py gpt3       # one spec (gpt3 | llama | sweep12)

About 15 minutes a spec on 2 cores.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

SPECS = {"gpt3": "gpt3-175b-a100-1024-search", "llama": "llama3-70b-h100-512-search"}
SAMPLE = 10
CORES = len(os.sched_getaffinity(0))


def _full_and_composed(exp, cache: Path, tmp: Path) -> dict:
    """Trace ``SAMPLE`` layouts in full and compose them; times and differences."""
    import pyarrow.compute as pac

    from echo.io import read_parquet
    from echo.trace import run_trace
    from echo.trace.compose import compose_trace, differences
    from echo.trace.runner import TABLES

    kept = exp.kept
    picks = [kept[round(k * (len(kept) - 1) / (SAMPLE - 1))] for k in range(SAMPLE)]
    full_s = composed_s = 0.0
    bad = []
    for i, c in enumerate(picks):
        t = time.perf_counter()
        run_trace(c.workload, tmp / f"full-{i}")
        full_s += time.perf_counter() - t
        t = time.perf_counter()
        composed = compose_trace(c.workload, tmp / f"composed-{i}", cache, CORES)
        composed_s += time.perf_counter() - t
        traced = {n: read_parquet(tmp / f"full-{i}" / f"{n}.parquet") for n in TABLES}
        for r in traced["ranks"]["rank"].to_pylist():
            diff = differences(*({n: t.filter(pac.equal(t["rank"], r)) for n, t in tables.items()}
                                 for tables in (composed, traced)))
            if diff:
                bad.append(f"{c.name} rank {r}: {diff[0]}")
    return {"layouts": len(picks), "roles": sum(c.workload.parallel.pp for c in picks),
            "full_s": full_s, "composed_s": composed_s, "differences": bad}


def search_case(key: str) -> None:
    from echo.sweep.search import expand_search, run_search

    name = SPECS[key]
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        res = run_search(name, tmp / "out", processes=CORES, cache_dir=tmp / "templates")
        wall = time.perf_counter() - t
        side = _full_and_composed(expand_search(name), tmp / "templates", tmp)
    per_layout = wall / res["kept"]
    full = side["full_s"] / side["layouts"]
    print(f"\n{name}: {res['layouts']} combinations, {res['kept']} layouts ranked ({res['fit']} fit in memory)")
    print(f"  search, cold cache, {CORES} cores: {wall:.0f} s ({wall / 60:.1f} min; goal <= 10, aim 3): "
          f"templates {res['templates_s']:.0f} s, {res['verified']} checks {res['verify_s']:.0f} s (with the spec and "
          f"calibration: {res['prepare_s']:.0f} s), tails {res['tails_s']:.0f} s, layouts {res['layouts_s']:.0f} s")
    print(f"  per layout: search {per_layout:.2f} s; full trace of its roles {full:.1f} s (mean of {side['layouts']} "
          f"sampled layouts, {side['roles']} roles): speed-up {full / per_layout:.0f}x (goal >= 50x)")
    print(f"  tracing alone: composition {side['composed_s'] / side['layouts']:.2f} s per layout (warm templates): "
          f"{side['full_s'] / max(side['composed_s'], 1e-9):.0f}x faster than the full trace")
    print(f"  composed vs full trace on the {side['layouts']} sampled layouts: "
          + ("every op, collective, dependency and memory figure equal" if not side["differences"]
             else f"{len(side['differences'])} ranks DIFFER, e.g. {side['differences'][0]}"))
    for r in res["best"]:
        print(f"  #{r['rank']} {r['tokens']}: {r['step_time_s']:.3f} s, MFU {r['mfu']:.3f}, {r['peak_mem_gib']:.1f} GiB")


def sweep12() -> None:
    """The 12-layout GPT-3 sweep ranked from composed and from fully traced graphs."""
    import pyarrow.parquet as pq

    from echo.artifacts import RANK_CLASSES
    from echo.config import load_hardware, load_topology
    from echo.dedup import rank_classes
    from echo.io import write_parquet
    from echo.network import run_calibrate
    from echo.profile import run_profile
    from echo.simulate import run_simulate
    from echo.sweep.search import expand_search, run_search
    from echo.trace import run_trace

    name = "gpt3-175b-a100-1024"
    with tempfile.TemporaryDirectory(prefix="bench-sweep12-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        run_search(name, tmp / "search", processes=CORES, cache_dir=tmp / "templates", verify=0)
        composed_s = time.perf_counter() - t
        composed = {r["layout"]: r for r in pq.read_table(tmp / "search" / "ranking.parquet").to_pylist()}
        exp = expand_search(name)
        hw, topo = load_hardware(exp.sweep.hardware), load_topology(exp.sweep.topologies[0])
        run_calibrate(topo, tmp / "calib")
        traced, t = {}, time.perf_counter()
        for c in exp.kept:
            d = tmp / "full" / c.trace
            if not (d / "ranks.parquet").is_file():  # layouts differing only in the schedule share a trace
                run_trace(c.workload, d)
            write_parquet(rank_classes(c.workload, pq.read_table(d / "ranks.parquet")), tmp / f"{c.name}.parquet",
                          RANK_CLASSES)
            run_profile(hw, d, tmp / f"{c.name}-k.parquet")
            s = run_simulate(c.workload, hw, topo, d, tmp / f"{c.name}.parquet", tmp / f"{c.name}-k.parquet",
                             tmp / "calib", tmp / "sim" / c.name, summary_only=True).to_pylist()[0]
            traced[c.name] = s
        traced_s = time.perf_counter() - t
    # the ranking: those that fit by step time (the search drops the others unsimulated, with their memory)
    order_c = [n for n in sorted(composed, key=lambda n: composed[n]["step_time_s"] or 0) if composed[n]["fits"]]
    order_t = [n for n in sorted(traced, key=lambda n: traced[n]["step_time_s"]) if traced[n]["fits"]]
    worst = max((abs(composed[n]["step_time_s"] / traced[n]["step_time_s"] - 1) for n in order_t), default=0.0)
    worst_mem = max(abs(composed[n]["peak_mem_gib"] / traced[n]["peak_mem_gib"] - 1) for n in traced)
    print(f"\n{name} ({len(traced)} layouts, {len(order_t)} fit): composed {composed_s:.0f} s, fully traced "
          f"{traced_s:.0f} s")
    print(f"  rankings {'identical' if order_c == order_t else 'DIFFER'}; worst step-time difference "
          f"{100 * worst:.4f}% (bound 0.5%); worst peak-memory difference {100 * worst_mem:.4f}% (every layout)")
    for n in sorted(traced, key=lambda n: traced[n]["step_time_s"]):
        step = composed[n]["step_time_s"]
        print(f"  {n.split('--', 1)[1]:<32} traced {traced[n]['step_time_s']:.6f} s  composed "
              + (f"{step:.6f} s" if step is not None else f"not simulated ({composed[n]['peak_mem_gib']:.1f} GiB "
                 f"does not fit; traced {traced[n]['peak_mem_gib']:.1f} GiB)"))


def main(which: list[str]) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    logging.disable(logging.INFO)
    for key in which or [*SPECS, "sweep12"]:
        sweep12() if key == "sweep12" else search_case(key)


if __name__ == "__main__":
    main(sys.argv[1:])
