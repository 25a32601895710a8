"""Does a gloo all-reduce cost more inside a training step than in the calibration benchmark?

The calibrate stage times collectives with the ranks entering together (after a barrier). In a
training step each rank arrives after a stretch of compute. This prints the mean / median / 20th
percentile time of a 256 KB all-reduce (tiny-tp2's tensor-parallel message) over 2 ranks both
ways, at real-time priority where permitted, as the measure stage runs its ranks.

    .venv/bin/python benchmarks/bench_gloo_after_compute.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from echo.launch import free_port

NBYTES = 256 * 1024
ITERS, SKIP = 300, 20
BURST_S = 0.002  # compute between collectives (a tiny-tp2 forward has ~1.8 ms between all-reduces)


def _worker(rank: int, port: int) -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
    except PermissionError:
        pass
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf, a = torch.zeros(NBYTES // 4), torch.randn(256, 256)
    for mode in ("together (after a barrier)", f"after {BURST_S * 1e3:.0f} ms of compute"):
        times = []
        for _ in range(ITERS):
            if mode.startswith("together"):
                dist.barrier()
            else:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < BURST_S:
                    a @ a
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append((time.perf_counter() - t0) * 1e6)
        times = sorted(times[SKIP:])
        if rank == 0:
            print(f"all_reduce {NBYTES // 1024} KB, 2 ranks, {mode}: mean {statistics.mean(times):.0f} us, "
                  f"median {statistics.median(times):.0f} us, p20 {times[len(times) // 5]:.0f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_worker, args=(free_port(),), nprocs=2)
