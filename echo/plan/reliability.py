"""Interruptions of a synchronous job and the effective training time they leave.

Failures are independent Poisson events per part (the usual large-job model: Kokolis et al.,
HPCA 2025, "a pile of nodes connected in series"), so a job that holds G GPUs, H hosts and L
NIC links is interrupted at

    rate = G * per_gpu + H * per_host + L * per_link + G * per_gpu_software + planned / 24   (per hour)

and its mean time to interruption is M = 1 / rate. Between interruptions the job computes for
an interval tau, saves a checkpoint (delta), computes again; an interruption costs the restart
(R), the checkpoint's reload (L) and, on average, half a segment of lost work ((tau + delta) / 2).
The useful share of wall time, to first order in 1/M, is

    ettr = tau / (tau + delta) * (1 - (R + L + (tau + delta) / 2) / M)

and tau = sqrt(2 delta (M + R)) maximizes it to that order (Daly 2006's first-order interval;
Young 1974's sqrt(2 delta M) without the restart). Both hold while delta << M; beyond M / 2
the interval is M (Daly's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo.config.site import Failures
from echo.config.topology import Topology


@dataclass(frozen=True)
class JobParts:
    """The parts whose failure stops a job."""

    gpus: int
    hosts: int   # servers (Topology.host_gpus GPUs each: a DGX node, an NVL72 compute tray)
    links: int   # NIC links into the scale-out network (none for a job inside one NVLink domain)


def job_parts(world_size: int, topology: Topology) -> JobParts:
    """The GPUs, hosts and NIC links ``world_size`` ranks occupy on ``topology`` (one GPU a rank)."""
    hosts = math.ceil(world_size / topology.host_gpus)
    per_gpu = topology.inter_node.nics_per_node / topology.gpus_per_node
    links = 0 if world_size <= topology.node_ranks else math.ceil(world_size * per_gpu)
    return JobParts(world_size, hosts, links)


def interruption_rates(f: Failures, parts: JobParts) -> dict[str, float]:
    """Interruptions per hour of wall time, by cause (gpu, host, link, software, planned)."""
    return {
        "gpu": parts.gpus * f.per_gpu_hour.value,
        "host": parts.hosts * f.per_host_hour.value,
        "link": parts.links * f.per_link_hour.value,
        "software": parts.gpus * f.per_gpu_hour_software.value,
        "planned": f.planned_per_day.value / 24.0,
    }


def optimal_interval_s(save_s: float, mtti_s: float, restart_s: float = 0.0) -> float:
    """Compute time between checkpoints that maximizes the effective training time (Daly's
    first order, sqrt(2 delta (M + R)); M when the save takes half of M or more)."""
    if mtti_s <= 0:
        raise ValueError(f"mean time to interruption must be > 0, got {mtti_s}")
    if save_s >= mtti_s / 2:
        return mtti_s
    return math.sqrt(2.0 * save_s * (mtti_s + restart_s))


def effective_training_time_ratio(interval_s: float, save_s: float, restart_s: float, load_s: float,
                                  mtti_s: float) -> float:
    """Share of wall time spent on training that is kept (first order in 1/M, clipped at 0)."""
    if interval_s <= 0:
        raise ValueError(f"checkpoint interval must be > 0, got {interval_s}")
    segment = interval_s + save_s
    lost_per_interruption = restart_s + load_s + segment / 2.0
    return max(0.0, interval_s / segment * (1.0 - lost_per_interruption / mtti_s))
