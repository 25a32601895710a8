"""One rank of a real training run on this CPU: ``python -m echo.training.run RANK SPEC_JSON``.

The same job the tracer records, run for real with torch.distributed over gloo: the reference
model chunks of this rank's pipeline stage (``echo.training.model.build_chunks``), tensor-parallel
with the same DTensor plans (``apply_tensor_parallel``) over a real DeviceMesh, the pipeline
schedule the simulator runs (``echo.training.schedule.stage_orders``) with real sends and
receives, and the data parallelism the tracer records (``echo.training.data_parallel``, with the
parameters and gradients bound into its flat fp32 buckets).

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
from pathlib import Path

import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from echo.config.workload import Workload
from echo.training.data_parallel import DataParallel, local_tensor
from echo.training.layout import Layout
from echo.training.model import DTYPES, build_chunks
from echo.training.schedule import stage_orders
from echo.training.tensor_parallel import apply_tensor_parallel

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
    out["world"] = dist.group.WORLD if layout.world_size > 1 else None  # the gradient norm's all-reduce
    return out


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
        self.dp = DataParallel(self.chunks, self.groups, p, self.dtype, bind=True, dp_rank=self.coords.dp)
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
        "param_checksum": float(sum(local_tensor(p).detach().double().sum() for c in r.chunks for p in c.parameters())),
    }))


def _write(table: pa.Table, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(tmp, path)


if __name__ == "__main__":
    run_rank(json.loads(sys.argv[2]), int(sys.argv[1]))  # started by echo.launch.launch
