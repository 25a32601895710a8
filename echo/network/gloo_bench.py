"""A real collective benchmark: torch.distributed with the gloo backend over loopback.

``run_gloo_benchmark`` spawns ``ranks`` processes on this machine, sweeps message sizes and
returns one row per (op, size) with the median time of the timed repeats. It is what the
``local-gloo`` topology is calibrated from (see ``echo.network.calibrate``).

Sizes follow nccl-tests: ``bytes`` is the all_reduce buffer, the whole all_gather output and
the p2p tensor. Each timed repeat starts after a barrier, so ranks enter the op together, and
the time of a repeat is the slowest rank's (an op is done when every rank is done).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from echo.config.topology import Calibration

BENCH_OPS = ("all_reduce", "all_gather", "send")
BENCH_SCHEMA = pa.schema([
    ("op", pa.string()),
    ("gpus", pa.int32()),
    ("bytes", pa.int64()),
    ("time_us", pa.float64()),
])
_FLOAT_BYTES = 4  # float32 payloads
_WARMUP = 2       # untimed repeats per size: first touches allocate buffers and open connections
_BUDGET_US = 60_000.0  # timed samples per (op, size) aim to cover this much op time...
_MAX_SAMPLES = 60       # ...but no more than this many samples


def sweep_sizes(min_bytes: int, max_bytes: int, ranks: int = 1) -> list[int]:
    """min_bytes, 2*min_bytes, ... up to max_bytes, each rounded up to whole float32s per rank."""
    quantum = _FLOAT_BYTES * ranks  # all_gather splits the output evenly among ranks
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(-(-size // quantum) * quantum)
        size *= 2
    return sizes


def _free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed_op(op: str, rank: int, nbytes: int, world: int):
    """Return a zero-argument callable that runs one ``op`` of ``nbytes`` on this rank."""
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        buf = torch.ones(nbytes // _FLOAT_BYTES)
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        out = torch.empty(nbytes // _FLOAT_BYTES)
        inp = torch.ones(nbytes // _FLOAT_BYTES // world)
        return lambda: dist.all_gather_single(out, inp)
    if op == "send":
        # One-way transfer rank 0 -> rank 1; other ranks idle (they still join the barriers).
        buf = torch.ones(nbytes // _FLOAT_BYTES)
        if rank == 0:
            return lambda: dist.send(buf, dst=1)
        if rank == 1:
            return lambda: dist.recv(buf, src=0)
        return lambda: None
    raise ValueError(f"gloo benchmark: unsupported op '{op}'")


def _time_once(run) -> float:
    """Microseconds of one run of the op, started together with the other ranks."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e6


def _agreed_max(values: list[float]) -> list[float]:
    """Element-wise maximum over ranks (the slowest rank decides when an op is done)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _sweep(runs: list, iters: int) -> list[float]:
    """Median microseconds per op for each runner in ``runs``.

    Loopback on a small shared machine stalls in bursts (a few ms, many in a row), so one size
    must not be timed in one go: ``iters`` passes visit every runner in turn, each visit timing
    enough repeats that a runner gets about ``_BUDGET_US`` of samples (at most ``_MAX_SAMPLES``).
    A burst then spoils a few samples of many sizes instead of most samples of one.
    """
    for run in runs:
        for _ in range(_WARMUP):
            run()
    probes = _agreed_max([_time_once(run) for run in runs])  # ranks must agree on repeat counts
    per_visit = [int(min(_MAX_SAMPLES, max(iters, _BUDGET_US // max(p, 1.0))) // iters) for p in probes]
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(iters):
        for run, count, out in zip(runs, per_visit, samples, strict=True):
            out.extend(_time_once(run) for _ in range(count))
    return [statistics.median(_agreed_max(out)) for out in samples]


def _worker(rank: int, world: int, port: int, ops: Sequence[str], sizes: Sequence[int],
            iters: int, out_path: str) -> None:
    """Body of one benchmark process; rank 0 writes the rows to ``out_path`` as Arrow IPC."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share few cores: intra-op threads would only contend
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        keys = [(op, n) for op in ops for n in sizes]
        times = _sweep([_timed_op(op, rank, n, world) for op, n in keys], iters)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        rows = {"op": [op for op, _ in keys], "gpus": [2 if op == "send" else world for op, _ in keys],
                "bytes": [n for _, n in keys], "time_us": times}
        table = pa.Table.from_pydict(rows, schema=BENCH_SCHEMA)
        with pa.OSFile(out_path, "wb") as sink, pa.ipc.new_file(sink, BENCH_SCHEMA) as writer:
            writer.write_table(table)


def run_gloo_benchmark(calibration: Calibration, ops: Sequence[str] = BENCH_OPS) -> pa.Table:
    """Benchmark ``ops`` with ``calibration.ranks`` gloo processes on 127.0.0.1.

    Returns a table (op, gpus, bytes, time_us); ``gpus`` is the group size (2 for send).
    """
    import torch.multiprocessing as mp

    world = calibration.ranks
    if world < 2:
        raise ValueError("gloo benchmark needs calibration.ranks >= 2")
    ops = [op for op in ops if op != "send" or world >= 2]
    sizes = sweep_sizes(calibration.min_bytes, calibration.max_bytes, world)
    # Loopback only: the benchmark must not depend on (or touch) any real network interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="echo-gloo-") as tmp:
        out_path = str(Path(tmp) / "bench.arrow")
        mp.spawn(_worker, args=(world, _free_port(), tuple(ops), tuple(sizes), calibration.iters, out_path),
                 nprocs=world, join=True)
        with pa.memory_map(out_path) as source:
            return pa.ipc.open_file(source).read_all()
