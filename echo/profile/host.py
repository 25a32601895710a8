"""Host overhead of DTensor dispatch on this CPU, per DTensor-level call.

Why it matters here: on the local CPU the thread that dispatches an op also runs its kernel, so
every microsecond the host spends before a kernel starts is a microsecond of the step
(``Hardware.host_synchronous``). The real runs' tensor parallelism goes through DTensor (the
tracer's own plans): each op on DTensors runs sharding propagation (cached after the first
step), Python dispatch and wrapping, on top of the parallel styles' module hooks and autograd
of the wrappers. That costs tens of microseconds per call on this CPU, against a few for a
plain op, while the profile stage times bare aten calls. GPU targets do not get it: their
kernels run from a queue the host fills ahead of time, and Megatron-LM, which they stand for,
runs tensor parallelism without DTensor.

What is measured: a reference tensor-parallel GPT chunk (``REFERENCE``: token and position
embeddings, two blocks, LM head and the vocabulary-parallel loss, the tracer's DTensor plans),
forward and backward of one micro-batch, on a one-rank mesh of the fake process group (no
peer, no port: only dispatch is timed, collectives belong to the network model), against the
same chunk without the plans. Steps alternate (plain, sharded) in ``PAIRS`` pairs after a
warm-up, each timed with the thread's CPU clock (time other processes take is not counted);
the overhead per call is the median over pairs of (sharded - plain) divided by the DTensor-level
calls of one sharded step, counted as the tracer counts them (``echo.trace.recorder``: every op
with a DTensor argument, outside sharding propagation). Small shapes keep the kernels' share
of each step, and with it their noise, small; the overhead per call does not depend on shapes.

``dtensor_call_us(cache_dir)`` returns the figure with its provenance, measured once per CPU
model, torch version and method and cached in ``{cache_dir}/host_overhead.json``: in
``PROCESSES`` fresh interpreters, keeping the middle one (single interpreters ranged 46-51 us on
the development machine, with outliers near 60 us while another job ran).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

METHOD = "dtensor-per-call/one-rank-fake-mesh/paired-thread-cpu/median-of-processes/v2"
FILE = "host_overhead.json"
REFERENCE = dict(arch="gpt", layers=2, hidden=64, heads=4, vocab=512, seq_len=32)
MICRO_BATCH = 2
PAIRS = 41
WARMUP = 5
PROCESSES = 3  # fresh interpreters measured one after the other; the middle one is kept
CLOCK = time.thread_time


def measure_dtensor_call_us(pairs: int = PAIRS, warmup: int = WARMUP) -> dict:
    """Measure in this process (it starts and ends a one-rank fake process group)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from echo.config.workload import ModelConfig
    from echo.trace.recorder import _SHARDING_PROP_DEPTH, _mute_sharding_propagation
    from echo.training.model import ModelChunk
    from echo.training.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    cfg = ModelConfig(**REFERENCE)
    tokens = torch.randint(0, cfg.vocab, (MICRO_BATCH, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, cfg.vocab, (MICRO_BATCH, cfg.seq_len), generator=torch.Generator().manual_seed(1))

    def step(model) -> None:  # as echo.training.run runs a micro-batch
        out = model(tokens)
        if isinstance(out, DTensor):
            with loss_parallel():
                F.cross_entropy(out.flatten(0, 1), labels.flatten()).backward()
        else:
            F.cross_entropy(out.flatten(0, 1).float(), labels.flatten()).backward()

    class CountCalls(TorchDispatchMode):
        """Counts DTensor-level calls as the tracer's recorder does, and lets DTensor run them."""

        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                if not _SHARDING_PROP_DEPTH[0]:
                    CountCalls.calls += 1
                return NotImplemented
            return func(*args, **(kwargs or {}))

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        torch.manual_seed(0)
        plain = ModelChunk(cfg, cfg.layers, first=True, last=True)
        torch.manual_seed(0)
        sharded = ModelChunk(cfg, cfg.layers, first=True, last=True)
        apply_tensor_parallel(sharded, DeviceMesh("cpu", [0]))
        for _ in range(warmup):
            step(plain)
            step(sharded)
        diffs, plain_s = [], []
        for _ in range(pairs):
            t0 = CLOCK()
            step(plain)
            t1 = CLOCK()
            step(sharded)
            t2 = CLOCK()
            diffs.append((t2 - t1) - (t1 - t0))
            plain_s.append(t1 - t0)
        _mute_sharding_propagation()  # counted as the tracer counts (after timing: it wraps a method)
        with CountCalls():
            step(sharded)
    finally:
        if started:
            dist.destroy_process_group()
    calls = CountCalls.calls
    q = statistics.quantiles(diffs, n=4)
    return {
        "dtensor_call_us": max(0.0, statistics.median(diffs) / calls * 1e6),
        "q25_us": q[0] / calls * 1e6, "q75_us": q[2] / calls * 1e6,
        "calls_per_step": calls, "plain_step_ms": statistics.median(plain_s) * 1e3, "pairs": pairs,
        "reference": {**REFERENCE, "micro_batch": MICRO_BATCH, "tp_plans": "echo.training.tensor_parallel"},
        "method": METHOD, "clock": "thread CPU time", "torch": torch.__version__,
    }


def dtensor_call_us(cache_dir: Path | None) -> dict:
    """The per-call overhead (``dtensor_call_us``) with its provenance: cached for this CPU,
    torch version and method, else measured now in fresh interpreters (and cached)."""
    from echo.profile import cache

    return cache.measured_once(cache_dir, FILE, METHOD, _measure_in_processes)


def _measure_in_processes() -> dict:
    """``PROCESSES`` fresh interpreters one after the other; the middle one's figures."""
    from echo import launch

    runs = []
    for _ in range(PROCESSES):
        proc = launch.run("echo.profile.host")
        if proc.returncode:
            raise RuntimeError(f"measuring DTensor's host overhead failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    middle = sorted(runs, key=lambda r: r["dtensor_call_us"])[len(runs) // 2]
    return {**middle, "processes": [r["dtensor_call_us"] for r in runs]}


if __name__ == "__main__":
    print(json.dumps(measure_dtensor_call_us()))
