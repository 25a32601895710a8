"""Time-to-train and cost against GPU count: the strong-scaling view of a search's ranking.

A search (``python -m echo search``) ranks the layouts of one model at one or several GPU counts;
for each count its fastest layout that fits in memory is planned (``planner.plan``) for the same
tokens on the same site, so the view shows what more GPUs buy once interruptions, checkpoints
and restarts are counted: a larger job is interrupted more often, so its effective training
time falls while its step shrinks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from echo.config.hardware import Hardware
from echo.config.site import Site
from echo.config.topology import Topology
from echo.config.workload import Workload
from echo.plan.checkpoint import model_parameters
from echo.plan.planner import Plan, plan


def fastest_per_gpu_count(rows: Iterable[Mapping]) -> list[Mapping]:
    """Per GPU count (``world_size``), the ranking row with the shortest step among those that fit."""
    best: dict[int, Mapping] = {}
    for r in rows:
        if not r.get("fits", True):
            continue
        n = int(r["world_size"])
        if n not in best or r["step_time_s"] < best[n]["step_time_s"]:
            best[n] = r
    return [best[n] for n in sorted(best)]


def scaling_plans(w: Workload, hardware: Hardware, topologies: Mapping[str, Topology], site: Site,
                  rows: Iterable[Mapping], tokens: float, **kw) -> list[tuple[Mapping, Plan]]:
    """(layout row, plan) for the fastest fitting layout at each GPU count; ``w`` is the model and
    batch the layouts share (its parameters are counted once), ``topologies`` by name."""
    n = model_parameters(w)
    out = []
    for r in fastest_per_gpu_count(rows):
        topo = topologies[r["topology"]]
        out.append((r, plan(w, hardware, topo, site, r, tokens, parameters=n, **kw)))
    return out
