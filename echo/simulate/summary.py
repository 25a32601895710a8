"""The summary row: step time and its split, throughput, FLOPs and memory accounting.

FLOPs are counted from the trace, not from a formula: each class's matmul FLOPs per micro-batch
template (forward + backward + recompute, all chunks) times the micro-batches, plus its
once-per-step tasks, times the ranks in the class. tflops_per_gpu divides the executed total
(recompute included, as Megatron-LM reports it) by world size x step time; mfu uses the model
FLOPs (recompute excluded) against the dtype's peak.

compute_s includes what the overlap slowdown added (slowdown_s, the part of compute_s spent
slowed beside communication); host_wait_s is the time the GPU waited for the host to launch its
next op (echo.simulate.program's host clock, ``Hardware.host``); compute_s + exposed_comm_s +
host_wait_s + bubble_s = step_time_s on the critical stage (full mode: the critical stage's
slowest rank).

Memory is per rank (``memory_breakdown``), in named terms:

- state: parameters + gradients + optimizer state (data_parallel.memory_model);
- activations: one micro-batch's saved activations (the tracer's meter, all chunks) times the
  chunk-micro-batches the stage's schedule keeps in flight (in_flight) over the chunks; in a
  zero-bubble order, plus what each W still owed keeps (the inputs of its weight-gradient GEMMs);
- working memory: how far the traced micro-batch's live peak rises above its saved activations
  (the logits and the loss, the gradients of the layer in backward, a recomputed layer, FSDP's
  gathered parameters), once: the peak falls in one micro-batch's pass;
- fragmentation: what PyTorch's caching allocator reserves beyond the live bytes at its peak,
  from the tracer's replay of the micro-batch's allocations through the allocator's rules
  (echo.trace.meter.CachingAllocator);
- framework (outside the activations and state, ``framework_bytes``): the cuBLAS workspace and
  NCCL's per-communicator buffers.

``peak_mem_gib`` is what PyTorch's caching allocator reserves at the peak (state + activations +
working memory + fragmentation: torch.cuda.max_memory_reserved, which torchtitan logs);
``device_mem_gib`` adds the framework terms (NCCL allocates its buffers itself) and decides
``fits``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from echo.simulate import variability
from echo.simulate.engine import EngineResult
from echo.simulate.program import RankCosts
from echo.training.schedule import Task, memory_order, splits_backward

GIB = 1 << 30
EXPOSED_KINDS = ("tp", "cp", "ep", "dp", "edp", "dpcp", "pp")  # columns exposed_{kind}_s; others -> other
HOST = "host"  # the waits for the host's launches (program.py): host_wait_s, not communication


@dataclass(frozen=True)
class ClassInfo:
    """One class of ranks: who represents it, where it sits, what its tasks and memory cost."""

    class_id: int
    representative: int       # the traced rank whose graph the class shares
    stages: tuple[int, ...]   # pipeline stages (pp ranks) its ranks sit on; middle stages share one class
    ranks: int                # how many ranks of the job are in the class, all stages together
    costs: RankCosts
    state_bytes: int = 0      # parameters + gradients + optimizer state, per rank
    activation_bytes: int = 0  # saved for backward by one micro-batch (all chunks of the rank)
    peak_bytes: int = 0       # live peak of the traced micro-batch (saved + working memory); 0: not measured
    reserved_bytes: int = 0   # the caching allocator's reserved peak over that micro-batch (peak + fragmentation)
    communicators: int = 0    # NCCL communicators the rank uses (its collectives' groups, its p2p peers)
    chunk_activation_bytes: tuple[int, ...] = ()  # activation_bytes by chunk; (): spread evenly


@dataclass(frozen=True)
class Flops:
    """Matmul-class FLOPs of one step, all ranks together."""

    executed: float  # recompute included
    model: float     # recompute excluded


def step_flops(classes: Sequence[ClassInfo], micro_batches: int) -> Flops:
    executed = model = 0.0
    for c in classes:
        per_mb = sum(p.flops for p in c.costs.forward + c.costs.backward)
        redo = sum(p.recompute_flops for p in c.costs.forward + c.costs.backward)
        once = c.costs.grad_sync.flops + c.costs.optimizer.flops
        once_redo = c.costs.grad_sync.recompute_flops + c.costs.optimizer.recompute_flops
        executed += c.ranks * (per_mb * micro_batches + once)
        model += c.ranks * ((per_mb - redo) * micro_batches + once - once_redo)
    return Flops(executed=executed, model=model)


# cuBLAS workspace PyTorch allocates per (handle, stream) on Hopper and later: 8 x 4096 KiB
# (CUBLAS_WORKSPACE_CONFIG default ":4096:8", aten/src/ATen/cuda/CublasHandlePool.cpp); one stream runs GEMMs.
CUBLAS_WORKSPACE_BYTES = 8 * 4096 * 1024
# NCCL's buffers per connection of one channel (src/init.cc defaults): Simple 4 MiB (DEFAULT_BUFFSIZE),
# LL128 120 elements x 640 threads x 8 steps x 8 B, LL 8 lines x 512 threads x 8 steps x 16 B.
NCCL_CONNECTION_BYTES = (1 << 22) + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
NCCL_CHANNELS = 16            # channels NCCL opens per communicator on NVLink/IB H100-class nodes (assumed)
NCCL_PEERS_PER_CHANNEL = 2    # ring receive connection + tree/NVLS connection per channel


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's peak memory in named terms (bytes); see the module docstring."""

    state: float
    activations: float
    working: float
    framework: float
    fragmentation: float = 0.0

    @property
    def allocated(self) -> float:
        """Bytes of live tensors at the peak (torch.cuda.max_memory_allocated)."""
        return self.state + self.activations + self.working

    @property
    def allocator(self) -> float:
        """What PyTorch's caching allocator reserves at the peak (torch.cuda.max_memory_reserved)."""
        return self.allocated + self.fragmentation

    @property
    def device(self) -> float:
        return self.allocator + self.framework


def framework_bytes(communicators: int) -> float:
    """cuBLAS workspace plus NCCL's buffers for ``communicators`` communicators."""
    return CUBLAS_WORKSPACE_BYTES + communicators * NCCL_CHANNELS * NCCL_PEERS_PER_CHANNEL * NCCL_CONNECTION_BYTES


def memory_breakdown(c: ClassInfo, order: Sequence[Task]) -> MemoryBreakdown:
    """A rank's peak: its state, the activations of the chunk-micro-batches in flight, the
    working memory of one micro-batch above its saved activations, and the framework's buffers."""
    return rank_breakdown(state=c.state_bytes, activation=c.activation_bytes, peak=c.peak_bytes,
                          reserved=c.reserved_bytes, chunk_activation=c.chunk_activation_bytes,
                          communicators=c.communicators, chunks=c.costs.chunks, order=order,
                          w_bytes=c.costs.w_pending_bytes)


def rank_breakdown(*, state: float, activation: float, peak: float, chunk_activation: Sequence[float],
                   communicators: int, chunks: int, order: Sequence[Task], reserved: float = 0,
                   w_bytes: Sequence[float] = ()) -> MemoryBreakdown:
    """``memory_breakdown`` from a traced rank's figures (ranks.parquet): ``activation`` covers
    all of the rank's ``chunks`` (``chunk_activation`` splits it; empty: evenly); ``peak`` is
    the traced micro-batch's live peak and ``reserved`` the caching allocator's (0: not measured)."""
    working = max(0.0, peak - activation) if peak else 0.0
    return MemoryBreakdown(state=state, activations=activations_in_flight(activation, chunk_activation, chunks, order,
                                                                               w_bytes),
                           working=working, framework=framework_bytes(communicators) if communicators else 0.0,
                           fragmentation=max(0.0, reserved - peak) if reserved and peak else 0.0)


def activations_in_flight(activation: float, chunk_activation: Sequence[float], chunks: int,
                          order: Sequence[Task], w_bytes: Sequence[float] = ()) -> float:
    """Most saved-activation bytes the order holds at once: each forward adds its chunk's share,
    each backward frees it (the first chunk carries the embedding, the last the loss). In an
    order with W tasks a backward keeps what its chunk's W reads (``w_bytes``: the
    weight-gradient GEMMs' inputs, the layers' inputs and output gradients) until that W runs."""
    act = list(chunk_activation) if len(chunk_activation) == chunks else [activation / chunks] * chunks
    split = splits_backward(list(order))
    keep = list(w_bytes) if split and len(w_bytes) == chunks else [0.0] * chunks
    held = peak = 0.0
    for task in memory_order(list(order)):  # a combined forward counted after its backward
        c = task.chunk
        if task.kind == "F":
            held += act[c]
        elif task.kind == "B":  # a whole backward (its W in it) keeps nothing for later
            held += (0.0 if task.whole else keep[c]) - act[c]
        else:
            held -= keep[c]
        peak = max(peak, held)
    return peak


def class_peak_bytes(c: ClassInfo, order: Sequence[Task]) -> float:
    """A rank's peak allocator memory (state + activations in flight + working memory)."""
    return memory_breakdown(c, order).allocator


def hungriest(stages: int, breakdowns: Iterable[tuple[int, MemoryBreakdown]]) -> list[MemoryBreakdown]:
    """Per pipeline stage, the breakdown that needs the most device memory of those given for it
    ((stage, breakdown) pairs; a stage given none: zeros)."""
    peak: list[MemoryBreakdown | None] = [None] * stages
    for s, b in breakdowns:
        if peak[s] is None or b.device > peak[s].device:
            peak[s] = b
    return [b or MemoryBreakdown(0.0, 0.0, 0.0, 0.0) for b in peak]


def stage_breakdowns(classes: Sequence[ClassInfo], orders: Sequence[Sequence[Task]]) -> list[MemoryBreakdown]:
    """Per pipeline stage, the breakdown of its hungriest class (by device memory)."""
    # in flight depends on the stage's place in the pipeline
    return hungriest(len(orders), ((s, memory_breakdown(c, orders[s])) for c in classes for s in c.stages))


# the summary's memory columns besides peak_mem_gib and the per-stage lists (memory_columns)
MEMORY_COLUMNS = ("fits", "device_mem_gib", "mem_state_gib", "mem_activations_gib", "mem_working_gib",
                  "mem_framework_gib", "mem_fragmentation_gib")


def memory_columns(breakdowns: Sequence[MemoryBreakdown], capacity_gib: float,
                   stage_capacity_gib: Mapping[int, float] | None = None) -> dict:
    """A summary row's memory columns from each stage's breakdown: the peak, whether every stage
    fits its GPU (``capacity_gib``, or ``stage_capacity_gib[s]`` for a stage on another model: a
    heterogeneous job), and the terms of the stage that needs the most device memory."""
    mem = [b.allocator / GIB for b in breakdowns]
    device = [b.device / GIB for b in breakdowns]
    capacity = [(stage_capacity_gib or {}).get(s, capacity_gib) for s in range(len(device))]
    worst = breakdowns[max(range(len(device)), key=device.__getitem__)]
    fits = all(d <= c for d, c in zip(device, capacity, strict=True))
    return {"peak_mem_gib": max(mem), "fits": fits, "device_mem_gib": max(device),
            "mem_state_gib": worst.state / GIB, "mem_activations_gib": worst.activations / GIB,
            "mem_working_gib": worst.working / GIB, "mem_framework_gib": worst.framework / GIB,
            "mem_fragmentation_gib": worst.fragmentation / GIB,
            "stage_peak_mem_gib": mem, "stage_device_mem_gib": device, "stage_capacity_gib": capacity}


def exposed_by_kind(result: EngineResult, stage: int) -> dict[str, float]:
    """Exposed communication of ``stage`` in seconds, one entry per summary column kind."""
    out = dict.fromkeys((*EXPOSED_KINDS, "other"), 0.0)
    for kind, us in result.stages[stage].exposed_us:
        if kind != HOST:
            out[kind if kind in EXPOSED_KINDS else "other"] += us / 1e6
    return out


def host_wait_s(result: EngineResult, stage: int) -> float:
    """Seconds ``stage``'s compute stream waited for the host to launch its ops."""
    return sum(us for kind, us in result.stages[stage].exposed_us if kind == HOST) / 1e6


def variability_columns(workload, hardware, step_s: float, compute_s: float) -> dict[str, float]:
    """Step-time quantiles under the hardware's GPU-to-GPU speed spread, and the expected
    slowdown each synchronization absorbs (echo.simulate.variability)."""
    sigma = hardware.variability.speed_sigma.value if hardware.variability is not None else 0.0
    p = workload.parallel
    q = variability.step_quantiles(step_s, compute_s, sigma, workload.world_size)
    absorbed = variability.absorbed_by(compute_s, sigma, variability.nested_groups(p.tp, p.cp, p.pp, p.dp))
    return {"speed_sigma": sigma, "step_mean_s": step_s + sum(absorbed.values()),
            **{f"step_p{round(k * 100)}_s": v for k, v in q.items()},
            **{f"variance_{k}_s": v for k, v in absorbed.items()}}


def summary_table(*, workload, hardware, topology, classes: Sequence[ClassInfo],
                  orders: Sequence[Sequence[Task]], result: EngineResult, sim_wall_s: float,
                  extra: dict | None = None, stage_capacity_gib: Mapping[int, float] | None = None) -> pa.Table:
    """One row: the SUMMARY contract columns, then the breakdowns behind them (``stage_capacity_gib``:
    the memory of the GPU model a stage runs on, where not the job's)."""
    m, world = workload.micro_batches, workload.world_size
    if result.step_us <= 0:
        raise ValueError(f"{workload.name}: the simulated step takes no time (no timed ops in the trace?)")
    step_s = result.step_us / 1e6
    crit = result.stages[result.critical_stage]
    flops = step_flops(classes, m)
    # MFU against the dense bf16 peak for FP8 runs too, as torchtitan and Megatron report it
    peak_tflops = getattr(hardware.peak_tflops, "bf16" if workload.training.dtype == "fp8" else workload.training.dtype)
    exposed = exposed_by_kind(result, result.critical_stage)
    memory = memory_columns(stage_breakdowns(classes, orders), hardware.memory_gib, stage_capacity_gib)
    tokens = workload.training.global_batch * workload.model.seq_len
    row = {
        "workload": workload.name, "hardware": hardware.name, "topology": topology.name,
        "world_size": world, "step_time_s": step_s, "compute_s": crit.compute_us / 1e6,
        "exposed_comm_s": sum(exposed.values()), "bubble_s": crit.bubble_us / 1e6,
        "host_wait_s": host_wait_s(result, result.critical_stage),
        "tokens_per_s": tokens / step_s, "tflops_per_gpu": flops.executed / (world * step_s) / 1e12,
        "mfu": flops.model / (world * step_s * peak_tflops * 1e12), "peak_mem_gib": memory.pop("peak_mem_gib"),
        "sim_wall_s": sim_wall_s, **{k: memory[k] for k in MEMORY_COLUMNS},
        "bubble_fraction": crit.bubble_us / result.step_us,
        "slowdown_s": crit.slowdown_us / 1e6,
        **{f"exposed_{k}_s": v for k, v in exposed.items()},
        "stage_step_time_s": [s.end_us / 1e6 for s in result.stages],
        "stage_peak_mem_gib": memory["stage_peak_mem_gib"], "stage_device_mem_gib": memory["stage_device_mem_gib"],
        "stage_capacity_gib": memory["stage_capacity_gib"],
        "critical_stage": result.critical_stage,
        "schedule": workload.parallel.schedule, "micro_batches": m, "pp": len(orders),
        "virtual_stages": classes[0].costs.chunks, "classes": len(classes),
        "executed_flops": flops.executed, "model_flops": flops.model, "events": len(result.events),
        "mode": result.mode, "critical_rank": result.critical_rank,
        **variability_columns(workload, hardware, step_s, crit.compute_us / 1e6), **(extra or {}),
    }
    return pa.table({k: [v] for k, v in row.items()})
