"""Overlapping transfers share links: a flow-level, max-min fair model.

When collectives overlap (the data-parallel reductions of several pipeline stages on one node's
NICs, a pipeline send beside a gradient reduction, an all-to-all beside an all-gather), each runs
the algorithm it would run alone (``NetworkModel.estimate``), but every link two of them use at
once is shared. A transfer is a *flow* with

- a latency (``latency_us`` of its chosen candidate) that uses no bandwidth, then
- a data phase of ``W`` microseconds at full speed, during which it loads each link it uses by
  the fraction of that link its standalone rate takes.

Links (resources): each GPU's NVLink/NVSwitch port and each GPU's NIC share (rail), per direction
(``("nvlink", gpu, "tx"|"rx")``, ``("nic", gpu, "tx"|"rx")``), with the capacities of the
model's parameters (``intra_bw_GBps``, ``nic_bw_GBps``; an oversubscribed fabric is already in
the latter). A collective loads both directions of its members' ports by its candidate's
``nvlink_traffic`` / ``nic_traffic`` (bytes per message byte per GPU); a ``send`` on group
``[src, dst]`` loads src's tx and dst's rx (``recv`` on ``[self, peer]`` the reverse), over
NVLink inside a node and over the NICs between nodes.

Sharing is max-min fair in bytes (``max_min_rates``, progressive filling): all flows' rates on
their own busiest link grow together until a link is full or a flow reaches its standalone
speed; the flows on a full link keep their share, the others grow on. Rates are recomputed
whenever a flow starts or ends its latency or its data (``simulate_flows``). So two equal
all-reduces over the same nodes' NICs each take about twice as long as one (plus the latency,
once), and transfers with no link in common do not slow each other.

API::

    model.concurrent([("all_reduce", range(16), 1 << 30), ("all_reduce", range(16, 32), 1 << 30)])
    -> [t0_us, t1_us]        # durations, each from its own start (default: all start at 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat

from echo.network.costs import P2P_OPS, Candidate, NetworkParams, Shape, best, candidates

_EPS = 1e-12

Resource = tuple  # ("nvlink" | "nic", gpu, "tx" | "rx")


@dataclass(frozen=True)
class Flow:
    """One transfer as the sharing model sees it."""

    latency_us: float
    work_us: float                    # data phase at full (standalone) speed
    loads: dict[Resource, float]      # fraction of each link's capacity used at full speed


def _members(op: str, group: Sequence[int]) -> tuple[list[int], list[int]]:
    """(senders, receivers) whose ports a transfer loads."""
    ranks = [int(r) for r in group]
    if op in P2P_OPS:
        if len(ranks) != 2:
            raise ValueError(f"{op} needs a group of [self, peer], got {ranks}")
        src, dst = (ranks[0], ranks[1]) if op == "send" else (ranks[1], ranks[0])
        return [src], [dst]
    return ranks, ranks


def flow_of(params: NetworkParams, shape: Shape, op: str, group: Sequence[int], nbytes: int) -> Flow:
    """The flow of one transfer alone on ``group`` (distinct global ranks, of placement
    ``shape``): its chosen candidate's latency, data time and link loads."""
    time_us, cand = best(candidates(params, op, shape), float(nbytes))
    if time_us <= 0:
        return Flow(0.0, 0.0, {})
    data = max(time_us - cand.latency_us, 0.0)
    loads: dict[Resource, float] = {}
    if data > 0:
        senders, receivers = _members(op, group)
        for tier, per_byte, cap_GBps in _tiers(cand, shape.nodes, params):
            if per_byte <= 0:
                continue
            rate = per_byte * nbytes / data / 1e3  # GB/s through each member's port
            share = min(1.0, rate / cap_GBps)
            loads.update(dict.fromkeys(_ports(tier, tuple(senders), "tx"), share))
            loads.update(dict.fromkeys(_ports(tier, tuple(receivers), "rx"), share))
    return Flow(cand.latency_us, data, loads)


@lru_cache(maxsize=4096)
def _ports(tier: str, gpus: tuple[int, ...], direction: str) -> tuple[Resource, ...]:
    """The links (tier, gpu, direction) of ``gpus``: a group repeats its transfers at many sizes,
    and a data-parallel group of a large job has thousands of members."""
    return tuple(zip(repeat(tier), gpus, repeat(direction)))  # zip builds the tuples in C


def _tiers(cand: Candidate, nodes: int, params: NetworkParams) -> list[tuple[str, float, float]]:
    """(link kind, bytes per message byte per GPU, capacity GB/s) of a chosen candidate."""
    if cand.algorithm == "p2p":
        return [("nic", 1.0, params.nic_bw_GBps)] if nodes > 1 else [("nvlink", 1.0, params.intra_bw_GBps)]
    return [("nvlink", cand.nvlink_traffic, params.intra_bw_GBps), ("nic", cand.nic_traffic, params.nic_bw_GBps)]


def max_min_rates(flows: Sequence[dict[Resource, float]]) -> list[float]:
    """Max-min fair speeds (fraction of standalone speed, 0..1) of flows given their link loads
    at full speed (``flows[i][r]``: fraction of link r flow i uses alone). Progressive filling
    on each flow's rate at its own busiest link, so shares are fair in bytes."""
    n = len(flows)
    peak = [max(f.values(), default=0.0) for f in flows]
    level = [0.0] * n   # rate on its busiest link, as a fraction of that link
    frozen = [p <= 0 for p in peak]
    used: dict[Resource, float] = {}
    while not all(frozen):
        # how far all unfrozen flows can rise together: each link's room, each flow's own peak
        rise = math.inf
        coeff: dict[Resource, float] = {}
        for i, f in enumerate(flows):
            if not frozen[i]:
                rise = min(rise, peak[i] - level[i])
                for r, u in f.items():
                    coeff[r] = coeff.get(r, 0.0) + u / peak[i]
        full: set[Resource] = set()
        for r, c in coeff.items():
            room = (1.0 - used.get(r, 0.0)) / c
            if room < rise - _EPS:
                rise, full = room, {r}
            elif abs(room - rise) <= _EPS:
                full.add(r)
        rise = max(rise, 0.0)
        for i, f in enumerate(flows):
            if frozen[i]:
                continue
            level[i] += rise
            for r, u in f.items():
                used[r] = used.get(r, 0.0) + u / peak[i] * rise
        for i, f in enumerate(flows):
            if not frozen[i] and (level[i] >= peak[i] - _EPS or any(r in full for r in f)):
                frozen[i] = True
    return [level[i] / peak[i] if peak[i] > 0 else 1.0 for i in range(n)]


def simulate_flows(flows: Sequence[Flow], starts_us: Sequence[float]) -> list[float]:
    """Finish time (us, absolute) of each flow, rates recomputed at every start and finish."""
    n = len(flows)
    finish = [math.nan] * n
    data_start = [s + f.latency_us for s, f in zip(starts_us, flows, strict=True)]
    remaining = [f.work_us for f in flows]
    for i in range(n):
        if remaining[i] <= 0:
            finish[i] = data_start[i]
    now = min(starts_us, default=0.0)
    while any(math.isnan(t) for t in finish):
        active = [i for i in range(n) if math.isnan(finish[i]) and data_start[i] <= now + _EPS]
        rates = max_min_rates([flows[i].loads for i in active]) if active else []
        # next event: a flow entering its data phase, or an active flow finishing
        upcoming = [data_start[i] for i in range(n) if math.isnan(finish[i]) and data_start[i] > now + _EPS]
        step = min(upcoming, default=math.inf) - now
        for i, rate in zip(active, rates, strict=True):
            if rate > 0:
                step = min(step, remaining[i] / rate)
        if not math.isfinite(step):
            raise RuntimeError("contention: flows cannot progress (a link with no capacity?)")
        now += step
        for i, rate in zip(active, rates, strict=True):
            remaining[i] -= rate * step
            if remaining[i] <= _EPS * max(1.0, flows[i].work_us):
                finish[i] = now
    return finish

