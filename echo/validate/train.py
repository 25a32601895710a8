"""One rank of a real training run on this CPU: ``python -m echo.validate.train SPEC_JSON RANK``.

The same job the tracer records, run for real with torch.distributed over gloo: the reference
model (``echo.trace.model.ModelChunk``, built by the tracer's own chunk builder) for this rank's
pipeline stage,
tensor-parallel with the tracer's own DTensor plans (``apply_tensor_parallel``) over a real
DeviceMesh, the pipeline schedule of the simulator (``echo.simulate.schedule.stage_orders``)
with real sends and receives, and Megatron-style data parallelism as ``echo.trace.data_parallel``
records it: gradients accumulate in place into flat fp32 buckets (the tracer's bucket sizing),
which are all-reduced (ZeRO 0) or reduce-scattered (ZeRO 1/2) after the last backward, then
fused AdamW updates the local shard and ZeRO 1/2 all-gathers the parameters.

Each step starts after a barrier; every task (forward, backward, the waits for pipeline
receives and sends, gradient reduction, optimizer) is timed with the monotonic clock, which all
processes of this machine share, so the launcher can line the ranks up. After the timed steps
one more step runs under ``torch.profiler`` to split each phase into operator time, collective
time and the rest (Python, autograd, DTensor dispatch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from echo.config.workload import Workload
from echo.trace.data_parallel import BUCKET_ELEMENTS, buckets
from echo.trace.layout import Layout
from echo.trace.tensor_parallel import apply_tensor_parallel

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ADAMW = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

EVENTS = pa.schema([
    ("rank", pa.int32()), ("iteration", pa.int32()), ("profiled", pa.bool_()),
    ("kind", pa.string()),      # step | forward | backward | recv | send_wait | zero_grad | grad_sync | optimizer
    ("microbatch", pa.int32()), ("chunk", pa.int32()),
    ("start_s", pa.float64()), ("end_s", pa.float64()),  # time.perf_counter (CLOCK_MONOTONIC, machine-wide)
    ("cpu_s", pa.float64()),    # CPU time of the rank's main thread during the interval
    ("process_cpu_s", pa.float64()),  # CPU time of the whole process (gloo's threads too)
    ("run_delay_s", pa.float64()),  # step rows: time the main thread waited for a CPU while
                                    # runnable (/proc schedstat), i.e. taken by other work
])
PROFILE = pa.schema([
    ("rank", pa.int32()), ("phase", pa.string()),   # forward | backward | grad_sync | optimizer | ...
    ("category", pa.string()),                      # op | comm
    ("time_s", pa.float64()), ("calls", pa.int64()),
])
_COMM_MARKERS = ("c10d", "gloo", "wait_tensor", "nccl", "all_reduce", "allreduce", "all_gather",
                 "allgather", "reduce_scatter", "send", "recv", "barrier")


# --- process groups and model ---------------------------------------------------------------


def make_groups(layout: Layout, rank: int) -> dict[str, dist.ProcessGroup | None]:
    """This rank's tp/cp/dp/pp groups. Real process groups must be created by every rank in the
    same order, so every group of every dimension is created here (the tracer, under the fake
    process group, creates only its own)."""
    out: dict[str, dist.ProcessGroup | None] = {}
    for dim in ("tp", "cp", "dp", "pp"):
        out[dim] = None
        for ranks in layout.all_groups(dim):
            if len(ranks) < 2:
                continue
            group = dist.new_group(ranks)
            if rank in ranks:
                out[dim] = group
    return out


class _NoRecorder:
    """What the tracer's chunk builder asks of its recorder: a context for recomputed ops."""

    recompute = staticmethod(nullcontext)


def build_chunks(w: Workload, pp_rank: int) -> list[nn.Module]:
    """This stage's model chunks, built by the tracer's own builder (echo.trace.step)."""
    from echo.trace.step import _chunks

    return _chunks(w, pp_rank, _NoRecorder())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


# --- data parallelism: flat buckets, reduction, fused AdamW ----------------------------------


def bucket_members(numels: list[int], dp: int) -> list[list[int]]:
    """Parameter indices of each bucket, filled in backward order exactly as
    ``echo.trace.data_parallel.buckets`` sizes them."""
    limit = max(BUCKET_ELEMENTS, 1_000_000 * dp)
    members, current, total = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        total += numels[i]
        if total >= limit:
            members.append(current)
            current, total = [], 0
    if current:
        members.append(current)
    return members


@dataclass
class _Bucket:
    grad: torch.Tensor                 # fp32, the gradients of its parameters, in place
    param: torch.Tensor                # compute dtype, the parameters, in place
    master: torch.Tensor               # fp32 master weights (the param buffer itself when fp32)
    shard: slice                       # this rank's part of the optimizer update
    exp_avg: torch.Tensor = field(default=None)  # type: ignore[assignment]
    exp_avg_sq: torch.Tensor = field(default=None)  # type: ignore[assignment]
    step: torch.Tensor = field(default=None)  # type: ignore[assignment]


class DataParallel:
    """Megatron-LM's DDP + distributed optimizer on flat buffers (echo.trace.data_parallel)."""

    def __init__(self, chunks: list[nn.Module], dp_group, dp: int, dp_rank: int, zero: int, dtype: torch.dtype):
        if zero > 2:
            raise ValueError("ZeRO 3 is not run by the measure stage yet")
        self.group, self.dp, self.zero, self.dtype = dp_group, dp, zero, dtype
        params = [p for c in chunks for p in c.parameters()]
        numels = [_local(p).numel() for p in params]
        sizes = buckets(numels, dp)
        members = bucket_members(numels, dp)
        self.buckets: list[_Bucket] = []
        # fp32 gradients can be the parameters' own .grad (accumulated in place by autograd);
        # other dtypes keep .grad in the compute dtype and are copied into the fp32 bucket
        self.in_place = dtype == torch.float32
        self.copies: list[tuple[torch.Tensor, nn.Parameter]] = []
        for size, idx in zip(sizes, members, strict=True):
            if size != -(-sum(numels[i] for i in idx) // dp) * dp:
                raise AssertionError("bucket assignment disagrees with echo.trace.data_parallel.buckets")
            grad = torch.zeros(size, dtype=torch.float32)
            param = torch.zeros(size, dtype=dtype)
            off = 0
            with torch.no_grad():
                for i in idx:
                    p, n = params[i], numels[i]
                    local = _local(p)
                    view = param[off:off + n].view_as(local)
                    view.copy_(local)
                    local.data = view  # the parameter now lives in the flat buffer
                    gview = grad[off:off + n].view_as(local)
                    if self.in_place:
                        p.grad = (DTensor.from_local(gview, p.device_mesh, p.placements, run_check=False)
                                  if isinstance(p, DTensor) else gview)
                    else:
                        self.copies.append((gview, p))
                    off += n
            master = param if dtype == torch.float32 else param.float()
            shard_len = size // dp if zero >= 1 else size
            start = dp_rank * shard_len if zero >= 1 else 0
            b = _Bucket(grad=grad, param=param, master=master, shard=slice(start, start + shard_len))
            b.exp_avg = torch.zeros(shard_len)
            b.exp_avg_sq = torch.zeros(shard_len)
            b.step = torch.zeros((), dtype=torch.float32)
            self.buckets.append(b)
        self.params = params

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad.zero_()
        if not self.in_place:
            for p in self.params:
                p.grad = None

    def grad_sync(self) -> None:
        """Reduce each bucket over dp, in bucket order (as the trace records grad_sync)."""
        for gview, p in self.copies:
            gview.copy_(_local(p.grad))
        if self.dp < 2:
            return
        for b in self.buckets:
            if self.zero == 0:
                dist.all_reduce(b.grad, group=self.group)
            else:
                out = b.grad[b.shard]
                dist.reduce_scatter_single(out, b.grad, group=self.group)

    def step(self) -> None:
        """Fused AdamW on the local shards, then (ZeRO 1/2) all-gather the parameters."""
        shards = [(b.master[b.shard], b.grad[b.shard], b.exp_avg, b.exp_avg_sq, b.step) for b in self.buckets]
        params, grads, m, v, steps = (list(x) for x in zip(*shards, strict=True))
        torch._foreach_add_(steps, 1.0)
        torch._fused_adamw_(params, grads, m, v, [], steps, **ADAMW)
        for b in self.buckets:
            if self.dtype != torch.float32:
                half = b.master[b.shard].to(self.dtype)
                if self.zero == 0 or self.dp < 2:
                    b.param.copy_(half)
            else:
                half = b.param[b.shard]
            if self.dp > 1 and self.zero >= 1:  # in place for fp32, as Megatron's param buffer
                dist.all_gather_single(b.param, half, group=self.group)


# --- the pipeline --------------------------------------------------------------------------


def run_delay_s() -> float | None:
    """Seconds this rank's main thread has spent runnable but waiting for a CPU (the second field
    of /proc/thread-self/schedstat), or None where the kernel does not say. (gloo's own threads
    are left out: they wait for the cores the main threads of the ranks keep busy, by design.)"""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class Clock:
    """Every timed interval of this rank."""

    def __init__(self, rank: int):
        self.rank = rank
        self.rows: list[dict] = []
        self.iteration, self.profiled = -1, False

    @contextmanager
    def span(self, kind: str, microbatch: int = -1, chunk: int = -1) -> Iterator[None]:
        label = torch.autograd.profiler.record_function(f"echo:{kind}") if self.profiled else nullcontext()
        step = kind == "step"
        with label:
            d0 = run_delay_s() if step else None
            c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            yield
            t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
            d1 = run_delay_s() if step else None
        self.rows.append({"rank": self.rank, "iteration": self.iteration, "profiled": self.profiled, "kind": kind,
                          "microbatch": microbatch, "chunk": chunk, "start_s": t0, "end_s": t1,
                          "cpu_s": c1 - c0, "process_cpu_s": p1 - p0,
                          "run_delay_s": d1 - d0 if d0 is not None and d1 is not None else None})


class Rank:
    """One rank's model, data and schedule; ``step()`` runs one training iteration."""

    def __init__(self, w: Workload, rank: int, seed: int = 1234):
        from echo.simulate.schedule import stage_orders

        self.w, self.rank, self.layout = w, rank, Layout(w.parallel)
        p, t = w.parallel, w.training
        self.coords = self.layout.coords(rank)
        self.dtype = DTYPES[t.dtype]
        self.groups = make_groups(self.layout, rank)
        torch.manual_seed(seed + self.coords.pp)  # tensor-parallel peers start from the same weights
        torch.set_default_dtype(self.dtype)
        self.chunks = build_chunks(w, self.coords.pp)
        if p.tp > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(self.groups["tp"], "cpu")
            for c in self.chunks:
                if p.sequence_parallel:
                    apply_tensor_parallel(c, mesh, True)
                else:
                    apply_tensor_parallel(c, mesh)
        self.dp = DataParallel(self.chunks, self.groups["dp"], p.dp, self.coords.dp, p.zero, self.dtype)
        self.order = stage_orders(p.schedule, p.pp, w.micro_batches, p.virtual_stages)[self.coords.pp]
        b, s = t.micro_batch, w.model.seq_len
        gen = torch.Generator().manual_seed(seed + 7 * self.coords.dp)  # dp replicas read other data
        self.tokens = [torch.randint(0, w.model.vocab, (b, s), generator=gen) for _ in range(w.micro_batches)]
        self.labels = [torch.randint(0, w.model.vocab, (b, s), generator=gen) for _ in range(w.micro_batches)]
        self.clock = Clock(rank)
        self.losses: list[float] = []

    # virtual stage k = chunk * pp + stage (Megatron-LM's interleaved layout, as schedule.py)
    def _virtual(self, chunk: int) -> int:
        return chunk * self.w.parallel.pp + self.coords.pp

    def _peer(self, k: int) -> int:
        """The rank running virtual stage k with this rank's tp/cp/dp coordinates."""
        pp = self.w.parallel.pp
        return self.layout.stage_peer(self.rank, k % pp - self.coords.pp)

    def _tag(self, direction: int, microbatch: int, k: int) -> int:
        """A message's tag: its direction, micro-batch and sending virtual stage (several kinds of
        message share a pair of ranks once the schedule interleaves)."""
        return (microbatch * self.w.parallel.pp * self.w.parallel.virtual_stages + k) * 2 + direction

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, DTensor):
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def _activation_shape(self) -> tuple[int, int, int]:
        p, m = self.w.parallel, self.w.model
        s = m.seq_len // (p.tp if p.sequence_parallel else 1)
        return (self.w.training.micro_batch, s, m.hidden)

    def step(self) -> None:
        p = self.w.parallel
        last_k = p.pp * p.virtual_stages - 1
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        sends: list = []
        with self.clock.span("step"):
            with self.clock.span("zero_grad"):
                self.dp.zero_grad()
            for task in self.order:
                k, mb, c = self._virtual(task.chunk), task.microbatch, task.chunk
                if task.kind == "F":
                    if k == 0:
                        x = self.tokens[mb]
                    else:
                        x = torch.empty(self._activation_shape(), dtype=self.dtype)
                        with self.clock.span("recv", mb, c):
                            dist.recv(x, src=self._peer(k - 1), tag=self._tag(0, mb, k - 1))
                        x.requires_grad_(True)
                    with self.clock.span("forward", mb, c):
                        y = self.chunks[c](x)
                        if k == last_k:
                            y = self._loss(y, self.labels[mb])
                    if k == last_k:
                        self.losses.append(float(y.detach()))
                    else:
                        out = y.detach()
                        sends.append((dist.isend(out, dst=self._peer(k + 1), tag=self._tag(0, mb, k)), out))
                    held[(mb, c)] = (x, y)
                else:
                    x, y = held.pop((mb, c))
                    if k == last_k:
                        from torch.distributed.tensor.parallel import loss_parallel

                        ctx = loss_parallel() if p.tp > 1 else nullcontext()
                        with self.clock.span("backward", mb, c), ctx:
                            y.backward()
                    else:
                        grad = torch.empty_like(y)
                        with self.clock.span("recv", mb, c):
                            dist.recv(grad, src=self._peer(k + 1), tag=self._tag(1, mb, k + 1))
                        with self.clock.span("backward", mb, c):
                            y.backward(grad)
                    if k > 0:
                        g = x.grad
                        sends.append((dist.isend(g, dst=self._peer(k - 1), tag=self._tag(1, mb, k)), g))
            with self.clock.span("send_wait"):
                for work, _ in sends:
                    work.wait()
            with self.clock.span("grad_sync"):
                self.dp.grad_sync()
            with self.clock.span("optimizer"):
                self.dp.step()


# --- profiler --------------------------------------------------------------------------------


def _is_comm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in _COMM_MARKERS)


def profile_breakdown(events, rank: int) -> list[dict]:
    """Per phase (the ``echo:<kind>`` range around it): time in top-level operators (aten ops not
    inside another aten op) and in collectives, from one profiled step."""
    out: dict[tuple[str, str], list[float]] = {}
    for ev in events:
        name = ev.name
        comm = _is_comm(name)
        if not (comm or name.startswith("aten::")):
            continue
        phase, parent, nested = None, ev.cpu_parent, False
        while parent is not None:
            pname = parent.name
            if pname.startswith("echo:"):
                phase = phase or pname[5:]
                break
            if _is_comm(pname) or (not comm and pname.startswith("aten::")):
                nested = True
                break
            parent = parent.cpu_parent
        if nested or phase is None:
            continue
        acc = out.setdefault((phase, "comm" if comm else "op"), [0.0, 0])
        acc[0] += ev.time_range.elapsed_us() / 1e6
        acc[1] += 1
    return [{"rank": rank, "phase": ph, "category": cat, "time_s": t, "calls": int(n)}
            for (ph, cat), (t, n) in sorted(out.items())]


# --- entry point -----------------------------------------------------------------------------


def scheduling() -> str:
    """How this process is scheduled: rt (a real-time class), nice (negative niceness) or none."""
    try:
        if os.sched_getscheduler(0) in (os.SCHED_RR, os.SCHED_FIFO):
            return "rt"
        return "nice" if os.getpriority(os.PRIO_PROCESS, 0) < 0 else "none"
    except (OSError, AttributeError):
        return "none"


def run_rank(spec: dict, rank: int) -> None:
    torch.set_num_threads(1)  # as the profile stage times kernels; one core per rank
    w = Workload.model_validate(spec["workload"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=w.world_size)
    out = Path(spec["out_dir"])
    try:
        r = Rank(w, rank)
        for i in range(spec["warmup"] + spec["iters"]):
            r.clock.iteration = i - spec["warmup"]
            dist.barrier()
            r.step()
        prof_rows: list[dict] = []
        if spec.get("profile", True):
            from torch.profiler import ProfilerActivity, profile

            r.clock.iteration, r.clock.profiled = spec["iters"], True
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                r.step()
            prof_rows = profile_breakdown(prof.events(), rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _write(pa.Table.from_pylist(r.clock.rows, schema=EVENTS), out / f"events{rank}.arrow")
    _write(pa.Table.from_pylist(prof_rows, schema=PROFILE), out / f"profile{rank}.arrow")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "losses": r.losses, "threads": torch.get_num_threads(), "scheduling": scheduling(),
        "param_checksum": float(sum(_local(p).detach().double().sum() for p in r.dp.params)),
    }))


def _write(table: pa.Table, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


if __name__ == "__main__":
    run_rank(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))
