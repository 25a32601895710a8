"""The summary row: step time and its split, throughput, FLOPs and memory accounting.

FLOPs are counted from the trace, not from a formula: each class's matmul FLOPs per micro-batch
template (forward + backward + recompute, all chunks) times the micro-batches, plus its
once-per-step tasks, times the ranks in the class. tflops_per_gpu divides the executed total
(recompute included, as Megatron-LM reports it) by world size x step time; mfu uses the model
FLOPs (recompute excluded) against the dtype's peak.

compute_s includes what the overlap slowdown added (slowdown_s, the part of compute_s spent
slowed beside communication); compute_s + exposed_comm_s + bubble_s = step_time_s on the
critical stage (full mode: the critical stage's slowest rank).

Memory is per rank: parameters + gradients + optimizer state, plus one micro-batch's saved
activations times the most micro-batches the stage's schedule keeps in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from echo.simulate.engine import EngineResult
from echo.simulate.program import RankCosts
from echo.training.schedule import Task, in_flight

GIB = 1 << 30
EXPOSED_KINDS = ("tp", "cp", "ep", "dp", "edp", "dpcp", "pp")  # columns exposed_{kind}_s; others -> other


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


def class_peak_bytes(c: ClassInfo, order: Sequence[Task]) -> float:
    """A rank's peak memory: its state plus activations of the chunk-micro-batches in flight
    (activation_bytes covers all of the rank's chunks, so one chunk holds 1/chunks of it)."""
    return c.state_bytes + c.activation_bytes * in_flight(list(order)) / c.costs.chunks


def stage_peak_bytes(classes: Sequence[ClassInfo], orders: Sequence[Sequence[Task]]) -> list[float]:
    """Per pipeline stage, the peak memory of its hungriest class."""
    peak = [0.0] * len(orders)
    for c in classes:
        for s in c.stages:  # in flight depends on the stage's place in the pipeline
            peak[s] = max(peak[s], class_peak_bytes(c, orders[s]))
    return peak


def exposed_by_kind(result: EngineResult, stage: int) -> dict[str, float]:
    """Exposed communication of ``stage`` in seconds, one entry per summary column kind."""
    out = dict.fromkeys((*EXPOSED_KINDS, "other"), 0.0)
    for kind, us in result.stages[stage].exposed_us:
        out[kind if kind in EXPOSED_KINDS else "other"] += us / 1e6
    return out


def summary_table(*, workload, hardware, topology, classes: Sequence[ClassInfo],
                  orders: Sequence[Sequence[Task]], result: EngineResult, sim_wall_s: float,
                  extra: dict | None = None) -> pa.Table:
    """One row: the SUMMARY contract columns, then the breakdowns behind them."""
    m, world = workload.micro_batches, workload.world_size
    if result.step_us <= 0:
        raise ValueError(f"{workload.name}: the simulated step takes no time (no timed ops in the trace?)")
    step_s = result.step_us / 1e6
    crit = result.stages[result.critical_stage]
    flops = step_flops(classes, m)
    peak_tflops = getattr(hardware.peak_tflops, workload.training.dtype)
    exposed = exposed_by_kind(result, result.critical_stage)
    mem = [b / GIB for b in stage_peak_bytes(classes, orders)]
    tokens = workload.training.global_batch * workload.model.seq_len
    row = {
        "workload": workload.name, "hardware": hardware.name, "topology": topology.name,
        "world_size": world, "step_time_s": step_s, "compute_s": crit.compute_us / 1e6,
        "exposed_comm_s": sum(exposed.values()), "bubble_s": crit.bubble_us / 1e6,
        "tokens_per_s": tokens / step_s, "tflops_per_gpu": flops.executed / (world * step_s) / 1e12,
        "mfu": flops.model / (world * step_s * peak_tflops * 1e12), "peak_mem_gib": max(mem),
        "sim_wall_s": sim_wall_s,
        "fits": max(mem) <= hardware.memory_gib, "bubble_fraction": crit.bubble_us / result.step_us,
        "slowdown_s": crit.slowdown_us / 1e6,
        **{f"exposed_{k}_s": v for k, v in exposed.items()},
        "stage_step_time_s": [s.end_us / 1e6 for s in result.stages],
        "stage_peak_mem_gib": mem, "critical_stage": result.critical_stage,
        "schedule": workload.parallel.schedule, "micro_batches": m, "pp": len(orders),
        "virtual_stages": classes[0].costs.chunks, "classes": len(classes),
        "executed_flops": flops.executed, "model_flops": flops.model, "events": len(result.events),
        "mode": result.mode, "critical_rank": result.critical_rank, **(extra or {}),
    }
    return pa.table({k: [v] for k, v in row.items()})
