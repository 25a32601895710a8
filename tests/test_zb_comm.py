"""The zero-bubble runtime's batched transfers (echo.training.zb_comm, EngineOptions.batched_sends):
which sends a receiving pass waits for, worked by hand, and the engines' waits."""

from __future__ import annotations

import pytest
from test_simulate import compute, recv, send

from echo.simulate import EngineOptions, Program, RankCosts, simulate
from echo.training.schedule import BATCHED_SENDS, stage_orders
from echo.training.zb_auto import PassTimes
from echo.training.zb_comm import batch_waits


def test_batches_as_the_runtime_plans_them_by_hand():
    """ZB-H1, 2 stages, 3 micro-batches, F = B = 10, W = 5, a transfer 1. The plan (pass level):
    stage 0 F0 0-10, F1 10-20, B0 32-42 (stage 1's B0 ends at 31, + 1), W0, F2 47-57, B1 57-67 ...;
    stage 1 F0 11-21, B0 21-31, F1 31-41, B1 41-51, W0, F2 58-68 ...
    Stage 0's nodes by time: F0, SEND F0 (10), F1, SEND F1 (20), RECV B0 (31), B0, W0, F2 (47-57),
    RECV B1 (51), SEND F2 (57), B1 ...; RECV B1 falls inside F2 and moves ahead of it. Batches:
    {SEND F0} (a compute follows), {SEND F1, RECV B0} (flushed at B0's receive), {RECV B1},
    {SEND F2}, {RECV B2}: B0 (position 2) waits for F1's send (position 1). Stage 1: RECV F1 (20)
    falls inside F0 (11-21) and moves ahead of it; every receive there is batched without a send."""
    orders = stage_orders("zb-h1", 2, 3)
    assert [t.kind + str(t.microbatch) for t in orders[0][:3]] == ["F0", "F1", "B0"]
    times = [[PassTimes(10.0, 10.0, 5.0, 1.0)] for _ in range(2)]
    assert batch_waits(orders, times) == [{2: (1,)}, {}]


def _two_stages(send_fwd: float, send_bwd: float) -> list[RankCosts]:
    """2 stages, F = B = 10, W = 5; stage 0 sends activations in send_fwd, stage 1 gradients in send_bwd."""
    f0 = Program([compute(1, 10.0), send(2, send_fwd, "fwd")])
    b0 = Program([recv(0, "bwd"), compute(1, 10.0)])
    f1 = Program([recv(0, "fwd"), compute(1, 10.0)])
    b1 = Program([compute(1, 10.0), send(3, send_bwd, "bwd")])
    w = Program([compute(2, 5.0)])
    return [RankCosts(forward=(f,), backward=(Program([*b.ops, *w.ops]),), input_grad=(b,), weight_grad=(w,),
                      w_pending_bytes=(1.0,)) for f, b in ((f0, b0), (f1, b1))]


def test_a_receiving_task_waits_for_the_sends_of_its_batch():
    """The case above with slow activation transfers (30) and fast gradients (1). The plan (transfer
    time 30 into stage 1, 1 into stage 0) batches stage 0's B0 receive with F1's send again.
    Replayed: F0's send runs 10-40, F1's queues behind it, 40-70; stage 1 runs F0 40-50, B0 50-60 and
    its gradient arrives at 61. Unbatched, B0 starts at 61; batched, it waits for F1's send: 70."""
    costs = _two_stages(30.0, 1.0)
    orders = stage_orders("zb-h1", 2, 3)
    times = [[PassTimes(10.0, 10.0, 5.0, 30.0)], [PassTimes(10.0, 10.0, 5.0, 1.0)]]
    assert batch_waits(orders, times) == [{2: (1,)}, {}]

    def b0_start(batched: bool) -> float:
        r = simulate(costs, orders, EngineOptions(batched_sends=batched))
        return next(e.start_us for e in r.events if e.stage == 0 and e.kind == "backward" and e.microbatch == 0)

    assert b0_start(False) == pytest.approx(61.0)
    assert b0_start(True) == pytest.approx(70.0)


def test_only_the_zero_bubble_runtime_batches():
    """Orders without W tasks (Megatron's 1F1B, interleaving) are not the zero-bubble runtime's."""
    assert set(BATCHED_SENDS) == {"zb-h1", "zb-h2", "zb-2p", "zb-v"}
    costs = _two_stages(30.0, 1.0)
    orders = stage_orders("1f1b", 2, 3)
    on = simulate(costs, orders, EngineOptions(batched_sends=True))
    off = simulate(costs, orders, EngineOptions())
    assert on.step_us == off.step_us
