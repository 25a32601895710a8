"""Rank-to-rank variability and stragglers in symmetric mode, by order statistics.

GPUs of one SKU do not run at one speed: manufacturing and power management spread a cluster's
GPUs (Sinha et al., SC22, "Not All GPUs Are Created Equal": 8% average performance variation
across the GPUs of a cluster, outliers up to 1.5x slower than the median). A GPU's factor on its
kernel times is persistent over a job, so a synchronous step waits for the slowest member of
every group it synchronizes:

- a tensor- (and context-) parallel group meets at every layer's collectives: it runs at its
  slowest member's pace;
- a pipeline moves at its slowest stage (1F1B's steady state: each micro-batch passes every
  stage): one slow stage slows the stage's compute, and so the step, by its own factor;
- data-parallel replicas meet at the gradient reduction: the step waits for the slowest replica.

The groups nest (TP in a stage, stages in a replica, replicas in the job), so the step's compute
runs at the slowest GPU of the whole job: with per-GPU factors 1 + sigma z (z standard normal,
independent), the step is

    step(x) = ideal + (x_max - 1) * compute      (compute: the critical stage's compute time)

and x_max's quantiles are those of the largest of N = world size normals:
q -> 1 + sigma * Phi^-1(q^(1/N)). Full mode (every rank replayed with its own factor) checks
the per-sample formula (tests/test_variability.py). How much of the expected slowdown each
synchronization absorbs is the growth of the expected maximum from one nesting level to the
next: E[max of tp*cp] (TP), E[max of tp*cp*pp] - that (PP), E[max of N] - that (DP).

A straggler (one GPU slower by a factor) slows its stage's compute by that factor in every
data-parallel replica's view: the replicas wait for it at the gradient reduction, its stage's
TP group at every layer. In symmetric mode its stage's programs run ``factor`` slower
(``stage_factors``); full mode slows the rank alone (``compute_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache

from scipy import integrate, special, stats

QUANTILES = (0.5, 0.9, 0.99)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1)."""
    if n < 1:
        raise ValueError(f"need at least one member, got {n}")
    if n == 1:
        return 0.0

    def density(z: float) -> float:  # z * n * phi(z) * Phi(z)^(n-1), with Phi^(n-1) in logs for large n
        return z * n * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) * math.exp((n - 1) * special.log_ndtr(z))

    value, _ = integrate.quad(density, -10.0, 12.0, limit=200, points=[stats.norm.ppf(0.5 ** (1 / n))])
    return value


def quantile_max_normal(n: int, q: float) -> float:
    """The q-quantile of the largest of n independent standard normals: Phi^-1(q^(1/n))."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be within (0, 1), got {q}")
    return float(stats.norm.ppf(q ** (1.0 / n)))


def nested_groups(tp: int, cp: int, pp: int, dp: int) -> dict[str, int]:
    """Members of each nesting level's group: a TP x CP group, a pipeline replica, the job."""
    return {"tp": tp * cp, "pp": tp * cp * pp, "dp": tp * cp * pp * dp}


def step_quantiles(step_s: float, compute_s: float, sigma: float, world: int,
                   quantiles: tuple[float, ...] = QUANTILES) -> dict[float, float]:
    """Step time at each quantile when every GPU's kernels take 1 + sigma z of their time."""
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    return {q: step_s + max(0.0, sigma * quantile_max_normal(world, q)) * compute_s for q in quantiles}


def absorbed_by(compute_s: float, sigma: float, groups: Mapping[str, int]) -> dict[str, float]:
    """Expected seconds of slowdown each synchronization (tp, pp, dp) adds, in nesting order."""
    out, below = {}, 0.0
    for kind, members in groups.items():
        level = expected_max_normal(members)
        out[kind] = sigma * (level - below) * compute_s
        below = level
    return out


def stage_factors(stragglers: Mapping[int, float], stage_of: Mapping[int, int]) -> dict[int, float]:
    """Each pipeline stage's compute factor from per-rank straggler factors (the slowest of its ranks)."""
    out: dict[int, float] = {}
    for rank, factor in stragglers.items():
        if not factor > 0:
            raise ValueError(f"straggler factor of rank {rank} must be > 0, got {factor}")
        if rank not in stage_of:
            raise ValueError(f"straggler rank {rank} is not in the job (ranks 0..{len(stage_of) - 1})")
        s = stage_of[rank]
        out[s] = max(out.get(s, 1.0), factor)
    return out
