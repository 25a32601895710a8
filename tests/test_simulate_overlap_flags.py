"""The workload's overlap flags (parallel.overlap_grad_reduce, overlap_param_gather,
tp_comm_overlap): hand-built programs whose answers can be worked out, the config checks, and
symmetric against full mode on a real sequence-parallel trace."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_simulate import HARDWARE, check_split, compute, pipeline, topology
from test_simulate_modes import SLOW, assert_same, traced

from echo.config import parse_workload
from echo.errors import ConfigError
from echo.simulate import EngineOptions, Op, Program, RankCosts, simulate
from echo.simulate.overlaps import _tp_pairs, tp_overlap_time, with_param_gather, with_tp_overlap
from echo.training.schedule import stage_orders

TP4 = (0, 1, 2, 3)


def gemm(seq: int, us: float, s: float = 0.0) -> Op:
    return Op(seq, "compute", "compute", us, slowdown=s, op_class="gemm")


def other(seq: int, us: float, kind: str = "compute") -> Op:
    return Op(seq, kind, "compute", us, op_class="elementwise" if kind == "compute" else "copy")


def tp_coll(seq: int, op: str, us: float) -> Op:
    return Op(seq, "collective", "compute", us, blocking=True, comm_kind="tp", op=op, group=TP4, nbytes=1 << 20,
              link="nvlink")


def gather(seq: int, us: float, nbytes: int = 100) -> Op:
    """A parameter all-gather bucket as the trace records it: non-blocking, comm stream, phase optimizer."""
    return Op(seq, "collective", "comm", us, comm_kind="dp", op="all_gather", group=(0, 4), nbytes=nbytes)


# --- TP communication overlap ----------------------------------------------------------------------
def test_tp_overlap_time_formula():
    # C = 100, G = 60 on tp 4 without slowdown: max + min / tp
    assert tp_overlap_time(100.0, 60.0, 0.0, 4) == pytest.approx((115.0, 60.0))
    # s = 0.5: the GEMM runs at 2/3 speed beside the transfer: 60 + (1/3) min(100, 90) = 90
    assert tp_overlap_time(100.0, 60.0, 0.5, 4) == pytest.approx((122.5, 90.0))
    # GEMM-bound: only a chunk of the transfer is exposed, the GEMM slowed for the transfer's 20 us
    total, slowed = tp_overlap_time(20.0, 200.0, 0.5, 2)
    assert slowed == pytest.approx(200.0 + 20.0 / 3) and total == pytest.approx(slowed + 10.0)


def test_tp_pairs_follow_consumer_and_producer():
    # forward: AG -> QKV GEMM, attention, proj GEMM, copy -> RS; an embedding RS with no GEMM beside it
    fwd = [other(0, 5.0), tp_coll(1, "reduce_scatter", 10.0), other(2, 1.0), tp_coll(3, "all_gather", 10.0),
           gemm(4, 50.0), other(5, 20.0), gemm(6, 30.0), other(7, 2.0, "memcpy"), tp_coll(8, "reduce_scatter", 10.0)]
    assert _tp_pairs(fwd) == {3: 4, 8: 6}
    # backward: the re-gathered input's AG overlaps the data-gradient GEMM, whose RS then goes with
    # the weight-gradient GEMM after it
    bwd = [tp_coll(0, "all_gather", 10.0), gemm(1, 40.0), other(2, 2.0, "memcpy"), tp_coll(3, "reduce_scatter", 10.0),
           gemm(4, 40.0)]
    assert _tp_pairs(bwd) == {0: 1, 3: 4}


def test_tp_comm_overlap_step_between_max_and_sum():
    # One stage, one micro-batch. Forward: AG 100 -> GEMM 60 (s 0.5), elementwise 10, GEMM 40
    # (s 0.5) -> RS 80, tp 4. Pairs: 100 + 90 / 4 = 122.5 (GEMM 90) and 80 + 60 / 4 = 95 (GEMM 60):
    # forward 227.5, of it compute 90 + 10 + 60 = 160 (50 of slowdown) and exposed tp 67.5.
    fwd = Program([tp_coll(0, "all_gather", 100.0), gemm(1, 60.0, 0.5), other(2, 10.0), gemm(3, 40.0, 0.5),
                   tp_coll(4, "reduce_scatter", 80.0)])
    costs = [RankCosts(forward=(fwd,), backward=(Program([other(10, 1.0)]),))]
    plain = simulate(costs, stage_orders("1f1b", 1, 1))
    over = simulate(costs, stage_orders("1f1b", 1, 1), EngineOptions(tp_comm_overlap=True))
    comm, comp = 180.0, 110.0
    assert plain.step_us == pytest.approx(comm + comp + 1.0)
    assert over.step_us == pytest.approx(227.5 + 1.0)
    assert max(comm, comp) + 1.0 < over.step_us < plain.step_us
    st = over.stages[0]
    assert st.compute_us == pytest.approx(161.0) and st.slowdown_us == pytest.approx(50.0)
    assert st.exposed("tp") == pytest.approx(67.5)
    check_split(over)
    # the transformation leaves the collective in place (its rendezvous) and keeps unpaired ops
    prog = with_tp_overlap(fwd)
    assert [op.op or op.op_class for op in prog.ops] == ["all_gather", "gemm", "elementwise", "gemm", "reduce_scatter"]
    assert [op.duration_us for op in prog.ops] == pytest.approx([32.5, 90.0, 10.0, 60.0, 35.0])


# --- parameter all-gather overlap ----------------------------------------------------------------
def param_stage(forward_ops: int = 10, buckets=(30.0, 30.0, 30.0, 30.0)) -> RankCosts:
    """One stage: forward of 10 x 100 us, backward 2000 us, optimizer 50 us then the all-gathers."""
    base = pipeline(1, 1000.0, 2000.0, optimizer=50.0)[0]
    fwd = Program([compute(100 + i, 1000.0 / forward_ops) for i in range(forward_ops)])
    opt = Program([compute(200, 50.0), *(gather(300 + i, us) for i, us in enumerate(buckets))])
    return RankCosts(forward=(fwd,), backward=base.backward, grad_sync=base.grad_sync, optimizer=opt)


def test_param_gather_overlap_leaves_at_most_the_first_bucket_exposed():
    # 8 micro-batches; 4 equal buckets of 30 us. Without overlap they follow the optimizer (120 us
    # exposed). With it they run beside the first forward: the forward waits for the first bucket
    # (30 us) before its first kernel; bucket k is needed at k/4 of the forward (250, 500, 750 us of
    # work), long after it arrived (60, 90, 120 us).
    m = 8
    costs = [param_stage()]
    plain = simulate(costs, stage_orders("1f1b", 1, m))
    over = simulate(costs, stage_orders("1f1b", 1, m), EngineOptions(overlap_param_gather=True))
    assert plain.stages[0].exposed("dp") == pytest.approx(120.0)
    assert plain.step_us == pytest.approx(m * 3000.0 + 50.0 + 120.0)
    assert over.stages[0].exposed("dp") <= 30.0 + 1e-9
    assert over.step_us == pytest.approx(30.0 + m * 3000.0 + 50.0)
    check_split(over)
    gathers = sorted(x for e in over.events if e.name.startswith("param_gather") for x in (e.start_us, e.end_us))
    assert gathers == pytest.approx([0, 30, 30, 60, 60, 90, 90, 120])


def test_param_gather_waits_where_the_forward_needs_the_bucket():
    # 4 buckets of 300 us, arriving at 300, 600, 900, 1200. The forward (10 kernels of 100 us)
    # waits 300 for the first; the second is needed in the kernel holding 250 us of work (its
    # third, reached at 500: waits 100); the third at 500 us of work (the sixth kernel, reached at
    # 900: no wait); the fourth at 750 (the eighth, reached at 1100: waits 100).
    costs = [param_stage(buckets=(300.0,) * 4)]
    r = simulate(costs, stage_orders("1f1b", 1, 1), EngineOptions(overlap_param_gather=True))
    assert r.stages[0].exposed("dp") == pytest.approx(300.0 + 100.0 + 100.0)
    assert r.step_us == pytest.approx(1500.0 + 2000.0 + 50.0)
    check_split(r)


def test_param_gather_buckets_go_to_their_chunks():
    # Two chunks: buckets filled in backward order (the last chunk's first), so the first two
    # buckets of the optimizer belong to chunk 1, the last two to chunk 0 (whose first one is
    # needed at once).
    fwd = (Program([compute(1, 10.0)]), Program([compute(2, 10.0)]))
    opt = Program([compute(200, 5.0), *(gather(300 + i, 1.0) for i in range(4))])
    firsts, rest = with_param_gather(fwd, opt)
    assert [op.seq for op in rest.ops] == [200]
    assert [[op.seq for op in p.ops if op.kind == "collective"] for p in firsts] == [[303, 302], [301, 300]]
    assert firsts[0].waits == {1: (303, 302)} and firsts[1].waits == {2: (301, 300)}
    assert all(not op.blocking and op.stream == "comm" for p in firsts for op in p.ops if op.kind == "collective")


# --- the workload keys ---------------------------------------------------------------------------
def workload(**par):
    return parse_workload({
        "model": {"arch": "gpt", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
        "parallel": {"tp": 2, "pp": 1, "dp": 2, "zero": 1, "sequence_parallel": True, **par},
        "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}},
        Path("config/workloads/flags.yaml"))


@pytest.mark.parametrize("par,key,why", [
    ({"overlap_param_gather": True, "zero": 0}, "parallel.overlap_param_gather", "zero 1 or 2"),
    ({"overlap_param_gather": True, "zero": 3}, "parallel.overlap_param_gather", "zero 1 or 2"),
    ({"overlap_param_gather": True, "dp": 1}, "parallel.overlap_param_gather", "data parallelism"),
    ({"tp_comm_overlap": True, "sequence_parallel": False}, "parallel.tp_comm_overlap", "sequence_parallel"),
    ({"tp_comm_overlap": True, "tp": 1, "sequence_parallel": False}, "parallel.tp_comm_overlap", "tp > 1"),
])
def test_contradicting_flags_are_refused_naming_the_key(par, key, why):
    with pytest.raises(ConfigError) as err:
        workload(**par)
    assert key in str(err.value) and why in str(err.value) and "flags.yaml" in str(err.value)


def test_flags_are_simulation_only():
    on = workload(overlap_grad_reduce=True, overlap_param_gather=True, tp_comm_overlap=True)
    off = workload()
    assert on.parallel.tp_comm_overlap and not off.parallel.tp_comm_overlap
    assert on.trace_dump() == off.trace_dump()  # what trace and dedup see: no re-trace when flipped
    assert on.model_dump() != off.model_dump()  # what simulate sees
    with pytest.raises(ConfigError, match="parallel.tp_comm_overlap"):
        workload(tp_comm_overlap="yes")  # strict: a bool


# --- a real sequence-parallel trace, both modes ------------------------------------------------------
@pytest.fixture(scope="module")
def sp_trace(tmp_path_factory):
    """A small GPT traced for real: TP2 PP2 DP2 (8 ranks), sequence parallel, interleaved, ZeRO 1."""
    return traced(tmp_path_factory.mktemp("sp"), {
        "model": {"arch": "gpt", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
        "parallel": {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "sequence_parallel": True, "schedule": "interleaved",
                     "virtual_stages": 2, "overlap_grad_reduce": True, "overlap_param_gather": True,
                     "tp_comm_overlap": True},
        "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}, "sp-8")


def _simulate(w, root, out, **kw):
    from echo.network import NetworkModel
    from echo.simulate import run_simulate

    topo = topology(2)  # TP pairs on a node; pipeline and data-parallel traffic over the NIC
    return run_simulate(w, HARDWARE, topo, root / "trace", root / "rank_classes.parquet", root / "kernels.parquet",
                        root, root / out, network=NetworkModel(topo), overlap=SLOW, **kw).to_pylist()[0]


def test_flags_on_a_real_trace_agree_across_modes(sp_trace):
    w, root = sp_trace
    flags = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap")
    on = {mode: _simulate(w, root, f"on-{mode}", mode=mode) for mode in ("symmetric", "full")}
    assert_same(on["symmetric"], on["full"])
    assert all(on["symmetric"][f] is True for f in flags)  # read from the workload, reported in the summary
    off = {mode: _simulate(w, root, f"off-{mode}", mode=mode, options=EngineOptions())
           for mode in ("symmetric", "full")}
    assert_same(off["symmetric"], off["full"])
    assert all(off["symmetric"][f] is False for f in flags)
    s_on, s_off = on["symmetric"], off["symmetric"]
    assert s_on["exposed_tp_s"] < s_off["exposed_tp_s"]
    assert s_on["exposed_dp_s"] < s_off["exposed_dp_s"]
    assert s_on["step_time_s"] < s_off["step_time_s"]
    assert s_on["executed_flops"] == s_off["executed_flops"]
    for mode in ("symmetric", "full"):  # the parameter all-gathers ran beside the first forwards
        names = set(pq.read_table(root / f"on-{mode}" / "timeline.parquet", columns=["name"])["name"].to_pylist())
        assert any(n.startswith("param_gather all_gather") for n in names), mode
