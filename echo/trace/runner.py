"""Trace one representative rank per role, each in its own process, and gather the tables."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from echo import launch
from echo.artifacts import COMMS, DEPS, OPS, TRACED_RANKS
from echo.config.limits import trace_estimate
from echo.config.workload import Workload
from echo.io import write_parquet
from echo.training.layout import Layout

log = logging.getLogger(__name__)
TABLES = {"ops": OPS, "comms": COMMS, "deps": DEPS, "ranks": TRACED_RANKS}
_UNSUPPORTED = [  # (condition, key, reason): refused before any process starts
    (lambda w: w.model.kv < w.parallel.tp, "model.kv_heads", "fewer key/value heads than tp (replicated kv heads) is not traced yet"),
    (lambda w: w.model.experts > 0 and w.parallel.tp > 1 and not w.parallel.sequence_parallel,
     "parallel.sequence_parallel", "a mixture of experts with tp > 1 needs sequence_parallel (as in Megatron-Core)"),
    (lambda w: w.model.experts > 0 and w.parallel.zero == 3, "parallel.zero", "ZeRO 3 with experts is not traced yet"),
]


def check_traceable(w: Workload) -> None:
    from echo.errors import ConfigError

    for unsupported, key, reason in _UNSUPPORTED:
        if unsupported(w):
            raise ConfigError(f"config/workloads/{w.name}.yaml", key, reason)
    if w.model.arch == "hf":  # what transformers cannot build is refused before any process starts
        from echo.training.hf import check_buildable

        check_buildable(w)
    if w.model.arch == "module":
        from echo.training.custom import check_buildable as check_module

        check_module(w)


def trace_ranks(w: Workload, ranks: list[int], out_dir: Path, jobs: int | None = None,
                label_layers: bool = False) -> dict[str, pa.Table]:
    """Trace ``ranks`` in parallel worker processes; return the concatenated tables (``label_layers``:
    with the ops' ``layer`` column, as layer templates need)."""
    # the cores this process may run on (a SLURM job's allocation), not the machine's count
    jobs = jobs or max(1, min(len(ranks), len(os.sched_getaffinity(0))))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".trace-", dir=out_dir) as tmp:
        spec = Path(tmp) / "workload.json"
        spec.write_text(w.model_dump_json())
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(lambda r: _run_worker(spec, r, Path(tmp) / str(r), label_layers), ranks))
        names = [*TABLES, *(["params", "mem_events", "mem_entries"] if label_layers else [])]
        return {name: pa.concat_tables([pq.read_table(Path(tmp) / str(r) / f"{name}.parquet") for r in ranks])
                for name in names}


def _run_worker(spec: Path, rank: int, out: Path, label_layers: bool = False) -> None:
    t0 = time.perf_counter()
    proc = launch.run("echo.trace.worker", spec, rank, out, *(["--label-layers"] if label_layers else []))
    if proc.returncode:
        raise RuntimeError(f"tracing rank {rank} failed:\n{proc.stderr[-4000:]}")
    log.info("traced rank %d in %.1f s", rank, time.perf_counter() - t0)


def run_trace(workload: Workload, out_dir: Path) -> None:
    """Trace one representative rank per role of ``workload`` into ``out_dir``."""
    check_traceable(workload)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = Layout(workload.parallel).representatives()
    cost = trace_estimate(workload)  # the cost guard's bound, checked when the config loaded
    log.info("tracing %d roles of %s (world size %d): at most about %.0f ops a role, %.1f GiB a tracing "
             "process, %.2f h on one core", len(reps), workload.name, workload.world_size, cost["ops_per_role"],
             cost["worker_gib"], cost["hours"] * len(reps) / cost["roles"])
    tables = trace_ranks(workload, sorted(reps.values()), out_dir)
    for name, schema in TABLES.items():
        write_parquet(tables[name], out_dir / f"{name}.parquet", schema)


def warm() -> None:
    """Import here what tracing imports, so that processes forked from this one find it imported
    (a fake tensor mode's first use alone imports torch._dynamo: over a second)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    from echo.trace import recorder, step  # noqa: F401
    from echo.training import data_parallel, model  # noqa: F401

    with FakeTensorMode():
        torch.empty(1)


def forked_map(fn, jobs: list, processes: int, fresh: bool = True) -> list:
    """``fn(job)`` for each job in processes forked from this one (after ``warm``). ``fresh``:
    each job in a process of its own, as a traced rank needs (torch numbers process groups per
    process, and the names are in the trace); else each process runs many jobs in turn (for
    ``fn`` that creates and destroys its own fake process group and records no group names)."""
    import multiprocessing

    if not jobs:
        return []
    warm()
    # the first job runs here: what tracing fills on first use (fake tensors' dispatch cache,
    # DTensor's sharding propagation, lazily imported ops) is then inherited by every forked
    # process, and a rank traces in a third of the time it takes a cold process. Its tables are
    # the same (destroy_process_group renumbers groups from 1; tests/test_template.py checks it)
    first = fn(jobs[0])
    rest = jobs[1:]
    if not rest:
        return [first]
    ctx = multiprocessing.get_context("fork")
    n = max(1, min(processes, len(rest)))
    with ctx.Pool(n, maxtasksperchild=1 if fresh else None) as pool:
        return [first, *pool.map(fn, rest, chunksize=1 if fresh else max(1, len(rest) // (4 * n)))]
