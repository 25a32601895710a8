"""Slow network links: a node whose NICs deliver less than the fitted bandwidth.

A degraded link is the network's straggler. Production clusters see them as fail-slows: a NIC
or cable that trains down, a congested switch port, a flapping link (Wu et al., "Falcon:
Pinpointing and Mitigating Stragglers for Large-Scale Hybrid-Parallel Training", arXiv
2410.12588: on a 10,000-GPU cluster, cross-node networking issues are among the fail-slows'
causes and last from tens of seconds to hours). NCCL's ring and tree move every chunk through
every member's NIC in turn, so a collective whose group crosses a slow NIC runs at that NIC's
pace; a send or receive is slow when either end is; a collective that stays on NVLink does not
notice.

``SlowNics`` wraps a ``NetworkModel``: transfers whose group spans nodes and touches a slow node
are costed (time and link loads) on the same model with that node's NIC bandwidth divided by
its factor (the slowest member's, where a group touches several); everything else is the
model's own figure. Besides by node, the slow members can be named by rank (``ranks=``: what
symmetric mode uses, every rank of a pipeline stage that has a slow node, so that the stage's
own rings and its neighbours' transfers to it slow down; ``echo.simulate.slow_links``) or be
every node (``every=``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from echo.network.contention import Flow
from echo.network.model import CollectiveCosts, Estimate, NetworkModel


def _check(factor: float, where: str) -> float:
    f = float(factor)
    if not f > 0.0:
        raise ValueError(f"{where}: a slow link's factor divides its bandwidth and must be > 0, got {factor}")
    return f


class SlowNics(CollectiveCosts):
    """``base`` with the NICs of some nodes slower by a factor on their transfer times: ``nodes``
    (node -> factor, node = rank // the topology's node_ranks), ``ranks`` (rank -> factor: the
    nodes of those ranks) or ``every`` node. A factor below 1 is a node faster than the fit."""

    def __init__(self, base: NetworkModel, nodes: Mapping[int, float] | None = None, *,
                 ranks: Mapping[int, float] | None = None, every: float | None = None):
        if not isinstance(base, NetworkModel):
            raise TypeError(f"slow links need an echo.network.NetworkModel to degrade, got {type(base).__name__}")
        if sum(x is not None for x in (nodes, ranks, every)) != 1:
            raise ValueError("give exactly one of nodes= (node -> factor), ranks= (rank -> factor) or every=")
        self.base = base
        self.node_ranks = base.topology.node_ranks
        self.nodes = {int(n): _check(f, f"slow node {n}") for n, f in (nodes or {}).items()}
        self.ranks = {int(r): _check(f, f"slow rank {r}") for r, f in (ranks or {}).items()}
        bad = sorted(n for n in (*self.nodes, *self.ranks) if n < 0)
        if bad:
            raise ValueError(f"slow nodes or ranks {bad}: indices start at 0")
        self.every = None if every is None else _check(every, "slow links (every node)")
        self._models: dict[float, NetworkModel] = {}

    def factor(self, group: Sequence[int]) -> float:
        """How much slower the NICs a transfer over ``group`` crosses are (1: none slow, or no NIC)."""
        nodes = {int(r) // self.node_ranks for r in group}
        if len(nodes) < 2:
            return 1.0  # NVLink only
        if self.every is not None:
            return self.every
        slow = [self.nodes[n] for n in nodes if n in self.nodes] + [self.ranks[r] for r in group if r in self.ranks]
        return max(slow, default=1.0)

    def model(self, factor: float) -> NetworkModel:
        """The base model with every NIC's bandwidth divided by ``factor`` (cached per factor)."""
        if factor == 1.0:
            return self.base
        # a faster node than the fit (a spread's sample) or a slower one: only the NIC bandwidth moves
        if factor not in self._models:
            p = self.base.params
            self._models[factor] = NetworkModel(self.base.topology,
                                                dataclasses.replace(p, nic_bw_GBps=p.nic_bw_GBps / factor),
                                                self.base.source, self.base.fit)
        return self._models[factor]

    def estimate(self, op: str, group: Sequence[int], *, nbytes: int) -> Estimate:
        return self.model(self.factor(group)).estimate(op, group=group, nbytes=nbytes)

    def flow(self, op: str, group: Sequence[int], nbytes: int) -> Flow:
        return self.model(self.factor(group)).flow(op, group, nbytes)

    def api_overhead_us(self, api: str, op: str, nbytes: int) -> float:
        return self.base.api_overhead_us(api, op, nbytes)  # host work, no link in it
