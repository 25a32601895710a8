"""The trace's cost per recorded op, the figures behind the trace cost guard (echo/config/limits.py).

    .venv/bin/python benchmarks/bench_trace_cost.py [layers ...]   (default: 64 512 2048)

Traces one role of a small GPT (hidden 256, pp 1) of each depth, each in its own process and a
temporary directory, and prints its ops, the worker's trace time and peak memory, the per-op
slopes between the depths, and the guard's estimate beside the measurement (ratio estimate /
measured: above 1, the guard over-estimates, as it should).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from echo.config import Workload
from echo.config.limits import TRACE_WORKER_BASE_GIB, trace_estimate


def workload(layers: int) -> Workload:
    return Workload.model_validate({
        "name": f"trace-cost-{layers}", "description": "trace cost probe",
        "model": {"arch": "gpt", "layers": layers, "hidden": 256, "heads": 8, "vocab": 4096, "seq_len": 128},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 0, "schedule": "1f1b"},
        "training": {"global_batch": 8, "micro_batch": 2, "dtype": "bf16", "recompute": "none"},
    })


def one(layers: int) -> dict:
    """Trace in this process; the worker's time and peak RSS."""
    from echo.trace import run_trace

    with tempfile.TemporaryDirectory() as tmp:
        run_trace(workload(layers), Path(tmp))
        ops = pq.ParquetFile(Path(tmp) / "ops.parquet").metadata.num_rows
        wall = pq.read_table(Path(tmp) / "ranks.parquet")["trace_wall_s"][0].as_py()
    return {"layers": layers, "ops": ops, "trace_s": wall,
            "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def main(depths: list[int]) -> None:
    rows = []
    for layers in depths:
        out = subprocess.run([sys.executable, __file__, "--one", str(layers)], capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    for r in rows:
        est = trace_estimate(workload(r["layers"]))
        print(f"layers {r['layers']:5d}  ops {r['ops']:7d}  trace {r['trace_s']:6.1f} s  worker {r['worker_mb']:6.0f} MB"
              f"  | estimate: ops x{est['ops_per_role'] / r['ops']:.2f}, memory x{est['worker_gib'] * 1024 / r['worker_mb']:.2f}")
    for a, b in zip(rows, rows[1:], strict=False):
        d_ops = b["ops"] - a["ops"]
        print(f"{a['layers']} -> {b['layers']} layers: {1e3 * (b['trace_s'] - a['trace_s']) / d_ops:.2f} ms/op, "
              f"{1e3 * (b['worker_mb'] - a['worker_mb']) * 1024 / d_ops / 1e3:.1f} kB/op "
              f"(guard: base {TRACE_WORKER_BASE_GIB} GiB)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(int(sys.argv[2]))))
    else:
        main([int(a) for a in sys.argv[1:]] or [64, 512, 2048])
