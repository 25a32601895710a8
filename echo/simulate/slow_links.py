"""Slow network links in a simulated step: link stragglers and the NICs' node-to-node spread.

A link straggler is a node whose NICs deliver ``1 / factor`` of the fitted bandwidth
(``echo.network.degraded.SlowNics``: a transfer crossing it runs at its pace). Full mode
costs every rank's transfers on that network, so exactly the groups that cross the node slow
down. Symmetric mode has one program per pipeline stage, so it slows every cross-node
transfer of each stage that has ranks on a slow node: a stage's data-parallel groups each hold
one rank of every tensor-parallel position, so with tensor-parallel groups inside a node every
one of them crosses the node; its pipeline sends cross it from the replica on that node only,
but the replicas meet at the gradient reduction and the step waits for the slowest (as for a
straggling GPU, ``echo.simulate.variability``).

The spread (a topology's ``link_variability.nic_bw_sigma``): each node's NICs deliver the fitted
bandwidth times ``1 + sigma z`` (z standard normal, persistent over a job). A ring runs at its
slowest member's pace and the job's synchronizations chain every group to every other, so the
step is set by the slowest node of the job: its factor ``1 / (1 - sigma z_max)``, with z_max
the largest of ``nodes`` normals, whose q-quantile is ``Phi^-1(q^(1/nodes))``. The summary's
``step_link_p50_s`` ... are the step re-simulated with every stage's cross-node transfers at the
quantile's factor: exact where every stage's rings span the job's nodes (one pipeline stage),
an upper bound with more stages (the slowest node slows its own stage only; tests compare it
with full mode's explicitly sampled nodes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from echo.simulate.variability import QUANTILES, quantile_max_normal


def check_slow_nodes(slow_nodes: Mapping[int, float], nodes: int, node_ranks: int) -> dict[int, float]:
    """``slow_nodes`` (node -> factor on its NICs' transfer times) checked against the job's
    ``nodes`` (``Topology.nodes``) of ``node_ranks`` ranks."""
    out = {}
    for node, factor in slow_nodes.items():
        if not 0 <= int(node) < nodes:
            raise ValueError(f"slow link: node {node} is not in the job (nodes 0..{nodes - 1}, "
                             f"{node_ranks} ranks a node)")
        if not float(factor) > 0:
            raise ValueError(f"slow link: node {node}'s factor must be > 0, got {factor}")
        out[int(node)] = float(factor)
    return out


def slow_stage_ranks(slow_nodes: Mapping[int, float], stage_of: Mapping[int, int], node_ranks: int) -> dict[int, float]:
    """Symmetric mode's slow members: every rank of a pipeline stage that has ranks on a slow
    node, at the slowest such node's factor (the stage's rings wait for it wherever its
    representative sits, and its neighbours' transfers to it cross it)."""
    stage_factor: dict[int, float] = {}
    for rank, stage in stage_of.items():
        f = slow_nodes.get(rank // node_ranks)
        if f is not None:
            stage_factor[stage] = max(stage_factor.get(stage, f), f)
    return {rank: stage_factor[stage] for rank, stage in stage_of.items() if stage in stage_factor}


def quantile_factors(sigma: float, nodes: int, quantiles: Sequence[float] = QUANTILES) -> dict[float, float]:
    """Factor on the slowest node's NIC transfer times at each quantile of a job over ``nodes`` nodes."""
    if sigma < 0:
        raise ValueError(f"nic_bw_sigma must be >= 0, got {sigma}")
    out = {}
    for q in quantiles:
        share = 1.0 - sigma * max(0.0, quantile_max_normal(nodes, q)) if nodes > 1 else 1.0
        if share <= 0:
            raise ValueError(f"nic_bw_sigma {sigma}: the slowest of {nodes} nodes would deliver no bandwidth")
        out[q] = 1.0 / share
    return out


def link_quantile_columns(sigma: float, nodes: int, step_s: float,
                          step_at: Callable[[float], float]) -> dict[str, float]:
    """The summary's columns: ``nic_sigma`` and the step at each quantile of the slowest node's
    NIC (``step_at(f)``: the step with every stage's cross-node transfers ``f`` slower)."""
    cols = {"nic_sigma": sigma}
    for q, f in quantile_factors(sigma, nodes).items():
        cols[f"step_link_p{round(q * 100)}_s"] = step_s if f == 1.0 else step_at(f)
    return cols
