"""A run planned from one simulated step: ``plan(...)`` and its ``Plan``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from echo.config.hardware import Hardware
from echo.config.site import Site
from echo.config.topology import Topology
from echo.config.workload import Workload
from echo.plan import energy, reliability
from echo.plan.checkpoint import checkpoint_cost


@dataclass(frozen=True)
class Plan:
    """Time-to-train, interruptions, goodput, cost and energy of one workload on one cluster."""

    workload: str
    hardware: str
    topology: str
    site: str
    gpus: int
    hosts: int
    links: int
    step_time_s: float                 # the simulated step, every GPU alike
    expected_step_s: float             # with the GPUs' speed spread (summary step_mean_s): what the plan runs
    tokens_per_step: int
    interruptions_per_day: dict[str, float]   # by cause, and "total"
    mtti_h: float                      # mean time to interruption
    checkpoint_parameters: int
    checkpoint_gb: float
    checkpoint_save_s: float           # training stopped per checkpoint
    checkpoint_load_s: float
    restart_s: float
    checkpoint_interval_steps: int     # whole steps between checkpoints
    checkpoint_interval_s: float       # their compute time
    interval_is_optimal: bool          # Daly's interval (rounded to whole steps); false: a given one
    effective_training_time: float     # useful share of wall time (ETTR)
    tokens: float
    ideal_days: float                  # tokens at the simulated step, never interrupted
    time_to_train_days: float          # wall-clock, interruptions, restarts and checkpoints included
    interruptions: float               # expected over time_to_train_days
    gpu_hours: float
    usd_per_gpu_hour: float | None
    cost_usd: float | None
    energy_mwh: float | None
    gpu_busy: float                    # share of the step the GPU's kernels run (power model)
    days: float | None = None          # the --days horizon asked for, if any
    interruptions_in_days: float | None = None
    provenance: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sourced(name: str, fig) -> tuple[str, str]:
    return name, f"{fig.status}: {fig.basis}"


def plan(w: Workload, hardware: Hardware, topology: Topology, site: Site, summary: Mapping, tokens: float, *,
         days: float | None = None, interval_steps: int | None = None, usd_per_gpu_hour: float | None = None,
         parameters: int | None = None) -> Plan:
    """Plan ``tokens`` of training of ``w`` from its simulated ``summary`` row (step_time_s,
    compute_s, world_size). ``interval_steps``: checkpoint every so many steps (default: Daly's
    optimum); ``usd_per_gpu_hour``: overrides the site's price; ``parameters``: a count already made."""
    if tokens <= 0:
        raise ValueError(f"tokens must be > 0, got {tokens}")
    if days is not None and days <= 0:
        raise ValueError(f"days must be > 0, got {days}")
    ideal_step = float(summary["step_time_s"])
    if not ideal_step > 0:
        raise ValueError(f"the summary's step_time_s must be > 0, got {ideal_step}")
    # the expected step under GPU-to-GPU speed spread, where the summary has it (echo.simulate.variability)
    step = float(summary.get("step_mean_s") or ideal_step)
    parts = reliability.job_parts(int(summary["world_size"]), topology)
    rates = reliability.interruption_rates(site.failures, parts)   # per hour
    per_hour = sum(rates.values())
    mtti_s = 3600.0 / per_hour
    ckpt = checkpoint_cost(w, site.checkpoint, parameters)
    restart = site.restart_s.value
    given = interval_steps is not None
    if not given:
        best = reliability.optimal_interval_s(ckpt.save_s, mtti_s, restart)
        interval_steps = max(1, round(best / step))
    elif interval_steps < 1:
        raise ValueError(f"checkpoint interval must be >= 1 step, got {interval_steps}")
    interval_s = interval_steps * step
    ettr = reliability.effective_training_time_ratio(interval_s, ckpt.save_s, restart, ckpt.load_s, mtti_s)
    tokens_per_step = w.training.global_batch * w.model.seq_len
    ideal_s = tokens / tokens_per_step * step
    wall_s = math.inf if ettr == 0 else ideal_s / ettr
    interruptions = wall_s / 3600.0 * per_hour
    down_h = interruptions * (restart + ckpt.load_s) / 3600.0
    wall_h = wall_s / 3600.0
    gpu_hours = parts.gpus * wall_h
    price = usd_per_gpu_hour
    provenance = dict(_sourced(f"failures.{k}", getattr(site.failures, k)) for k in type(site.failures).model_fields)
    provenance.update([_sourced("restart_s", site.restart_s), _sourced("checkpoint.write_GBps", site.checkpoint.write_GBps),
                       _sourced("checkpoint.read_GBps", site.checkpoint.read_GBps),
                       _sourced("checkpoint.fixed_s", site.checkpoint.fixed_s)])
    if price is None and hardware.name in site.usd_per_gpu_hour:
        fig = site.usd_per_gpu_hour[hardware.name]
        price = fig.value
        provenance.update([_sourced("usd_per_gpu_hour", fig)])
    elif price is not None:
        provenance["usd_per_gpu_hour"] = "given on the command line"
    busy = min(1.0, max(0.0, float(summary.get("compute_s", ideal_step)) / ideal_step))
    mwh = None
    if hardware.power is not None and math.isfinite(wall_h):
        pw = site.power
        mwh = energy.energy_mwh(parts.gpus, parts.hosts, wall_h - down_h, down_h, hardware.power, busy,
                                pw.host_overhead_w.value, pw.pue.value)
        provenance.update([_sourced("gpu.tdp_w", hardware.power.tdp_w), _sourced("gpu.idle_w", hardware.power.idle_w),
                           _sourced("host_overhead_w", pw.host_overhead_w), _sourced("pue", pw.pue)])
        provenance["gpu_power_model"] = ("assumed: idle + (TDP - idle) x the share of the step the kernels run "
                                         "(simulated compute / step time); idle while restarting and reloading")
    return Plan(
        workload=w.name, hardware=hardware.name, topology=topology.name, site=site.name,
        gpus=parts.gpus, hosts=parts.hosts, links=parts.links, step_time_s=ideal_step, expected_step_s=step,
        tokens_per_step=tokens_per_step,
        interruptions_per_day={**{k: v * 24.0 for k, v in rates.items()}, "total": per_hour * 24.0},
        mtti_h=mtti_s / 3600.0, checkpoint_parameters=ckpt.parameters, checkpoint_gb=ckpt.bytes / 1e9,
        checkpoint_save_s=ckpt.save_s, checkpoint_load_s=ckpt.load_s, restart_s=restart,
        checkpoint_interval_steps=interval_steps, checkpoint_interval_s=interval_s,
        interval_is_optimal=not given,
        effective_training_time=ettr, tokens=tokens, ideal_days=ideal_s / 86400.0, time_to_train_days=wall_s / 86400.0,
        interruptions=interruptions, gpu_hours=gpu_hours, usd_per_gpu_hour=price,
        cost_usd=None if price is None else gpu_hours * price, energy_mwh=mwh, gpu_busy=busy,
        days=days, interruptions_in_days=None if days is None else per_hour * 24.0 * days, provenance=provenance)
