"""Kernels timed the way a training loop runs them, on this CPU: in-order replay of traced tasks.

``measure`` times each distinct kernel alone: the same call many times back to back on the same
inputs, its fastest window kept. Inside a training step the same kernels run slower (on this
CPU 1.0-1.3x for GEMMs, up to 2-4x for small reductions, norms, copies and embeddings): every op
comes after other ops that evicted its weights and saved activations from the caches, and
writes fresh outputs the allocator hands out.

``replay_times`` re-creates that: it replays every traced task (the compute and memcpy ops of
one rank's forward, backward, recompute, ... of one chunk) in recorded order, each op on
inputs rebuilt once for the task, except that a floating-point input the trace says an earlier
op of the same task produced (``deps.parquet``, matched by dtype and element count) is that
op's output from the same replay, as in the loop. Activations saved by forward and used in
backward are separate tasks' and stay rebuilt (cold), as in the loop. Each op is timed with the
thread's CPU clock (as ``measure``: time preempted by other processes does not count); a task
is replayed ``REPEATS`` times per window and ``WINDOWS`` windows spread over the run; an op's
time is the median over windows of its median over repeats, and a kernel's the mean over its
occurrences. Typical, not best: a real step runs at the loop's typical pace (the best of four
windows and two processes came out 2-3% under the median replay, and the tiny workloads' real
steps were under-predicted by as much); the median still ignores a window that a neighbour
streaming memory for a few seconds slowed.

The profile stage replays in ``PROCESSES`` fresh interpreters (``replay_in_processes``) and takes
each kernel's mean over them: a process's heap and memory layout (what the timing before it left
behind, where its buffers landed in the caches) moved class totals by up to 25% between replays
in one process, against under 10% between fresh ones, and a real run's process has a layout of
its own.

Single calls of microsecond kernels are too noisy to use one by one (two replays on a busy
2-core machine agree within 10% for only ~80% of the kernels, while their sums agree within
1-2%), so the profile stage uses them as a correction of the isolated timings: per op class,
the ratio of replayed to isolated time summed over the trace's kernels (``inloop_factors``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from echo import launch
from echo.profile import rebuild

METHOD = "inloop-replay/thread-cpu-time/chained/median-windows/mean-of-processes/v3"  # cache identity of replayed timings
CLOCK = time.thread_time
REPEATS = 5            # replays of a task per window (after one warm-up replay)
WINDOWS = 4            # windows per task, spread over the run
PROCESSES = 2          # fresh interpreters the profile stage replays in (each kernel: their mean)
MAX_TASK_BYTES = 2 * 2**30  # a task whose rebuilt inputs and outputs would exceed this is not replayed
REPLAYED_KINDS = ("compute", "memcpy")
# Op classes whose replayed time is summed with the others' when it is too small to be a
# stable ratio on its own (below MIN_CLASS_US of isolated time in the trace).
MIN_CLASS_US = 500.0


@dataclass
class _Op:
    key: str
    seq: int
    call: rebuild.Call
    args: rebuild.Args
    sources: list[int]            # seqs of earlier ops of the task whose outputs it reads
    chained: bool = True          # False once a chained call failed: it runs on its own inputs
    broken: bool = False          # fails on its own inputs too: not replayed
    samples: list[float] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)


def tasks_of(ops: Iterable[dict]) -> dict[tuple[int, str, int], list[dict]]:
    """(rank, phase, chunk) -> that task's compute and memcpy op rows in recorded order."""
    tasks: dict[tuple[int, str, int], list[dict]] = defaultdict(list)
    for o in sorted(ops, key=lambda o: (o["rank"], o["seq"])):
        if o["kind"] in REPLAYED_KINDS:
            tasks[(o["rank"], o["phase"], o["chunk"])].append(o)
    return tasks


def replay_times(ops: list[dict], deps: list[dict], wanted: set[str] | None = None,
                 repeats: int = REPEATS, windows: int = WINDOWS) -> dict[str, float]:
    """kernel_key -> in-loop microseconds, from replaying every task that has a ``wanted`` kernel
    (default: all). Kernels that cannot be rebuilt are left out."""
    producers: dict[tuple[int, int], list[int]] = defaultdict(list)
    for d in deps:
        if d["kind"] == "data":
            producers[(d["rank"], d["dst"])].append(d["src"])
    tasks = [rows for rows in tasks_of(ops).values() if wanted is None or any(o["kernel_key"] in wanted for o in rows)]
    built = [b for b in (_build(rows, producers) for rows in tasks) if b]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        with torch.no_grad():
            for _ in range(windows):
                for task in built:
                    _replay(task, repeats)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)
    per_key: dict[str, list[float]] = defaultdict(list)
    for task in built:
        for op in task:
            if op.windows and not op.broken:
                per_key[op.key].append(statistics.median(op.windows) * 1e6)
    return {k: sum(v) / len(v) for k, v in per_key.items()}


def replay_in_processes(trace_dir, wanted: set[str], processes: int = PROCESSES) -> dict[str, float]:
    """``replay_times`` of the trace in ``trace_dir`` (ops.parquet, deps.parquet) in ``processes``
    fresh interpreters, one after the other; per kernel the mean of their results."""
    runs: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="echo-inloop-") as tmp:
        spec = os.path.join(tmp, "wanted.json")
        with open(spec, "w") as fh:
            json.dump(sorted(wanted), fh)
        for i in range(processes):
            out = os.path.join(tmp, f"times{i}.json")
            proc = launch.run("echo.profile.inloop", trace_dir, spec, out)
            if proc.returncode:
                raise RuntimeError(f"in-loop replay of {trace_dir} failed:\n{proc.stderr[-3000:]}")
            with open(out) as fh:
                for key, us in json.load(fh).items():
                    runs[key].append(us)
    return {key: statistics.fmean(us) for key, us in runs.items()}


def _main(trace_dir: str, wanted_json: str, out_json: str) -> None:
    from echo.artifacts import DEPS, OPS
    from echo.io import read_parquet

    ops = read_parquet(os.path.join(trace_dir, "ops.parquet"), OPS).to_pylist()
    deps_path = os.path.join(trace_dir, "deps.parquet")
    deps = read_parquet(deps_path, DEPS).to_pylist() if os.path.isfile(deps_path) else []
    with open(wanted_json) as fh:
        wanted = set(json.load(fh))
    times = replay_times(ops, deps, wanted)
    with open(out_json, "w") as fh:
        json.dump({k: v for k, v in times.items() if k in wanted}, fh)


def _build(rows: list[dict], producers: dict[tuple[int, int], list[int]]) -> list[_Op]:
    out, total = [], 0
    in_task = {o["seq"] for o in rows}
    for o in rows:
        try:
            call = rebuild.build(o["name"], o["args"])
        except rebuild.Unbuildable:
            continue
        total += call.input_bytes + o["bytes"]
        if total > MAX_TASK_BYTES:
            return []
        srcs = [s for s in producers.get((o["rank"], o["seq"]), []) if s in in_task and s < o["seq"]]
        out.append(_Op(o["kernel_key"], o["seq"], call, call.make_args(), srcs))
    return out


def _replay(task: list[_Op], repeats: int) -> None:
    """One window: a warm-up replay, then ``repeats`` timed ones; each op's median is kept. An op
    that fails on its own rebuilt inputs (the isolated timing falls back to the model for it too)
    is dropped from the task."""
    for op in task:
        op.samples = []
    for rep in range(repeats + 1):
        outputs: dict[int, list[torch.Tensor]] = {}
        for op in task:
            if op.broken:
                continue
            own = op.call.make_args() if op.call.mutates else op.args
            args = _chain(own, [t for s in op.sources for t in outputs.get(s, ())]) if op.chained and op.sources else own
            try:
                t0 = CLOCK()
                out = op.call(args)
                t1 = CLOCK()
            except Exception:  # noqa: BLE001 - chained inputs it does not take: its own from now on
                if args is own:
                    op.broken = True
                    continue
                op.chained = False
                try:
                    t0 = CLOCK()
                    out = op.call(own)
                    t1 = CLOCK()
                except Exception:  # noqa: BLE001
                    op.broken = True
                    continue
            if rep:
                op.samples.append(t1 - t0)
            outputs[op.seq] = _tensors(out)
    for op in task:
        if op.samples and not op.broken:
            op.windows.append(statistics.median(op.samples))


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []


def _chain(args: rebuild.Args, produced: list[torch.Tensor]) -> rebuild.Args:
    """``args`` with each floating-point tensor replaced by a produced tensor of the same dtype and
    element count (reshaped; exact shapes first), each produced tensor used once."""
    pool = [t for t in produced if t.dtype.is_floating_point]
    if not pool:
        return args

    def pick(t: torch.Tensor) -> torch.Tensor:
        if not t.dtype.is_floating_point:
            return t
        for exact in (True, False):
            for i, c in enumerate(pool):
                if c.dtype == t.dtype and (c.shape == t.shape if exact else c.numel() == t.numel()):
                    pool.pop(i)
                    return c if exact else c.reshape(t.shape)
        return t

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return pick(x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    pos, kw = args
    return [walk(v) for v in pos], {k: walk(v) for k, v in kw.items()}


def inloop_factors(kernels: Iterable, isolated: dict[str, float], replayed: dict[str, float]) -> dict[str, float]:
    """op_class -> (replayed / isolated) time summed over ``kernels`` (each weighted by its
    count) that have both; classes below MIN_CLASS_US of isolated time share one pooled ratio,
    '*' (also the factor of a class nothing was replayed of)."""
    rep: dict[str, float] = defaultdict(float)
    iso: dict[str, float] = defaultdict(float)
    for k in kernels:
        if k.kernel_key in isolated and k.kernel_key in replayed and isolated[k.kernel_key] > 0:
            rep[k.op_class] += k.count * replayed[k.kernel_key]
            iso[k.op_class] += k.count * isolated[k.kernel_key]
    small = [c for c in iso if iso[c] < MIN_CLASS_US]
    pooled_iso = sum(iso[c] for c in small)
    total_iso = sum(iso.values())
    factors = {c: rep[c] / iso[c] for c in iso if c not in small}
    if pooled_iso >= MIN_CLASS_US:
        factors["*"] = sum(rep[c] for c in small) / pooled_iso
    elif total_iso > 0:
        factors["*"] = sum(rep.values()) / total_iso
    else:
        factors["*"] = 1.0
    return factors


if __name__ == "__main__":  # python -m echo.profile.inloop TRACE_DIR WANTED_JSON OUT_JSON (replay_in_processes)
    _main(*sys.argv[1:4])
