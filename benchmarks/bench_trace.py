"""Trace + dedup cost at scale: wall time, peak memory and classes per workload.

    .venv/bin/python benchmarks/bench_trace.py [workload ...]   (default: the issue's three)

Runs each into a temporary directory (a cold cache), the way the trace and dedup rules do.
Peak RSS is the largest single process (the tracer runs one process per traced rank).
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from echo.config import load_workload
from echo.dedup import run_dedup
from echo.trace import run_trace

DEFAULT = ["gpt3-175b", "llama3-405b-16k", "mixtral-8x22b-ep8"]


def bench(name: str) -> None:
    w = load_workload(name)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_trace(w, Path(tmp) / "trace")
        t1 = time.perf_counter()
        run_dedup(w, Path(tmp) / "trace", Path(tmp) / "rank_classes.parquet")
        t2 = time.perf_counter()
        classes = pq.read_table(Path(tmp) / "rank_classes.parquet")
        ranks = pq.read_table(Path(tmp) / "trace" / "ranks.parquet")
    rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
              resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    print(f"{name:20s} world {w.world_size:6d}  traced ranks {ranks.num_rows:3d}  "
          f"classes {len(set(classes['class_id'].to_pylist())):3d}  mapped ranks {classes.num_rows:6d}  "
          f"trace {t1 - t0:6.1f} s  dedup+verify {t2 - t1:5.1f} s  total {t2 - t0:6.1f} s  peak RSS {rss:6.0f} MB",
          flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or DEFAULT:
        bench(name)
