"""Expert-parallel all-to-all overlap (parallel.ep_comm_overlap, Megatron-Core's combined 1F1B):
a combined program worked out by hand, the orders it needs, the config checks, and symmetric
against full mode on a real MoE trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_simulate import check_split, compute, recv, send
from test_simulate_modes import assert_same, traced
from test_simulate_overlap_flags import _simulate

from echo.config import parse_workload
from echo.errors import ConfigError
from echo.simulate import EngineOptions, Op, Program, RankCosts, simulate
from echo.simulate.overlaps import combined, ep_pairs, is_second
from echo.training.schedule import combine_steady_state, in_flight, orders_of, stage_orders


def a2a(seq: int, us: float) -> Op:
    """An expert-parallel all-to-all as the trace records it: blocking, on the compute stream."""
    return Op(seq, "collective", "compute", us, blocking=True, comm_kind="ep", op="all_to_all", group=(0, 1),
              nbytes=1 << 20, link="nvlink")


def moe_pass(attn: float, a2a_us: float, mlp: float, tail: float, backward: bool) -> Program:
    """One layer's pass: forward attention, dispatch, experts, combine, tail; a backward runs the
    same pieces in reverse (its combine's all-to-all first)."""
    if backward:
        return Program([compute(0, tail), a2a(1, a2a_us), compute(2, mlp), a2a(3, a2a_us), compute(4, attn)])
    return Program([compute(0, attn), a2a(1, a2a_us), compute(2, mlp), a2a(3, a2a_us), compute(4, tail)])


def test_combined_hides_each_all_to_all_behind_the_other_pass():
    """Backward first: its combine (6) runs beside the forward's attention (10), the forward's
    dispatch beside the backward's experts (20), the backward's dispatch beside the forward's
    experts (10), the forward's combine beside the backward's attention (20): every all-to-all is
    hidden and the pair takes its compute, 1 + 10 + 20 + 10 + 20 + 2 = 63 us, where one after the
    other takes 34 + 53 = 87 us."""
    fwd, bwd = moe_pass(10, 6, 10, 2, backward=False), moe_pass(20, 6, 20, 1, backward=True)
    assert fwd.cost.duration_us + bwd.cost.duration_us == pytest.approx(87.0)
    both = combined(fwd, bwd)
    assert both.cost.duration_us == pytest.approx(63.0)
    assert both.cost.exposed("ep") == pytest.approx(0.0)
    assert both.cost.compute_us == pytest.approx(63.0)
    assert sorted(op.seq >= 1 << 40 for op in both.ops) == [False] * 5 + [True] * 5
    assert [is_second(op) for op in both.ops[:2]] == [True, True]  # the backward starts


def test_combined_exposes_what_the_other_pass_cannot_cover():
    """All-to-alls of 30 us against 1-20 us of compute: the pair waits on them, but less than the
    two passes one after the other (each all-to-all exposed whole there)."""
    fwd, bwd = moe_pass(10, 30, 10, 2, backward=False), moe_pass(20, 30, 20, 1, backward=True)
    both = combined(fwd, bwd)
    alone = fwd.cost.duration_us + bwd.cost.duration_us
    assert alone == pytest.approx(63.0 + 4 * 30)
    assert 63.0 + 30 < both.cost.duration_us < alone
    assert both.cost.duration_us == pytest.approx(both.cost.compute_us + both.cost.exposed("ep"))


def test_passes_keep_their_recvs_and_sends():
    """A combined program receives the backward's gradient and the forward's activation, in that
    order, and sends both; which send is whose is told by ``is_second``."""
    fwd = Program([recv(0, "fwd"), compute(1, 5), a2a(2, 3), compute(3, 5), send(4, 1, "fwd")])
    bwd = Program([recv(0, "bwd"), compute(1, 5), a2a(2, 3), compute(3, 5), send(4, 1, "bwd")])
    both = combined(fwd, bwd)
    recvs = [op for op in both.ops if op.op == "recv"]
    assert [r.stream for r in recvs] == ["p2p_bwd", "p2p_fwd"] and both.recvs == 2
    assert {op.stream: is_second(op) for op in both.ops if op.op == "send"} == {"p2p_fwd": False, "p2p_bwd": True}


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 1, 6, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                                            ("interleaved", 2, 4, 4)])
def test_orders_warm_up_one_more_and_pair_independent_passes(schedule, p, m, v):
    base = stage_orders(schedule, p, m, v)
    more = stage_orders(schedule, p, m, v, extra_warmup=1)
    for b, o in zip(base, more, strict=True):
        assert sorted(map(str, b)) == sorted(map(str, o))  # every pass once
        lead = lambda order: next(i for i, t in enumerate(order) if t.kind == "B")  # noqa: E731
        assert lead(o) == min(lead(b) + 1, len([t for t in b if t.kind == "F"]))
    last = combine_steady_state(more[-1])  # the last stage: no pair holds a forward and its own backward
    pairs = ep_pairs(last, lambda t: moe_pass(1, 1, 1, 1, t.kind == "B"), {})
    assert pairs and all((last[i].microbatch, last[i].chunk) != (last[i + 1].microbatch, last[i + 1].chunk)
                         for i in pairs)
    # a combined pair's backward frees its layers while its forward fills its own: the extra
    # warm-up forward does not raise the peak of chunk-micro-batches held
    for b, o in zip(base, more, strict=True):
        assert in_flight(combine_steady_state(o)) == in_flight(b)


def moe_pipeline(p: int, v: int, a2a_us: float) -> list[RankCosts]:
    """p stages of v chunks of one MoE layer each, receiving and sending as the trace records it."""
    out = []
    for s in range(p):
        fwd, bwd = [], []
        for c in range(v):
            k = c * p + s
            f = [recv(10, "fwd")] * (k > 0) + list(moe_pass(10, a2a_us, 10, 2, False).ops)
            b = [recv(10, "bwd")] * (k < p * v - 1) + list(moe_pass(20, a2a_us, 20, 1, True).ops)
            fwd.append(Program(f + [send(11, 0, "fwd")] * (k < p * v - 1)))
            bwd.append(Program(b + [send(11, 0, "bwd")] * (k > 0)))
        out.append(RankCosts(forward=tuple(fwd), backward=tuple(bwd)))
    return out


@pytest.mark.parametrize("p,v,m", [(1, 1, 8), (2, 2, 8), (4, 2, 16), (4, 4, 8)])
def test_the_pipeline_runs_faster_combined_and_accounts_for_every_microsecond(p, v, m):
    costs = moe_pipeline(p, v, 6.0)
    schedule = {"schedule": "interleaved", "virtual_stages": v} if p > 1 else {}
    w = parse_workload({
        "model": {"arch": "llama", "layers": 16, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                  "experts": 4, "top_k": 2},
        "parallel": {"pp": p, "dp": 2, "ep": 2, "ep_comm_overlap": True, **schedule},
        "training": {"global_batch": 2 * m, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}},
        Path("config/workloads/ep.yaml"))
    off = simulate(costs, stage_orders(w.parallel.schedule, p, m, v))
    on = simulate(costs, orders_of(w.parallel, m), EngineOptions(ep_comm_overlap=True))
    check_split(on)
    assert on.step_us < off.step_us
    assert sum(st.exposed("ep") for st in on.stages) < sum(st.exposed("ep") for st in off.stages)
    assert len([e for e in on.events if e.stream == "compute"]) == len([e for e in off.events if e.stream == "compute"])


@pytest.mark.parametrize("par,why", [({"ep": 1}, "ep > 1"), ({"pp": 2}, "interleaved")])
def test_ep_overlap_refusals_name_the_key(par, why):
    with pytest.raises(ConfigError) as err:
        parse_workload({
            "model": {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                      "experts": 4, "top_k": 2},
            "parallel": {"dp": 2, "ep": 2, "ep_comm_overlap": True, **par},
            "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}},
            Path("config/workloads/ep.yaml"))
    assert "parallel.ep_comm_overlap" in str(err.value) and why in str(err.value)


@pytest.fixture(scope="module")
def moe_trace(tmp_path_factory):
    """A small MoE Llama traced for real: PP2 x DP2, EP2, interleaved, expert all-to-alls overlapped."""
    return traced(tmp_path_factory.mktemp("moe"), {
        "model": {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                  "experts": 4, "top_k": 2},
        "parallel": {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "zero": 1, "schedule": "interleaved", "virtual_stages": 2,
                     "ep_comm_overlap": True},
        "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}, "moe-4")


@pytest.mark.slow
def test_ep_overlap_on_a_real_trace_agrees_across_modes(moe_trace):
    w, root = moe_trace
    on = {mode: _simulate(w, root, f"on-{mode}", mode=mode) for mode in ("symmetric", "full")}
    assert_same(on["symmetric"], on["full"])
    assert on["symmetric"]["ep_comm_overlap"] is True
    off = _simulate(w, root, "off", options=EngineOptions())
    assert on["symmetric"]["exposed_ep_s"] < off["exposed_ep_s"]
    assert on["symmetric"]["executed_flops"] == off["executed_flops"]
