"""A real training step of a one-rank workload on this CPU, recorded with ``torch.profiler``.

It runs the step Echo traces for that workload, with real tensors: the same model chunk
(``echo.training.model.ModelChunk``, first and last), the same loss, and the optimizer step as the
tracer records it (``echo.training.data_parallel.DataParallel``, its buckets not bound to the
model: the update runs on the buckets' own values, which changes no timing).

The profiled run gives a Chrome trace (for ``echo.profile.kineto``) and its measured step times
(``ProfilerStep#N`` spans in the same file); unprofiled steps are timed too, to show what the
profiler itself costs.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from echo.config.workload import Workload
from echo.io import atomic_path
from echo.profile.measure import torch_threads
from echo.training.model import DTYPES


@dataclass(frozen=True)
class RealRun:
    trace: Path
    profiled_step_us: list[float]     # wall time of each profiled step (perf_counter)
    unprofiled_step_us: list[float]   # the same step without the profiler
    threads: int
    profiled_step_cpu_us: list[float] = field(default_factory=list)  # CPU time of this thread per profiled step
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average before and after the run

    @property
    def median_unprofiled_us(self) -> float:
        return statistics.median(self.unprofiled_step_us)


def check_runnable(w: Workload) -> None:
    if w.world_size != 1:
        raise ValueError(f"workload {w.name}: a real run on this CPU covers one-rank workloads only "
                         f"(world size {w.world_size})")
    if w.model.experts:
        raise ValueError(f"workload {w.name}: mixture-of-experts models are not run here")


def profile_step(w: Workload, out_json: Path, *, steps: int = 3, warmup: int = 2, threads: int = 1,
                 seed: int = 0) -> RealRun:
    """Run ``warmup + steps`` real steps of ``w`` (the last ``steps`` under the profiler, with
    shapes recorded), write the Chrome trace to ``out_json``, then time ``steps`` more without
    the profiler."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from echo.training.data_parallel import DataParallel
    from echo.training.model import ModelChunk

    check_runnable(w)
    out_json = Path(out_json)
    before = torch.get_default_dtype()
    dtype = DTYPES[w.training.dtype]
    with torch_threads(threads) as n:
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            model = ModelChunk(w.model, w.model.layers, first=True, last=True, recompute=w.training.recompute)
        finally:
            torch.set_default_dtype(before)
        model.train()
        b, s, v = w.training.micro_batch, w.model.seq_len, w.model.vocab
        tokens = torch.randint(0, v, (b, s))
        labels = torch.randint(0, v, (b, s))
        # the optimizer step the tracer records: fused AdamW over flat fp32 buckets, zeroed
        # for the next step, then cast to the compute dtype; the buckets are not bound, so
        # gradients stay where autograd put them (Megatron's weight-gradient GEMMs write into
        # the buckets directly: a copy would be a kernel neither Megatron nor the trace has)
        dp = DataParallel([model], {"tp": None, "dp": None}, w.parallel, dtype)

        def step() -> None:
            for p in model.parameters():
                p.grad = None
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
            dp.step()

        profiled: list[float] = []
        cpu: list[float] = []
        load0 = os.getloadavg()[0]
        with atomic_path(out_json) as tmp:
            def export(prof) -> None:
                prof.export_chrome_trace(str(tmp))

            with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                         schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                         on_trace_ready=export) as prof:
                for i in range(warmup + steps):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    step()
                    if i >= warmup:
                        profiled.append((time.perf_counter() - t0) * 1e6)
                        cpu.append((time.thread_time() - c0) * 1e6)
                    prof.step()
        unprofiled = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            unprofiled.append((time.perf_counter() - t0) * 1e6)
    return RealRun(out_json, profiled, unprofiled, n, cpu, (load0, os.getloadavg()[0]))
