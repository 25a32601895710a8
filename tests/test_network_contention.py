"""Overlapping transfers share links max-min fairly (echo.network.contention)."""

from __future__ import annotations

import pytest

from echo.config import load_topology
from echo.network import NetworkModel
from echo.network.contention import Flow, max_min_rates, simulate_flows

GIB, MIB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def a100() -> NetworkModel:
    return NetworkModel(load_topology("dgx-a100-hdr"))


def test_alone_a_transfer_takes_its_estimate(a100):
    for op, group, nbytes in [("all_reduce", range(16), GIB), ("all_gather", range(8), 64 * MIB),
                              ("send", [0, 8], MIB), ("all_to_all", range(32), GIB), ("all_reduce", [3], GIB)]:
        (alone,) = a100.concurrent([(op, group, nbytes)])
        assert alone == pytest.approx(a100.estimate(op, list(group), nbytes=nbytes).time_us)


def test_two_all_reduces_sharing_the_nics_take_twice_as_long(a100):
    """Two data-parallel all-reduces over the same two nodes' NICs (e.g. two model chunks'
    gradients reduced at once): each gets half of every NIC."""
    alone = a100.estimate("all_reduce", list(range(16)), nbytes=GIB).time_us
    both = a100.concurrent([("all_reduce", range(16), GIB), ("all_reduce", range(16), GIB)])
    for t in both:
        assert 1.9 * alone <= t <= 2.0 * alone  # twice the data time, the latency once


def test_all_reduces_on_other_nodes_or_other_rails_do_not_slow(a100):
    alone = a100.estimate("all_reduce", list(range(16)), nbytes=GIB).time_us
    assert a100.concurrent([("all_reduce", range(16), GIB), ("all_reduce", range(16, 32), GIB)]) == [
        pytest.approx(alone)] * 2
    # one GPU per node on different rails (GPU 0 and GPU 1 of each node own different NICs)
    rail0, rail1 = [0, 8, 16, 24], [1, 9, 17, 25]
    t0 = a100.estimate("all_reduce", rail0, nbytes=GIB).time_us
    assert a100.concurrent([("all_reduce", rail0, GIB), ("all_reduce", rail1, GIB)]) == [pytest.approx(t0)] * 2


def test_pipeline_send_beside_a_gradient_reduction(a100):
    """A send 0 -> 8 shares GPU 0's and GPU 8's NICs with an all-reduce over both nodes: while both
    run, each gets half of those NICs (a ring is as fast as its slowest link), so the send takes
    about twice as long and the all-reduce loses about the send's own time."""
    ar = a100.estimate("all_reduce", list(range(16)), nbytes=GIB).time_us
    send = a100.estimate("send", [0, 8], nbytes=32 * MIB).time_us
    t_ar, t_send = a100.concurrent([("all_reduce", range(16), GIB), ("send", [0, 8], 32 * MIB)])
    assert 1.8 * send < t_send <= 2.0 * send
    assert t_ar == pytest.approx(ar + send, rel=0.02)
    # a recv on [8, 0] is the same transfer seen from GPU 8
    assert a100.concurrent([("all_reduce", range(16), GIB), ("recv", [8, 0], 32 * MIB)]) == pytest.approx(
        [t_ar, t_send])
    # two sends in opposite directions over the same pair use different directions: no slowdown
    assert a100.concurrent([("send", [0, 8], 32 * MIB), ("send", [8, 0], 32 * MIB)]) == [pytest.approx(send)] * 2


def test_tensor_parallel_all_reduces_inside_different_nodes_do_not_interact(a100):
    alone = a100.estimate("all_reduce", list(range(8)), nbytes=GIB).time_us
    assert a100.concurrent([("all_reduce", range(8), GIB), ("all_reduce", range(8, 16), GIB)]) == [
        pytest.approx(alone)] * 2


def test_a_later_start_after_the_first_finished_runs_alone(a100):
    alone = a100.estimate("all_reduce", list(range(16)), nbytes=GIB).time_us
    assert a100.concurrent([("all_reduce", range(16), GIB)] * 2, starts_us=[0.0, alone]) == [
        pytest.approx(alone)] * 2
    # half-overlapping: the second waits for part of the first's bandwidth only
    t0, t1 = a100.concurrent([("all_reduce", range(16), GIB)] * 2, starts_us=[0.0, alone / 2])
    assert alone < t0 < 2 * alone and alone < t1 < 2 * alone


def test_small_messages_are_latency_bound_and_barely_interact(a100):
    alone = a100.estimate("all_reduce", list(range(16)), nbytes=8 << 10).time_us
    both = a100.concurrent([("all_reduce", range(16), 8 << 10)] * 2)
    assert all(t < 1.05 * alone for t in both)


def test_max_min_rates_are_fair_in_bytes():
    # one link; a flow that needs it all and one that needs half: the small one gets its fill
    assert max_min_rates([{"l": 1.0}, {"l": 0.5}]) == pytest.approx([0.5, 1.0])
    # three equal flows on one link: a third each
    assert max_min_rates([{"l": 1.0}] * 3) == pytest.approx([1 / 3] * 3)
    # A on links x and y; B on x; C on y: x is the bottleneck of A and B, C takes what y has left
    assert max_min_rates([{"x": 1.0, "y": 0.2}, {"x": 0.5}, {"y": 1.0}]) == pytest.approx([0.5, 1.0, 0.9])
    assert max_min_rates([{}, {"x": 0.3}]) == pytest.approx([1.0, 1.0])


def test_simulate_flows_conserves_work():
    flows = [Flow(10.0, 100.0, {"l": 1.0}), Flow(0.0, 50.0, {"l": 1.0})]
    # B runs alone for 10 us (to 10), then both share: B's 40 left take 80, A then has 60 left alone
    assert simulate_flows(flows, [0.0, 0.0]) == pytest.approx([150.0, 90.0])


def test_flow_loads_follow_the_chosen_algorithm(a100):
    ring = a100.flow("all_reduce", range(16), GIB)
    assert ring.loads[("nic", 0, "tx")] == pytest.approx(1.0, abs=0.01)  # NIC-bound: its NICs are full
    assert ring.loads[("nic", 15, "rx")] == pytest.approx(1.0, abs=0.01)
    inside = a100.flow("all_reduce", range(8), GIB)
    assert not any(r[0] == "nic" for r in inside.loads) and inside.loads[("nvlink", 3, "tx")] > 0.9
    send = a100.flow("send", [0, 8], GIB)
    assert set(send.loads) == {("nic", 0, "tx"), ("nic", 8, "rx")}
    with pytest.raises(ValueError, match="group of \\[self, peer\\]"):
        a100.flow("send", [0, 1, 2], GIB)
    with pytest.raises(ValueError, match="start times"):
        a100.concurrent([("send", [0, 8], GIB)], starts_us=[0.0, 1.0])
