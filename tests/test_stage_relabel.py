"""stage_costs: a class spanning pipeline stages runs its representative's programs unrelabelled
only where relabelling them could not change a time (stage._moves_alike)."""

from __future__ import annotations

import pytest

from echo.config import load_topology
from echo.network.degraded import SlowNics
from echo.network.model import NetworkModel
from echo.simulate.costing import CommTimer, OpContext
from echo.simulate.full import Relabel
from echo.simulate.program import Op, Program, RankCosts
from echo.simulate.stage import _moves_alike, stage_costs
from echo.simulate.summary import ClassInfo

TOPOLOGY = "dgx-h100-ndr"  # 8 GPUs a node


def context(network) -> OpContext:
    return OpContext({}, CommTimer(network), gpus_per_node=8)


def test_a_node_aligned_move_of_a_network_model_is_alike():
    ctx = context(NetworkModel(load_topology(TOPOLOGY)))
    groups = {tuple(range(8)), (0, 8), tuple(range(0, 64, 8))}
    assert _moves_alike(lambda: groups, lambda r: r + 64, ctx)  # whole nodes further: every group keeps its shape
    # stages of whole nodes: alike without looking at a group
    assert _moves_alike(lambda: pytest.fail("groups read"), lambda r: r + 64, ctx, stage_stride=64)


def test_a_move_that_reshapes_a_group_is_not_alike():
    ctx = context(NetworkModel(load_topology(TOPOLOGY)))
    # ranks 4..11 straddle two nodes where 0..7 filled one: another shape and link class
    assert not _moves_alike(lambda: {tuple(range(8))}, lambda r: r + 4, ctx)
    # a p2p pair that moves from one node to two
    assert not _moves_alike(lambda: {(3, 4)}, lambda r: r + 4, ctx)


def test_a_degraded_network_is_always_relabelled():
    slow = SlowNics(NetworkModel(load_topology(TOPOLOGY)), {1: 2.0})  # node 1's NICs at half speed
    assert not _moves_alike(lambda: {tuple(range(8))}, lambda r: r + 8, context(slow), stage_stride=8)


def _one_class(group: tuple[int, ...], ctx: OpContext) -> ClassInfo:
    """A class on stages 0 and 1 of a pp 2 x tp 8 mesh whose forward runs a tp all-reduce, costed
    as costing.to_op costs it."""
    us, latency, loads = ctx.timer.transfer("all_reduce", group, 1 << 20)
    op = Op(0, "collective", "compute", us, blocking=True, comm_kind="tp", op="all_reduce", group=group,
            link=ctx.link(group), nbytes=1 << 20, latency_us=latency, loads=loads)
    costs = RankCosts(forward=(Program([op]),), backward=(Program(),))
    return ClassInfo(class_id=0, representative=0, stages=(0, 1), ranks=16, costs=costs)


@pytest.mark.parametrize(("node_ranks", "alike"), [(8, True), (4, True), (6, False)])
def test_stage_costs_reuses_the_programs_only_where_alike(node_ranks, alike):
    base = load_topology(TOPOLOGY)
    topo = type(base).model_validate({**base.model_dump(), "gpus_per_node": node_ranks})
    network = NetworkModel(topo)
    ctx = OpContext({}, CommTimer(network), gpus_per_node=node_ranks)
    cols = {"rank": list(range(16)), "pp_rank": [r // 8 for r in range(16)], "dp_rank": [0] * 16,
            "cp_rank": [0] * 16, "tp_rank": [r % 8 for r in range(16)]}
    c = _one_class(tuple(range(8)), ctx)
    first, second = stage_costs([c], 2, 1, Relabel.from_columns(cols), ctx)
    assert first is c.costs
    assert (second is c.costs) == alike
    moved = second.forward[0].ops[0]
    # either way stage 1 runs what its own group costs: ranks 8..15 on node 1 (8 a node), on nodes
    # 2 and 3 as ranks 0..7 on nodes 0 and 1 (4 a node: alike too), or 4 + 4 on nodes 1 and 2
    # where ranks 0..7 sit 6 + 2 on nodes 0 and 1 (6 a node: relabelled)
    assert moved.duration_us == pytest.approx(ctx.timer.transfer("all_reduce", tuple(range(8, 16)), 1 << 20)[0])
    assert moved.group == (tuple(range(8)) if alike else tuple(range(8, 16)))


def test_the_stage_stride_of_a_mesh():
    pp_outer = {"rank": list(range(16)), "pp_rank": [r // 8 for r in range(16)], "dp_rank": [0] * 16,
                "cp_rank": [0] * 16, "tp_rank": [r % 8 for r in range(16)]}
    assert Relabel.from_columns(pp_outer).stage_stride == 8
    pp_inner = {**pp_outer, "pp_rank": [r % 2 for r in range(16)], "tp_rank": [r // 2 for r in range(16)]}
    assert Relabel.from_columns(pp_inner).stage_stride is None  # stage 1's ranks are the odd ones
