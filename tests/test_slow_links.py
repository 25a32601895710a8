"""Slow network links (echo.network.degraded, echo.simulate.slow_links): a link straggler in each
kind of group against hand-computed steps, symmetric mode against full mode, and the NICs'
node-to-node spread by order statistics against explicitly sampled nodes."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from test_simulate import HARDWARE, NONE, make_workload, topology, write_inputs

from echo.config.figure import Figure
from echo.config.topology import LinkVariability
from echo.network.degraded import SlowNics
from echo.network.model import NetworkModel
from echo.simulate import run_simulate
from echo.simulate.slow_links import check_slow_nodes, quantile_factors, slow_stage_ranks
from echo.simulate.variability import quantile_max_normal

MIB = 1 << 20  # the synthetic trace's transfers (test_simulate.trace_stage)


def simulate(tmp_path, w, topo, out: str, **kw) -> dict:
    if not (tmp_path / "trace").exists():
        write_inputs(tmp_path, w)
    return run_simulate(w, HARDWARE, topo, tmp_path / "trace", tmp_path / "rank_classes.parquet",
                        tmp_path / "kernels.parquet", tmp_path / "calib", tmp_path / out,
                        network=NetworkModel(topo), overlap=NONE, **kw).to_pylist()[0]


def slower(topo, factor: float) -> NetworkModel:
    """The topology's network with every NIC ``factor`` slower, built by hand."""
    base = NetworkModel(topo)
    return NetworkModel(topo, dataclasses.replace(base.params, nic_bw_GBps=base.params.nic_bw_GBps / factor))


def us(net: NetworkModel, op: str, group: list[int]) -> float:
    return net.estimate(op, group=group, nbytes=MIB).time_us


def test_a_slow_nic_slows_what_crosses_it_and_nothing_else():
    topo = topology(gpus_per_node=2)
    net = SlowNics(NetworkModel(topo), {1: 2.0})
    fast, slow = NetworkModel(topo), slower(topo, 2.0)
    assert net.estimate("all_reduce", [0, 2], nbytes=MIB) == slow.estimate("all_reduce", group=[0, 2], nbytes=MIB)
    assert net.estimate("all_reduce", [0, 4], nbytes=MIB) == fast.estimate("all_reduce", group=[0, 4], nbytes=MIB)
    assert net.estimate("all_reduce", [2, 3], nbytes=MIB) == fast.estimate("all_reduce", group=[2, 3], nbytes=MIB)
    assert us(slow, "all_reduce", [0, 2]) > us(fast, "all_reduce", [0, 2])
    assert SlowNics(NetworkModel(topo), every=2.0).factor([4, 6]) == 2.0
    with pytest.raises(ValueError, match="exactly one"):
        SlowNics(NetworkModel(topo))


@pytest.mark.parametrize("node", [0, 1])
def test_a_slow_node_in_a_data_parallel_group(tmp_path, node):
    # TP2 DP2 on two 2-GPU nodes: each TP group on a node (NVLink), both DP groups across the two.
    # Either node's NICs twice slower: the gradient reduce-scatter (at the step's end) and the
    # parameter all-gather run at its pace, nothing else moves.
    topo = topology(gpus_per_node=2)
    w = make_workload(tp=2, pp=1, dp=2, global_batch=4)
    ideal = simulate(tmp_path, w, topo, "ideal")["step_time_s"]
    fast, slow = NetworkModel(topo), slower(topo, 2.0)
    extra = sum(us(slow, op, [0, 2]) - us(fast, op, [0, 2]) for op in ("reduce_scatter", "all_gather")) / 1e6
    assert extra > 0
    for mode in ("symmetric", "full"):
        s = simulate(tmp_path, w, topo, f"{mode}{node}", mode=mode, slow_nodes={node: 2.0})
        assert s["step_time_s"] == pytest.approx(ideal + extra, rel=1e-9), mode


def test_a_slow_node_in_a_tensor_parallel_group(tmp_path):
    # TP2 over two 1-GPU nodes, DP1, two micro-batches: four TP all-reduces (each forward and
    # backward) cross the slow NIC; the DP groups have one rank and move nothing
    topo = topology(gpus_per_node=1)
    w = make_workload(tp=2, pp=1, dp=1, global_batch=2)
    ideal = simulate(tmp_path, w, topo, "ideal")["step_time_s"]
    extra = 4 * (us(slower(topo, 1.5), "all_reduce", [0, 1]) - us(NetworkModel(topo), "all_reduce", [0, 1])) / 1e6
    for mode in ("symmetric", "full"):
        s = simulate(tmp_path, w, topo, mode, mode=mode, slow_nodes={1: 1.5})
        assert s["step_time_s"] == pytest.approx(ideal + extra, rel=1e-9), mode


@pytest.mark.parametrize("node", [0, 1])
def test_a_slow_node_in_a_pipeline(tmp_path, node):
    # PP2 TP2 DP1, one stage a node: one micro-batch's activation (forward) and gradient
    # (backward) each cross the slow NIC once, in the step's critical path
    topo = topology(gpus_per_node=2)
    w = make_workload(tp=2, pp=2, dp=1, global_batch=1)
    ideal = simulate(tmp_path, w, topo, "ideal")["step_time_s"]
    extra = 2 * (us(slower(topo, 2.0), "send", [0, 2]) - us(NetworkModel(topo), "send", [0, 2])) / 1e6
    for mode in ("symmetric", "full"):
        s = simulate(tmp_path, w, topo, f"{mode}{node}", mode=mode, slow_nodes={node: 2.0})
        assert s["step_time_s"] == pytest.approx(ideal + extra, rel=1e-9), mode


def test_a_job_inside_one_node_never_sees_a_slow_nic(tmp_path):
    topo = topology(gpus_per_node=8)
    w = make_workload(tp=2, pp=2, dp=2)
    ideal = simulate(tmp_path, w, topo, "ideal")["step_time_s"]
    assert simulate(tmp_path, w, topo, "slow", slow_nodes={0: 3.0})["step_time_s"] == ideal


def test_slow_nodes_are_checked():
    nodes = topology(gpus_per_node=2).nodes(8)
    assert nodes == 4 and topology(gpus_per_node=8).nodes(2) == 1
    assert check_slow_nodes({1: 2.0}, nodes=nodes, node_ranks=2) == {1: 2.0}
    with pytest.raises(ValueError, match="node 4 is not in the job"):
        check_slow_nodes({4: 2.0}, nodes=nodes, node_ranks=2)
    with pytest.raises(ValueError, match="must be > 0"):
        check_slow_nodes({0: 0.0}, nodes=nodes, node_ranks=2)
    # ranks 0-3 on stage 0, 4-7 on stage 1, two a node: node 1 holds stage 0's ranks 2 and 3, node 3
    # stage 1's 6 and 7; in symmetric mode every rank of either stage is slow at its node's factor
    assert slow_stage_ranks({1: 1.5, 3: 1.2}, {r: r // 4 for r in range(8)}, 2) == \
        {0: 1.5, 1: 1.5, 2: 1.5, 3: 1.5, 4: 1.2, 5: 1.2, 6: 1.2, 7: 1.2}


SIGMA = 0.05


def test_the_spread_quantiles_against_sampled_nodes(tmp_path):
    """Each node's NICs at 1 + sigma z of the fitted bandwidth: full mode samples every node, the
    step runs at the slowest node's pace (one pipeline stage: every DP ring spans every node), and
    the symmetric quantiles are the step at the slowest node's quantiles."""
    base = topology(gpus_per_node=2)
    spread = base.model_copy(update={"link_variability": LinkVariability(
        nic_bw_sigma=Figure(value=SIGMA, status="assumed", basis="test"))})
    w = make_workload(tp=2, pp=1, dp=8, global_batch=8)
    nodes = 8
    sym = simulate(tmp_path, w, spread, "sym")
    assert sym["nic_sigma"] == SIGMA
    assert sym["step_time_s"] < sym["step_link_p50_s"] < sym["step_link_p90_s"] < sym["step_link_p99_s"]
    f50 = quantile_factors(SIGMA, nodes)[0.5]
    assert f50 == pytest.approx(1 / (1 - SIGMA * quantile_max_normal(nodes, 0.5)))
    assert sym["step_link_p50_s"] == pytest.approx(simulate(tmp_path, w, base, "at_p50", slow_nodes={3: f50})["step_time_s"])
    full = []
    for i in range(30):
        rng = random.Random(i)
        factors = {n: 1 / (1 + SIGMA * rng.gauss(0.0, 1.0)) for n in range(nodes)}
        step = simulate(tmp_path, w, base, f"full{i}", mode="full", slow_nodes=factors, summary_only=True)["step_time_s"]
        # the sample steps as its slowest node, whichever it is
        worst = max(factors.values())
        assert step == pytest.approx(simulate(tmp_path, w, base, f"worst{i}", slow_nodes={0: worst},
                                              summary_only=True)["step_time_s"], rel=1e-9)
        full.append(step)
    assert float(np.quantile(full, 0.5)) == pytest.approx(sym["step_link_p50_s"], rel=0.02)
    alike = simulate(tmp_path, w, base, "alike")
    assert alike["nic_sigma"] == 0.0 and alike["step_link_p99_s"] == alike["step_time_s"]


def test_the_simulate_command_parses_slow_nodes():
    from echo.cli import build_parser

    args = build_parser().parse_args(["simulate", "--workload", "w", "--hardware", "h", "--topology", "t",
                                      "--slow-node", "3:2", "--slow-node", "0:1.25"])
    assert args.slow_node == [(3, 2.0), (0, 1.25)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--workload", "w", "--hardware", "h", "--topology", "t",
                                   "--slow-node", "3"])
