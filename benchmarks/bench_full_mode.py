"""The simulator's full-mode cost, the figures behind its guard (echo/config/limits.py).

    .venv/bin/python benchmarks/bench_full_mode.py

Full mode replays every rank's programs (symmetric mode one timeline per pipeline stage), so its
time and memory grow with ranks x micro-batches x ops. This traces a small GPT (TP2 PP2) at a few
depths, simulates it in full mode at several data-parallel widths and micro-batch counts, each in
its own process, and fits by least squares

    seconds = a * ranks * micro-batches * ops  +  b * ranks * dp       (a rendezvous visits each
                                                                         member of its group)
    memory  = base + c * ranks * ops + e * ranks * micro-batches * ops (programs kept per rank;
                                                                         the timeline's events)

with ops the ops one role records. It prints the fitted constants beside the guard's and the
guard's estimate beside each measurement (above 1: the guard over-estimates, as it should; it
also takes trace_estimate's 160 ops a layer, more than a GPT records).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from echo.config import Workload
from echo.config import limits as L

HARDWARE, TOPOLOGY = "b200-sxm", "dgx-b200"
# (dp, micro-batches, layers): ranks = 4 dp
CASES = [(2, 4, 4), (8, 8, 4), (32, 8, 4), (64, 4, 4), (64, 32, 4), (64, 4, 16), (128, 8, 4), (256, 4, 4)]


def workload(dp: int, micro_batches: int, layers: int) -> Workload:
    return Workload.model_validate({
        "name": f"full-cost-{dp}-{micro_batches}-{layers}", "description": "full-mode cost probe",
        "model": {"arch": "gpt", "layers": layers, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
        "parallel": {"tp": 2, "pp": 2, "dp": dp, "zero": 1, "schedule": "1f1b"},
        "training": {"global_batch": dp * micro_batches, "micro_batch": 1, "dtype": "bf16", "recompute": "none"},
    })


def one(dp: int, micro_batches: int, layers: int) -> dict:
    """Trace, classes, kernels and network in a temporary directory; simulate in full mode in this
    process; the stage's own wall time and the process' peak RSS."""
    from echo.artifacts import RANK_CLASSES
    from echo.config import load_hardware, load_topology
    from echo.dedup import rank_classes
    from echo.io import write_parquet
    from echo.network import run_calibrate
    from echo.profile import run_profile
    from echo.simulate import run_simulate
    from echo.trace import run_trace

    w = workload(dp, micro_batches, layers)
    hw, topo = load_hardware(HARDWARE), load_topology(TOPOLOGY)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_trace(w, root / "trace")
        write_parquet(rank_classes(w, pq.read_table(root / "trace" / "ranks.parquet")), root / "rank_classes.parquet",
                      RANK_CLASSES)
        run_profile(hw, root / "trace", root / "kernels.parquet")
        run_calibrate(topo, root / "calib")
        roles = pq.read_table(root / "trace" / "ops.parquet", columns=["rank"])["rank"].to_pylist()
        ops = len(roles) / len(set(roles))  # ops one role records
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        s = run_simulate(w, hw, topo, root / "trace", root / "rank_classes.parquet", root / "kernels.parquet",
                         root / "calib", root / "full", mode="full").to_pylist()[0]
    return {"dp": dp, "ranks": w.world_size, "micro_batches": micro_batches, "layers": layers, "ops": ops,
            "wall_s": s["sim_wall_s"], "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "rss_before_gib": before / 2**20}


def fit(rows: list[dict]) -> dict[str, float]:
    r = np.array([[x["ranks"], x["micro_batches"], x["ops"], x["dp"]] for x in rows], dtype=float)
    ranks, mb, ops, dp = r.T
    t = np.array([x["wall_s"] for x in rows])
    (a, b), *_ = np.linalg.lstsq(np.stack([ranks * mb * ops, ranks * dp], 1), t, rcond=None)
    m = np.array([x["rss_gib"] for x in rows]) * 2**30
    (base, c, e), *_ = np.linalg.lstsq(np.stack([np.ones_like(ranks), ranks * ops, ranks * mb * ops], 1), m, rcond=None)
    return {"s_per_event_op": a, "s_per_rank_member": b, "base_gib": base / 2**30, "bytes_per_rank_op": c,
            "bytes_per_event_op": e}


def main() -> None:
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--one", *map(str, case)], capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"full mode on {HARDWARE}/{TOPOLOGY}, GPT hidden 64, TP2 PP2")
    print(f"{'ranks':>6} {'dp':>4} {'m':>3} {'layers':>6} {'ops':>5} {'wall_s':>7} {'rss_GiB':>7} | estimate: "
          f"{'time':>5} {'memory':>6}")
    for x in rows:
        est = L.full_mode_estimate(workload(x["dp"], x["micro_batches"], x["layers"]))
        print(f"{x['ranks']:6d} {x['dp']:4d} {x['micro_batches']:3d} {x['layers']:6d} {x['ops']:5.0f} "
              f"{x['wall_s']:7.2f} {x['rss_gib']:7.2f} |           x{est['hours'] * 3600 / x['wall_s']:4.1f} "
              f"x{est['gib'] / x['rss_gib']:5.2f}")
    f = fit(rows)
    shipped = {"s_per_event_op": L.FULL_SECONDS_PER_EVENT_OP, "s_per_rank_member": L.FULL_SECONDS_PER_RANK_MEMBER,
               "base_gib": L.FULL_BASE_GIB, "bytes_per_rank_op": L.FULL_BYTES_PER_RANK_OP,
               "bytes_per_event_op": L.FULL_BYTES_PER_EVENT_OP}
    for k, v in f.items():
        print(f"  {k:>20}: fitted {v:.3g}   guard {shipped[k]:.3g}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(*map(int, sys.argv[2:5]))))
    else:
        main()
