"""How much slower a real eager training step runs on this CPU than the replay of its kernels.

Why it matters here: the profile stage's kernel times come from replaying the trace's ops one by
one (``inloop``). A real eager step runs the same kernels inside nn.Module calls and the autograd
engine: the engine's own work, gradient accumulation into ``.grad`` (not a traced op), allocation
of every output and saved activation, and whatever those do to the caches. On the development
machine a plain GPT micro-batch ran 5-7% slower eager than replayed, alone; with a second rank
busy on the other core (the caches and memory bus are shared) another 1-3% (``colocated``).
Both apply only where kernels run on the dispatching thread (``Hardware.host_synchronous``);
GPU targets are modelled.

What is measured: the reference chunk ``REFERENCE`` (a GPT shaped like none of the shipped
workloads, so that the validation runs do not fit their own correction), as a one-rank workload:

- predicted: traced (``echo.trace.step.trace_rank``), its kernels replayed as the profile stage
  replays them (``inloop.replay_in_processes``), summed over one micro-batch's forward and
  backward;
- eager: the measure stage's own training loop (``echo.training.run.Rank``, gloo world of one)
  in one fresh interpreter per core at the measure stage's priority, forward and backward spans
  timed with the thread's CPU clock for ``DURATION_S``: each process alone (the others idle),
  then all side by side.

``eager_op_us`` = (median eager micro-batch alone - predicted) / the micro-batch's traced kernels:
the engine's work is per op (a node to build, a gradient to route, an output to allocate), so it
is charged per kernel, like DTensor's dispatch (``host``); a proportional factor fitted on the
reference over-predicted a larger model's eager step (the tiny workloads' GPT: +6%), the per-op
charge did not (within 1%). ``colocated[n]``: the median over processes of their side-by-side /
alone time (shared caches and memory bandwidth slow every kernel in proportion), measured for n
= cores and interpolated linearly in between.
``step_overheads(cache_dir)`` returns them with their provenance, measured once per CPU model,
torch version and method and cached in ``{cache_dir}/eager_step.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHOD = "eager-step-vs-inloop-replay/reference-gpt/thread-cpu/alone-then-side-by-side/v2"
FILE = "eager_step.json"
REFERENCE = dict(arch="gpt", layers=2, hidden=192, heads=6, vocab=2048, seq_len=96)
MICRO_BATCH = 2
MICRO_BATCHES = 4      # gradient accumulation, as the shipped tiny workloads do
WARMUP_STEPS = 3
DURATION_S = 4.0       # timed per run of a process (alone, then side by side)
PRIORITY = "rt"        # as the measure stage runs its ranks (echo.validate.measure.PRIORITY)
_REPLY = "echo-eager: "  # marks a reference process's figures on its stdout
PROCESS_START_S = 60.0  # a reference process that has not exited by then is killed
ATTEMPTS = 3           # replay-then-eager pairs measured before a drifted machine is given up on


def reference_workload():
    from echo.config.workload import Workload

    return Workload.model_validate({
        "name": "eager-reference", "description": "reference chunk of echo.profile.eager",
        "model": REFERENCE,
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, "schedule": "1f1b"},
        "training": {"global_batch": MICRO_BATCH * MICRO_BATCHES, "micro_batch": MICRO_BATCH,
                     "dtype": "fp32", "recompute": "none"},
    })


def cores() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def colocated_ranks(world_size: int) -> int:
    """How many ranks of a local run are busy on this machine's cores at once."""
    return max(1, min(world_size, cores()))


def colocation_factor(measured: dict, ranks_on_host: int) -> float:
    """How much slower kernels run with ``ranks_on_host`` ranks busy on this CPU than alone."""
    n = min(max(1, ranks_on_host), max(int(k) for k in measured["colocated"]))
    return measured["colocated"][str(n)]


def step_overheads(cache_dir: Path | None) -> dict:
    """``eager_op_us`` and ``colocated`` with their provenance: cached for this CPU, torch
    version and method, else measured now (and cached)."""
    from echo.profile import cache

    return cache.measured_once(cache_dir, FILE, METHOD, measure)


def measure() -> dict:
    """Trace and replay the reference, then time it eager alone and side by side.

    An eager micro-batch runs every replayed kernel and the engine's work besides, so eager alone
    below the replay can only mean the machine changed speed between the two (this 2-core VM
    drifts by up to half, idle): the pair is measured again, up to ``ATTEMPTS`` times, and if
    it never orders itself the charge is 0 and ``drifted`` says so."""
    from echo.profile import inloop

    n = cores()
    with tempfile.TemporaryDirectory(prefix="echo-eager-") as tmp:
        trace_dir = Path(tmp) / "trace"
        _child(["trace", str(trace_dir)])
        from echo.artifacts import OPS
        from echo.io import read_parquet

        ops = [o for o in read_parquet(trace_dir / "ops.parquet", OPS).to_pylist()
               if o["kind"] in inloop.REPLAYED_KINDS and o["phase"] in ("forward", "backward")]
        tries = []
        for _ in range(ATTEMPTS):
            times = inloop.replay_in_processes(trace_dir, {o["kernel_key"] for o in ops})
            missing = sorted({o["name"] for o in ops if o["kernel_key"] not in times})
            if missing:
                raise RuntimeError(f"eager step measurement: reference kernels not replayed: {missing}")
            predicted_ms = sum(times[o["kernel_key"]] for o in ops) / 1e3
            eager = _eager_runs(n)
            alone = statistics.median(eager["alone"])
            tries.append({"predicted_ms": predicted_ms, "eager_alone_ms": alone})
            if alone > predicted_ms:
                break
    slowdown = statistics.median(b / a for a, b in zip(eager["alone"], eager["side_by_side"], strict=True))
    return {
        "eager_op_us": max(0.0, (alone - predicted_ms) * 1e3 / len(ops)), "kernels_per_microbatch": len(ops),
        "drifted": alone <= predicted_ms, "attempts": tries,
        # side by side with n ranks; fewer than n share the caches and bus with fewer: interpolated
        "colocated": {str(k): 1.0 + (slowdown - 1.0) * (k - 1) / max(1, n - 1) for k in range(1, n + 1)},
        "predicted_ms": predicted_ms, "eager_ms": eager,
        "reference": {**REFERENCE, "micro_batch": MICRO_BATCH, "micro_batches": MICRO_BATCHES},
        "method": METHOD, "clock": "thread CPU time", "duration_s": DURATION_S, "priority": PRIORITY,
        "torch": _torch_version(),
    }


def _eager_runs(n: int) -> dict[str, list[float]]:
    """Median eager micro-batch (ms) of each of ``n`` reference processes, each timed alone (the
    others idle) and then all side by side: a process's two figures share its heap and memory
    layout, which moved a process's time by up to 5% against another's."""
    from echo import launch

    procs = [launch.start("echo.profile.eager", "eager", launch.free_port(), priority=PRIORITY, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(n)]
    try:
        for p in procs:
            _reply(p)  # ready: built and warmed up
        alone = []
        for p in procs:
            p.stdin.write("run\n")
            p.stdin.flush()
            alone.append(_reply(p))
        for p in procs:
            p.stdin.write("run\n")
            p.stdin.flush()
        together = [_reply(p) for p in procs]
        for p in procs:
            p.stdin.write("exit\n")
            p.stdin.flush()
            p.wait(timeout=PROCESS_START_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {"alone": alone, "side_by_side": together}


def _reply(p: subprocess.Popen) -> float:
    """The next figure the process reports (other output on its stdout is skipped)."""
    for line in p.stdout:
        if line.startswith(_REPLY):
            return json.loads(line[len(_REPLY):])["median_ms"]
    raise RuntimeError(f"eager step measurement: a reference process failed:\n{p.stderr.read()[-3000:]}")


def _child(args: list[str]) -> None:
    from echo import launch

    proc = launch.run("echo.profile.eager", *args)
    if proc.returncode:
        raise RuntimeError(f"eager step measurement ({args[0]}) failed:\n{proc.stderr[-3000:]}")


def _torch_version() -> str:
    import torch

    return torch.__version__


def _trace_main(out_dir: str) -> None:
    from echo.io import write_parquet
    from echo.trace.step import trace_rank

    tables = trace_rank(reference_workload(), 0)
    for name in ("ops", "deps"):
        write_parquet(tables[name], Path(out_dir) / f"{name}.parquet")


def _eager_main(port: str) -> None:
    """A reference rank that times ``DURATION_S`` of training each time it reads ``run``."""
    import torch
    import torch.distributed as dist

    from echo.training.run import Rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        r = Rank(reference_workload(), 0)
        for _ in range(WARMUP_STEPS):
            r.step()
        print(_REPLY + json.dumps({"median_ms": 0.0}), flush=True)
        while sys.stdin.readline().strip() == "run":
            r.clock.rows.clear()
            r.clock.iteration, end = 0, time.perf_counter() + DURATION_S
            while time.perf_counter() < end:
                r.step()
                r.clock.iteration += 1
            per_mb = [sum(e["cpu_s"] for e in r.clock.rows if e["kind"] in ("forward", "backward")
                          and e["microbatch"] == mb and e["iteration"] == it) * 1e3
                      for it in range(r.clock.iteration) for mb in range(MICRO_BATCHES)]
            print(_REPLY + json.dumps({"median_ms": statistics.median(per_mb), "samples": len(per_mb)}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    {"trace": _trace_main, "eager": _eager_main}[sys.argv[1]](*sys.argv[2:])
