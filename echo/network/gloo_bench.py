"""A real collective benchmark: torch.distributed with the gloo backend over loopback.

``run_gloo_benchmark`` spawns ``ranks`` processes on this machine, sweeps message sizes and
returns one row per (op, size) with the median time of the timed repeats. It is what the
``local-gloo`` topology is calibrated from (see ``echo.network.calibrate``).

Sizes follow nccl-tests: ``bytes`` is the all_reduce buffer, the whole all_gather output, the
whole reduce_scatter input and the p2p tensor. Ops named ``functional:<op>`` run through torch's
functional collectives, as DTensor (the traced tensor parallelism) calls them; the network fit
keeps plain ops, and what the functional ones cost on top is fitted apart
(``echo.network.fit.fit_api_overheads``). Each timed repeat starts after a barrier, so ranks
enter the op together, and the time of a repeat is the slowest rank's (an op is done when every
rank is done).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from echo.config.topology import Calibration
from echo.launch import free_port, launch, wait

FUNCTIONAL = "functional:"  # an op called through torch's functional collectives (DTensor's path)
PLAIN_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
BENCH_OPS = (*PLAIN_OPS, f"{FUNCTIONAL}all_reduce", f"{FUNCTIONAL}all_gather")
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
_PASSES = 12            # sweeps over all sizes that the samples of each size are spread over
_TIMEOUT_S = 300.0      # a hung rank (e.g. a blocked port) must not hang the workflow
_MAX_HELD_BYTES = 4 << 30  # every size's buffers stay allocated during the sweep (per rank)
# bytes of buffers one op holds per message byte: all_gather keeps its output and its input share
# (functional ones also allocate their output each call, freed at once)
_HELD_PER_BYTE = {"all_reduce": 1.0, "all_gather": 1.5, "reduce_scatter": 1.5, "send": 1.0,
                  f"{FUNCTIONAL}all_reduce": 1.0, f"{FUNCTIONAL}all_gather": 0.5}


def sweep_sizes(min_bytes: int, max_bytes: int, ranks: int = 1) -> list[int]:
    """min_bytes, 2*min_bytes, ... up to max_bytes, each rounded up to whole float32s per rank."""
    quantum = _FLOAT_BYTES * ranks  # all_gather splits the output evenly among ranks
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(-(-size // quantum) * quantum)
        size *= 2
    return sizes


def _timed_op(op: str, rank: int, nbytes: int, world: int):
    """Return a zero-argument callable that runs one ``op`` of ``nbytes`` on this rank."""
    import torch
    import torch.distributed as dist

    if op.startswith(FUNCTIONAL):  # as DTensor calls them: a new output, then wait on it
        import torch.distributed._functional_collectives as funcol

        group = dist.group.WORLD
        if op == f"{FUNCTIONAL}all_reduce":
            buf = torch.zeros(nbytes // _FLOAT_BYTES)
            return lambda: funcol.wait_tensor(funcol.all_reduce(buf, "sum", group))
        if op == f"{FUNCTIONAL}all_gather":
            inp = torch.ones(nbytes // _FLOAT_BYTES // world)
            return lambda: funcol.wait_tensor(funcol.all_gather_tensor(inp, 0, group))
    if op == "all_reduce":
        buf = torch.zeros(nbytes // _FLOAT_BYTES)  # zeros: repeated sums never overflow to inf
        return lambda: dist.all_reduce(buf)
    if op == "all_gather":
        out = torch.empty(nbytes // _FLOAT_BYTES)
        inp = torch.ones(nbytes // _FLOAT_BYTES // world)
        return lambda: dist.all_gather_single(out, inp)
    if op == "reduce_scatter":  # ZeRO's gradient reduction; gloo's is not half an all-reduce
        inp = torch.zeros(nbytes // _FLOAT_BYTES)
        out = torch.empty(nbytes // _FLOAT_BYTES // world)
        return lambda: dist.reduce_scatter_single(out, inp)
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


def _low_quantile(samples: list[float], q: float = 0.2) -> float:
    """The ``q`` quantile of the samples: what the op costs when the machine lets it run.

    Interference (other processes on a shared machine, loopback stalls) only ever adds time, so
    a low quantile estimates the op's own cost; the median drifts with the machine's load."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sweep(runs: list, iters: int) -> list[float]:
    """Microseconds per op (a low quantile of the samples, ``_low_quantile``) for each runner in
    ``runs`` (at least ``iters`` samples each).

    Loopback on a small shared machine stalls in bursts (a few ms, many in a row), so one size
    must not be timed in one go: ``_PASSES`` passes visit every runner in turn, each visit timing
    enough repeats that a runner gets about ``_BUDGET_US`` of samples (at most ``_MAX_SAMPLES``).
    A burst then spoils a few samples of many sizes instead of most samples of one.
    """
    for run in runs:
        for _ in range(_WARMUP):
            run()
    probes = _agreed_max([_time_once(run) for run in runs])  # ranks must agree on repeat counts
    passes = max(iters, _PASSES)
    wanted = [min(_MAX_SAMPLES, max(iters, _BUDGET_US // max(p, 1.0))) for p in probes]
    per_visit = [max(1, round(w / passes)) for w in wanted]
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(passes):
        for run, count, out in zip(runs, per_visit, samples, strict=True):
            out.extend(_time_once(run) for _ in range(count))
    return [_low_quantile(_agreed_max(out)) for out in samples]


def _worker(rank: int, spec: dict) -> None:
    """Body of one benchmark process; rank 0 writes the rows to ``spec["out"]`` as Arrow IPC."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share few cores: intra-op threads would only contend
    world, ops, sizes = spec["world"], spec["ops"], spec["sizes"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world)
    try:
        keys = [(op, n) for op in ops for n in sizes]
        times = _sweep([_timed_op(op, rank, n, world) for op, n in keys], spec["iters"])
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        rows = {"op": [op for op, _ in keys], "gpus": [2 if op == "send" else world for op, _ in keys],
                "bytes": [n for _, n in keys], "time_us": times}
        table = pa.Table.from_pydict(rows, schema=BENCH_SCHEMA)
        with pa.OSFile(spec["out"], "wb") as sink, pa.ipc.new_file(sink, BENCH_SCHEMA) as writer:
            writer.write_table(table)


def run_gloo_benchmark(calibration: Calibration, ops: Sequence[str] = BENCH_OPS,
                       timeout_s: float = _TIMEOUT_S, priority: str = "none") -> pa.Table:
    """Benchmark ``ops`` with ``calibration.ranks`` gloo processes on 127.0.0.1, scheduled as
    ``priority`` (echo.launch.prioritize: the calibrate stage passes the measure stage's, so that
    the collectives are timed as the real runs they predict schedule theirs).

    Returns a table (op, gpus, bytes, time_us); ``gpus`` is the group size (2 for send).
    """
    if calibration.ranks < 2:
        raise ValueError("gloo benchmark needs calibration.ranks >= 2")
    unknown = set(ops) - set(BENCH_OPS)
    if unknown:
        raise ValueError(f"gloo benchmark: unsupported ops {sorted(unknown)}; supported: {BENCH_OPS}")
    sizes = sweep_sizes(calibration.min_bytes, calibration.max_bytes, calibration.ranks)
    held = sum(sizes) * sum(_HELD_PER_BYTE[op] for op in ops)
    if held > _MAX_HELD_BYTES:
        raise ValueError(f"gloo benchmark: sizes up to calibration.max_bytes={calibration.max_bytes} would hold "
                         f"{held / 2**30:.1f} GiB per rank (limit {_MAX_HELD_BYTES / 2**30:.0f} GiB)")
    with tempfile.TemporaryDirectory(prefix="echo-gloo-") as tmp_name:
        tmp = Path(tmp_name)
        spec = {"world": calibration.ranks, "port": free_port(), "ops": list(ops), "iters": calibration.iters,
                "sizes": sizes, "out": str(tmp / "bench.arrow")}
        wait(launch("echo.network.gloo_bench", spec, spec["world"], tmp, priority=priority), tmp, timeout_s,
             "gloo benchmark")
        with pa.memory_map(spec["out"]) as source:
            return pa.ipc.open_file(source).read_all()


if __name__ == "__main__":  # a worker started by echo.launch.launch
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
