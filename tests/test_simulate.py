"""The simulate stage on small synthetic programs and traces whose answers can be worked out by hand.

Full mode (every rank, collectives as rendezvous) against symmetric mode (one timeline per
stage) is in test_simulate_modes.py; the overlap slowdown's calibration in test_simulate_overlap.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from echo.artifacts import COMMS, KERNELS, OPS, RANK_CLASSES, SUMMARY, TIMELINE, TRACED_RANKS
from echo.config import Hardware, Topology, Workload
from echo.io import write_parquet
from echo.network import CollectiveCosts, Estimate
from echo.overlap import Slowdown
from echo.simulate import (
    ClassInfo,
    EngineOptions,
    Flow,
    Gpu,
    MissingKernelError,
    Op,
    Program,
    RankCosts,
    fair_share,
    max_min_share,
    no_sharing,
    run_simulate,
    simulate,
    simulate_ops,
    with_buckets,
)
from echo.simulate.costing import CommTimer
from echo.simulate.gpu import InFlight
from echo.simulate.program import slowest
from echo.simulate.summary import class_peak_bytes
from echo.training.schedule import Task, in_flight, stage_orders

GIB = 1 << 30


# --- programs by hand --------------------------------------------------------------------------
def compute(seq: int, us: float, flops: float = 0.0, recompute: bool = False, s: float = 0.0) -> Op:
    return Op(seq, "compute", "compute", us, flops=flops, recompute=recompute, slowdown=s)


def coll(seq: int, us: float, blocking: bool, kind: str = "dp", nbytes: int = 1, link: str = "nic") -> Op:
    return Op(seq, "collective", "compute" if blocking else "comm", us, blocking=blocking, comm_kind=kind,
              op="all_reduce", nbytes=nbytes, link=link)


def send(seq: int, us: float, direction: str) -> Op:
    return Op(seq, "p2p", f"p2p_{direction}", us, comm_kind="pp", op="send")


def recv(seq: int, direction: str) -> Op:
    return Op(seq, "p2p", f"p2p_{direction}", 0.0, blocking=True, comm_kind="pp", op="recv")


def pipeline(p: int, F: float, B: float, *, v: int = 1, send_us: float = 0.0, grad_sync=(), optimizer: float = 0.0,
             b_ops: int = 1, s: float = 0.0) -> list[RankCosts]:
    """p identical stages; F and B are a whole stage's forward/backward (split over v chunks, the
    backward into b_ops equal kernels); each task receives from and sends to its neighbours as
    the trace records it; grad_sync: bucket times (non-blocking dp collectives)."""
    last = p * v - 1
    out = []
    for stage in range(p):
        fwd, bwd = [], []
        for c in range(v):
            k = c * p + stage
            ops = [recv(0, "fwd")] if k > 0 else []
            ops.append(compute(1, F / v, s=s))
            if k < last:
                ops.append(send(2, send_us, "fwd"))
            fwd.append(Program(ops))
            ops = [recv(0, "bwd")] if k < last else []
            ops += [compute(1 + i, B / v / b_ops, s=s) for i in range(b_ops)]
            if k > 0:
                ops.append(send(1 + b_ops, send_us, "bwd"))
            bwd.append(Program(ops))
        out.append(RankCosts(forward=tuple(fwd), backward=tuple(bwd),
                             grad_sync=Program([coll(i, us, False) for i, us in enumerate(grad_sync)]),
                             optimizer=Program([compute(0, optimizer)] if optimizer else [])))
    return out


def check_split(result) -> None:
    """compute + exposed + bubble = step time on every stage (nothing unaccounted)."""
    for st in result.stages:
        assert st.compute_us + sum(us for _, us in st.exposed_us) + st.bubble_us == pytest.approx(result.step_us)


# --- schedules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (4, 8), (8, 3), (8, 32)])
def test_1f1b_uniform_step_and_bubble(p, m):
    r = simulate(pipeline(p, 1.0, 2.0), stage_orders("1f1b", p, m))
    assert r.step_us == pytest.approx((m + p - 1) * 3.0)
    crit = r.stages[r.critical_stage]
    assert crit.bubble_us / r.step_us == pytest.approx((p - 1) / (m + p - 1))
    assert crit.compute_us == pytest.approx(3.0 * m)
    check_split(r)


def test_gpipe_same_makespan_more_activations_in_flight():
    p, m = 4, 8
    one = simulate(pipeline(p, 1.0, 2.0), stage_orders("1f1b", p, m))
    gp = simulate(pipeline(p, 1.0, 2.0), stage_orders("gpipe", p, m))
    assert gp.step_us == pytest.approx(one.step_us) == pytest.approx((m + p - 1) * 3.0)
    assert [in_flight(o) for o in stage_orders("gpipe", p, m)] == [m] * p
    assert [in_flight(o) for o in stage_orders("1f1b", p, m)] == [min(m, p - s) for s in range(p)]
    assert [in_flight(o) for o in stage_orders("1f1b", p, 2)] == [2, 2, 2, 1]


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (4, 4, 2), (8, 16, 3)])
def test_interleaved_bubble_shrinks_by_chunks(p, m, v):
    F, B = 1.0, 2.0
    r = simulate(pipeline(p, F, B, v=v), stage_orders("interleaved", p, m, v))
    base = simulate(pipeline(p, F, B), stage_orders("1f1b", p, m))
    bubble = r.stages[r.critical_stage].bubble_us
    assert bubble == pytest.approx((p - 1) * (F + B) / v)
    assert bubble / (m * (F + B)) == pytest.approx((p - 1) / (v * m))  # Megatron-LM's bubble ratio
    assert r.step_us < base.step_us
    check_split(r)


def test_every_order_runs_each_pass_once():
    for sched, p, m, v in [("gpipe", 3, 5, 1), ("1f1b", 4, 3, 1), ("interleaved", 4, 8, 3)]:
        for order in stage_orders(sched, p, m, v):
            want = {(k, i, c) for k in "FB" for i in range(m) for c in range(v)}
            assert sorted((t.kind, t.microbatch, t.chunk) for t in order) == sorted(want)


def test_schedule_refusals():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        stage_orders("zero-bubble", 2, 4)
    with pytest.raises(ValueError, match="divisible by stages"):
        stage_orders("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="one chunk per stage"):
        stage_orders("1f1b", 4, 8, 2)


def test_deadlocking_order_is_refused():
    orders = [[Task("B", 0, 0), Task("F", 0, 0)], [Task("F", 0, 0), Task("B", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlocks: stage 0"):
        simulate(pipeline(2, 1.0, 2.0), orders)


def test_p2p_time_is_exposed_pp():
    # Two stages, one micro-batch: F0 | send | F1 B1 | send | B0. Each send is on the path once.
    r = simulate(pipeline(2, 1.0, 2.0, send_us=0.5), stage_orders("1f1b", 2, 1))
    assert r.step_us == pytest.approx(2 * 3.0 + 2 * 0.5)
    assert r.stages[0].exposed("pp") == pytest.approx(0.5)  # its backward waited on the transfer
    assert r.stages[1].exposed("pp") == pytest.approx(0.5)
    check_split(r)


# --- grad_sync, its overlap with the last backward, and slack --------------------------------------
def test_grad_sync_hidden_in_slack_exposed_beyond_it():
    p, m, F, B = 4, 8, 1.0, 2.0
    base = simulate(pipeline(p, F, B), stage_orders("1f1b", p, m)).step_us
    slack = (p - 1) * B  # the last stage's last backward ends (p - 1) backwards before stage 0's

    def with_sync(us: float) -> list[RankCosts]:
        costs = pipeline(p, F, B)
        costs[p - 1] = pipeline(p, F, B, grad_sync=(us,))[p - 1]
        return costs

    hidden = simulate(with_sync(slack - 1.0), stage_orders("1f1b", p, m))
    assert hidden.step_us == pytest.approx(base)
    assert hidden.stages[p - 1].exposed("dp") == pytest.approx(slack - 1.0)  # that stage did wait
    longer = simulate(with_sync(slack + 1.5), stage_orders("1f1b", p, m))
    assert longer.step_us == pytest.approx(base + 1.5)
    assert longer.critical_stage == p - 1
    check_split(longer)


def test_gradient_all_reduce_exposed_without_overlap_hidden_with_it():
    # One stage, 4 micro-batches of F 1 + B 2 (the backward as 4 kernels of 0.5), 4 buckets of
    # 0.25 of equal size. Without overlap all of grad_sync follows the last backward (1.0
    # exposed); with it, bucket i leaves after kernel i of the last backward and only the last
    # bucket (0.25) is exposed.
    m, opt = 4, 0.1
    costs = pipeline(1, 1.0, 2.0, grad_sync=(0.25,) * 4, optimizer=opt, b_ops=4)
    after = simulate(costs, stage_orders("1f1b", 1, m))
    over = simulate(costs, stage_orders("1f1b", 1, m), EngineOptions(overlap_grad_reduce=True))
    assert after.step_us == pytest.approx(m * 3.0 + 1.0 + opt)
    assert after.stages[0].exposed("dp") == pytest.approx(1.0)
    assert over.step_us == pytest.approx(m * 3.0 + 0.25 + opt)
    assert over.stages[0].exposed("dp") == pytest.approx(0.25)
    check_split(over)
    buckets = sorted(x for e in over.events if e.name.startswith("grad_sync") for x in (e.start_us, e.end_us))
    assert buckets == pytest.approx([10.5, 10.75, 11.0, 11.25, 11.5, 11.75, 12.0, 12.25])


def test_overlapped_buckets_slow_the_last_backward():
    # As above with s = 1 (compute at half speed beside a transfer). Last backward from 10:
    # kernel 1 [10, 10.5]; bucket 1 [10.5, 10.75] slows kernel 2: 0.125 of work by 10.75, the
    # other 0.375 by 11.125; bucket 2 [11.125, 11.375], kernel 3 ends 11.75; bucket 3 [11.75, 12],
    # kernel 4 ends 12.375; bucket 4 [12.375, 12.625] exposed. 3 x 0.125 of slowdown.
    costs = pipeline(1, 1.0, 2.0, grad_sync=(0.25,) * 4, b_ops=4, s=1.0)
    r = simulate(costs, stage_orders("1f1b", 1, 4), EngineOptions(overlap_grad_reduce=True))
    assert r.step_us == pytest.approx(12.625)
    assert r.stages[0].slowdown_us == pytest.approx(3 * 0.125)
    assert r.stages[0].compute_us == pytest.approx(12.0 + 0.375)
    check_split(r)


def test_bucket_positions_follow_bytes():
    # buckets of 1, 1 and 2 units over a backward of 4 equal kernels: ready after 1/4, 2/4, 4/4
    b = Program([compute(i, 1.0) for i in range(4)])
    gs = Program([coll(10 + i, 0.1, False, nbytes=n) for i, n in enumerate((1, 1, 2))])
    last, rest = with_buckets(b, gs)
    order = [("b" if op.code == 2 else "c") for op in last.ops]
    assert order == ["c", "b", "c", "b", "c", "c", "b"]
    assert all(op.carry for op in last.ops if op.code == 2) and len(rest) == 0


# --- op level --------------------------------------------------------------------------------------
def test_blocking_collective_adds_its_time():
    t = simulate_ops([compute(0, 100.0), coll(1, 30.0, True, "tp"), compute(2, 50.0)])
    assert (t.duration_us, t.compute_us, t.exposed("tp")) == (180.0, 150.0, 30.0)


def test_non_blocking_collective_overlaps_and_its_tail_is_exposed():
    short = simulate_ops([compute(0, 10.0), coll(1, 30.0, False), compute(2, 100.0)])
    assert (short.duration_us, short.exposed("dp")) == (110.0, 0.0)
    long = simulate_ops([compute(0, 10.0), coll(1, 150.0, False), compute(2, 100.0)])
    assert (long.duration_us, long.exposed("dp")) == (160.0, 50.0)
    # a consumer of the collective's result waits for it (deps.parquet edge 1 -> 2)
    waits = simulate_ops([compute(0, 10.0), coll(1, 30.0, False), compute(2, 5.0)], {2: [1]})
    assert (waits.duration_us, waits.exposed("dp")) == (45.0, 30.0)
    assert long.comm_us == (150.0,)


def test_overlap_slowdown_follows_the_formula():
    # A 100 us kernel with s = 0.5 beside a 40 us collective: it does 40 / 1.5 us of its work in
    # the overlap, r = 0.2667, T = (1 - r) 100 + r 100 (1 + 0.5) = 113.33 us.
    t = simulate_ops([coll(0, 40.0, False), compute(1, 100.0, s=0.5)])
    r = 40.0 / 1.5 / 100.0
    assert t.duration_us == pytest.approx((1 - r) * 100.0 + r * 100.0 * 1.5) == pytest.approx(113.3333333)
    assert t.slowdown_us == pytest.approx(13.3333333)
    # a blocking collective overlaps nothing; s = 0 slows nothing
    assert simulate_ops([coll(0, 40.0, True, "tp"), compute(1, 100.0, s=0.5)]).duration_us == 140.0
    assert simulate_ops([coll(0, 40.0, False), compute(1, 100.0)]).duration_us == 100.0


def test_p2p_ops_stay_out_of_the_chunk():
    t = simulate_ops([recv(0, "fwd"), compute(1, 10.0), send(2, 99.0, "fwd")])
    assert t.duration_us == 10.0 and t.sends == ((10.0, 109.0),)


def test_link_sharing():
    # a 10 us transfer starting at 5 beside one of [0, 10]: half speed for 5 us, then alone: 17.5
    assert fair_share([(0.0, 10.0)], 5.0, 10.0) == pytest.approx(17.5)
    # two in flight until 10: a third of the link, 5/3 us of work by 10, the other 4/3 alone
    assert fair_share([(0.0, 10.0), (2.0, 10.0)], 5.0, 3.0) == pytest.approx(10.0 + 4.0 / 3.0)
    assert no_sharing([], 5.0, Flow(1.0, 10.0, ())) == 16.0
    nic, nvlink = Flow(0.0, 10.0, ((("nic", "tx"), 1.0),)), Flow(0.0, 10.0, ((("nvlink", "tx"), 1.0),))
    gpu = Gpu()
    a = gpu.transfer("comm", nic, 0.0)
    b = gpu.transfer("p2p_fwd", nic, 5.0)      # shares the NIC
    c = gpu.transfer("p2p_bwd", nvlink, 5.0)   # another link: not slowed
    assert (a, b, c) == ((0.0, 10.0), (5.0, 17.5), (5.0, 15.0))
    # queued behind its stream until 10, then sharing the NIC with the send until it is done
    assert gpu.transfer("comm", Flow(0.0, 1.0, ((("nic", "tx"), 1.0),)), 1.0) == (10.0, 12.0)
    # max-min: a flow using a fifth of the NIC beside one that wants all of it keeps its speed
    # (the big one gets the other 4/5), and latency uses no bandwidth
    small = Flow(2.0, 10.0, ((("nic", "tx"), 0.2),))
    assert max_min_share([InFlight(0.0, 0.0, 100.0, {("nic", "tx"): 1.0})], 0.0, small) == pytest.approx(12.0)


def test_stream_order_and_shared_nic_in_the_pipeline():
    # Stage 1 of 2 ends its last backward at t and sends 0.5 back while its 1.0 grad_sync bucket
    # starts on the same NIC: the bucket runs at half speed for 0.5 and ends at t + 1.25.
    p, m = 2, 1
    costs = pipeline(p, 1.0, 2.0, send_us=0.5, grad_sync=(1.0,))
    shared = simulate(costs, stage_orders("1f1b", p, m))
    alone = simulate(costs, stage_orders("1f1b", p, m), EngineOptions(sharing=no_sharing))
    t = 1.0 + 0.5 + 3.0  # stage 1's backward ends
    assert alone.stages[1].end_us == pytest.approx(t + 1.0)
    assert shared.stages[1].end_us == pytest.approx(t + 1.25)
    assert shared.stages[0].end_us == alone.stages[0].end_us  # the send kept its end


# --- the stage end to end, on a synthetic trace -----------------------------------------------------
KERNEL_US = {"gemm_f": 100.0, "gemm_b": 200.0, "adam": 50.0}
NET_US = {"all_reduce": 10.0, "reduce_scatter": 30.0, "all_gather": 20.0, "send": 5.0, "recv": 5.0}
GEMM_FLOPS = 1e9
NONE = Slowdown.none()


@dataclass
class FakeNet(CollectiveCosts):
    """Stands in for echo.network.NetworkModel: a fixed time per op kind (no link loads, no API
    overhead), calls counted."""

    times: dict
    calls: int = 0

    def estimate(self, op, group, *, nbytes):
        self.calls += 1
        assert all(isinstance(r, int) for r in group) and nbytes > 0
        return Estimate(self.times[op], 0.0, 0.0, "ring", "simple")


def test_the_network_is_typed():
    with pytest.raises(TypeError, match="CollectiveCosts"):
        CommTimer(type("Duck", (), {"estimate": FakeNet.estimate})())


def make_workload(pp=2, tp=2, dp=2, global_batch=8, schedule="1f1b", recompute="none", v=1) -> Workload:
    return Workload.model_validate({
        "name": "synthetic",
        "model": {"arch": "gpt", "layers": 4 * v, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero": 1, "schedule": schedule, "virtual_stages": v},
        "training": {"global_batch": global_batch, "micro_batch": 1, "dtype": "bf16", "recompute": recompute}})


HARDWARE = Hardware.model_validate({
    "name": "fake-gpu", "kind": "gpu", "peak_tflops": {"bf16": 100.0, "fp16": 100.0, "fp32": 10.0},
    "memory_gib": 4.0, "hbm_GBps": 1000.0,
    "compute_model": {"matmul_efficiency": 0.8, "hbm_efficiency": 0.8, "kernel_launch_us": 3.0, "sm_count": 100}})


def topology(gpus_per_node: int = 8) -> Topology:
    return Topology.model_validate({
        "name": "fake-net", "gpus_per_node": gpus_per_node,
        "intra_node": {"bandwidth_GBps": 100.0, "latency_us": 1.0},
        "inter_node": {"nic_Gbps": 100.0, "nics_per_node": 1, "latency_us": 5.0}})


TOPOLOGY = topology()


def rank_of(w: Workload, pp: int, dp: int, tp: int) -> int:
    par = w.parallel
    return tp + par.tp * (dp + par.dp * pp)


class TraceBuilder:
    """ops/comms rows of one representative rank, in trace order."""

    def __init__(self, rank: int):
        self.rank, self.ops, self.comms = rank, [], []

    def op(self, phase, kernel, flops=0.0, chunk=0, op_class="gemm"):
        self._row(phase, chunk, "compute", "compute", kernel, flops, -1, op_class)

    def comm(self, phase, op, group, kind, blocking, chunk=0, peer=-1, nbytes=1 << 20):
        cid = len(self.comms)
        is_p2p = op in ("send", "recv")
        self.comms.append(dict(rank=self.rank, comm_id=cid, seq=len(self.ops), op=op, group=group,
                               group_size=len(group), group_kind=kind, bytes=nbytes, peer=peer,
                               dtype="bfloat16", phase=phase, chunk=chunk, blocking=blocking))
        self._row(phase, chunk, "p2p" if is_p2p else "collective",
                  "p2p" if is_p2p else ("compute" if blocking else "comm"), "", 0.0, cid,
                  "p2p" if is_p2p else "collective")

    def _row(self, phase, chunk, kind, stream, kernel, flops, cid, op_class):
        self.ops.append(dict(rank=self.rank, seq=len(self.ops), name=kernel or "c10d", op_class=op_class,
                             kind=kind, phase=phase, chunk=chunk, microbatch=-1, stream=stream, shapes="[]",
                             args="{}", dtype="bfloat16", flops=flops, bytes=0.0, kernel_key=kernel, comm_id=cid))


def trace_stage(w: Workload, s: int, recompute: bool, buckets: int = 1) -> TraceBuilder:
    """Stage s: per chunk, forward = recv, gemm, TP all-reduce, send; backward mirrors; then
    grad_sync (``buckets`` reduce-scatters) and optimizer as the trace conventions lay them out."""
    par = w.parallel
    p, v = par.pp, par.virtual_stages
    me = rank_of(w, s, 0, 0)
    tp = [rank_of(w, s, 0, t) for t in range(par.tp)]
    dp = [rank_of(w, s, d, 0) for d in range(par.dp)]
    prev, nxt = rank_of(w, (s - 1) % p, 0, 0), rank_of(w, (s + 1) % p, 0, 0)
    t = TraceBuilder(me)
    for c in range(v):
        k = c * p + s
        if k > 0:
            t.comm("forward", "recv", sorted([me, prev]), "pp", True, chunk=c, peer=prev)
        t.op("forward", "gemm_f", GEMM_FLOPS, chunk=c)
        t.comm("forward", "all_reduce", tp, "tp", True, chunk=c)
        if k < p * v - 1:
            t.comm("forward", "send", sorted([me, nxt]), "pp", False, chunk=c, peer=nxt)
    for c in reversed(range(v)):
        k = c * p + s
        if k < p * v - 1:
            t.comm("backward", "recv", sorted([me, nxt]), "pp", True, chunk=c, peer=nxt)
        if recompute:
            t.op("recompute", "gemm_f", GEMM_FLOPS, chunk=c)
        t.op("backward", "gemm_b", 2 * GEMM_FLOPS, chunk=c)
        t.comm("backward", "all_reduce", tp, "tp", True, chunk=c)
        if k > 0:
            t.comm("backward", "send", sorted([me, prev]), "pp", False, chunk=c, peer=prev)
    for _ in range(buckets):
        t.comm("grad_sync", "reduce_scatter", dp, "dp", False)
    t.op("optimizer", "adam", op_class="optimizer")
    t.comm("optimizer", "all_gather", dp, "dp", True)
    return t


def write_inputs(tmp_path, w: Workload, *, recompute=False, kernels=KERNEL_US, merge_middle=False, buckets=1):
    par = w.parallel
    trace = tmp_path / "trace"
    trace.mkdir()
    stages = [trace_stage(w, s, recompute, buckets) for s in range(par.pp)]
    write_parquet(pa.Table.from_pylist([r for t in stages for r in t.ops], OPS), trace / "ops.parquet")
    write_parquet(pa.Table.from_pylist([r for t in stages for r in t.comms], COMMS), trace / "comms.parquet")
    write_parquet(pa.Table.from_pylist([dict(
        rank=t.rank, role=f"pp{s}", pp_rank=s, tp_rank=0, dp_rank=0, cp_rank=0, graph_hash=f"h{s}",
        param_bytes=GIB // 2, grad_bytes=GIB // 4, optimizer_bytes=GIB // 4,
        activation_bytes_per_microbatch=GIB // 2, trace_wall_s=0.1) for s, t in enumerate(stages)],
        TRACED_RANKS), trace / "ranks.parquet")

    def class_of(stage: int) -> int:  # dedup merges middle stages: their graphs hash alike
        return min(stage, 1) if merge_middle and stage < par.pp - 1 else stage

    classes = [dict(rank=r, class_id=class_of(s), representative=rank_of(w, class_of(s), 0, 0), graph_hash="h",
                    pp_rank=s, tp_rank=r % par.tp, dp_rank=(r // par.tp) % par.dp, cp_rank=0, node=-1)
               for r in range(w.world_size) for s in [r // (par.tp * par.dp)]]
    write_parquet(pa.Table.from_pylist(classes, RANK_CLASSES), tmp_path / "rank_classes.parquet")
    write_parquet(pa.Table.from_pylist([dict(
        kernel_key=k, name=k, op_class="gemm", shapes="[]", dtype="bfloat16", flops=0.0, bytes=0.0, duration_us=us,
        achieved_tflops=0.0, achieved_GBps=0.0, source="model", count=1) for k, us in kernels.items()], KERNELS),
        tmp_path / "kernels.parquet")
    return trace


def run(tmp_path, w: Workload, net=None, *, topo=TOPOLOGY, overlap=NONE, options=None, mode="symmetric",
        compute_scale=None, out="out", **kw):
    if not (tmp_path / "trace").exists():
        write_inputs(tmp_path, w, **kw)
    net = net or FakeNet(NET_US)
    summary = run_simulate(w, HARDWARE, topo, tmp_path / "trace", tmp_path / "rank_classes.parquet",
                           tmp_path / "kernels.parquet", tmp_path / "calib", tmp_path / out, network=net,
                           overlap=overlap, options=options, mode=mode, compute_scale=compute_scale)
    return summary.to_pylist()[0]


def test_run_simulate_hand_figures(tmp_path):
    # PP2 TP2 DP2, 4 micro-batches, 1f1b. F = 100 + 10 (TP), B = 200 + 10, send 5; stage 0 runs
    # F0 F1 B0 F2 B1 F3 B2 B3 and its backwards wait for stage 1: B0 at 440 (220 idle, 5 of it
    # the transfer), B2 at 1090 (5 + 5), B3 at 1410 (105 + 5), ending at 1620; then grad_sync 30
    # and optimizer 50 + all-gather 20. Stage 1's last backward ends at 1405 and its send back
    # (5) shares the node's NVLink with its grad_sync reduce-scatter (30), which therefore ends
    # 2.5 later: stage 1 finishes at 1507.5.
    w = make_workload()
    s = run(tmp_path, w)
    assert s["step_time_s"] == pytest.approx(1720e-6)
    assert s["compute_s"] == pytest.approx((4 * 100 + 4 * 200 + 50) * 1e-6)
    assert s["exposed_tp_s"] == pytest.approx(8 * 10e-6)
    assert s["exposed_dp_s"] == pytest.approx((30 + 20) * 1e-6)
    assert s["exposed_pp_s"] == pytest.approx(15e-6)
    assert s["bubble_s"] == pytest.approx(325e-6)
    assert s["compute_s"] + s["exposed_comm_s"] + s["bubble_s"] == pytest.approx(s["step_time_s"])
    assert s["stage_step_time_s"] == pytest.approx([1720e-6, 1507.5e-6])
    assert s["bubble_fraction"] == pytest.approx(325 / 1720)
    assert s["tokens_per_s"] == pytest.approx(8 * 32 / 1720e-6)
    assert s["critical_stage"] == 0 and s["world_size"] == 8 and s["slowdown_s"] == 0.0
    assert s["mode"] == "symmetric"


def test_overlap_slowdown_end_to_end(tmp_path):
    # The hand figures above with s = 1 for gemm (half speed beside a transfer of the same device).
    # Stage 0's F1 starts at 110 beside its send of F0 [110, 115]: its gemm does 2.5 us of work in
    # those 5 us and ends 2.5 late (F1 = [110, 222.5]). Stage 1's F1 starts at 435 beside its send
    # of B0 [435, 440]: also 2.5 late. Stage 0's B1 starts at 762.5 beside the send of F2
    # [760, 765]: 1.25 of its work in 2.5 us, 1.25 late. Critical stage 0: 3.75 us of slowdown,
    # and the step ends at 1724.375 (stage 1's delays reach stage 0's last backward).
    w = make_workload()
    s = run(tmp_path, w, overlap=Slowdown({"gemm": 1.0}, "test"))
    timeline = pq.read_table(tmp_path / "out" / "timeline.parquet").to_pylist()
    end = {(r["pp_rank"], r["name"]): r["end_s"] * 1e6 for r in timeline}
    assert end[(0, "F1")] == pytest.approx(222.5) and end[(1, "F1")] == pytest.approx(547.5)
    assert end[(0, "B1")] == pytest.approx(973.75)
    assert s["slowdown_s"] == pytest.approx(3.75e-6)
    assert s["step_time_s"] == pytest.approx(1724.375e-6)
    assert s["compute_s"] == pytest.approx((4 * 100 + 4 * 200 + 50 + 3.75) * 1e-6)
    assert s["compute_s"] + s["exposed_comm_s"] + s["bubble_s"] == pytest.approx(s["step_time_s"])
    assert s["overlap_source"] == "test"
    # beside the timeline, stage 0's pipeline p2p in the order it ran (F0 F1 B0 F2 B1 F3 B2 B3)
    sched = pq.read_table(tmp_path / "out" / "schedule.parquet").to_pylist()
    assert [(r["task"], r["microbatch"], r["op"], r["peer"]) for r in sched if r["rank"] == 0] == [
        ("F", 0, "send", 4), ("F", 1, "send", 4), ("B", 0, "recv", 4), ("F", 2, "send", 4),
        ("B", 1, "recv", 4), ("F", 3, "send", 4), ("B", 2, "recv", 4), ("B", 3, "recv", 4)]


def test_flops_invariant_and_mfu_without_recompute(tmp_path):
    w = make_workload(recompute="full")
    s = run(tmp_path, w, recompute=True)
    m = w.micro_batches
    executed = w.world_size * m * (1 + 1 + 2) * GEMM_FLOPS   # forward, recompute, backward
    model = w.world_size * m * (1 + 2) * GEMM_FLOPS
    assert s["executed_flops"] == pytest.approx(executed) and s["model_flops"] == pytest.approx(model)
    assert s["tflops_per_gpu"] * s["step_time_s"] * s["world_size"] * 1e12 == pytest.approx(executed)
    assert s["mfu"] == pytest.approx(model / (w.world_size * s["step_time_s"] * 100.0 * 1e12))


def test_memory_in_flight_per_stage(tmp_path):
    # state 1 GiB + 0.5 GiB per micro-batch in flight: 1f1b stage s holds min(m, pp - s)
    s = run(tmp_path, make_workload(pp=2, global_batch=8))
    assert s["stage_peak_mem_gib"] == pytest.approx([1 + 0.5 * 2, 1 + 0.5 * 1])
    assert s["peak_mem_gib"] == pytest.approx(2.0) and s["fits"]


def test_gpipe_holds_every_micro_batch(tmp_path):
    s = run(tmp_path, make_workload(pp=2, global_batch=16, schedule="gpipe"))  # m = 8
    assert s["peak_mem_gib"] == pytest.approx(1 + 0.5 * 8) and not s["fits"]


def test_outputs_follow_contracts(tmp_path):
    w = make_workload()
    run(tmp_path, w)
    out = tmp_path / "out"
    summary, timeline = pq.read_table(out / "summary.parquet"), pq.read_table(out / "timeline.parquet")
    assert summary.schema.names[:len(SUMMARY)] == SUMMARY.names and summary.num_rows == 1
    assert timeline.schema.names == TIMELINE.names + ["rank"]
    kinds = timeline.group_by("kind").aggregate([("kind", "count")]).to_pydict()
    counts = dict(zip(kinds["kind"], kinds["kind_count"], strict=True))
    m = w.micro_batches
    assert counts == {"forward": 2 * m, "backward": 2 * m, "send": 2 * m, "collective": 2, "optimizer": 2}
    assert sorted(n for n in timeline["name"].to_pylist() if n.startswith("grad_sync")) == ["grad_sync reduce_scatter dp"] * 2
    trace = json.loads((out / "trace.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    threads = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert len(xs) == timeline.num_rows and all(e["dur"] >= 0 for e in xs)
    assert {(1, "compute"), (1, "comm"), (1, "p2p_fwd"), (2, "p2p_bwd")} <= threads  # pids from 1
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {1: "class 0 (pp stage 0)", 2: "class 1 (pp stage 1)"}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(1720.0)
    # every send is a flow from the sender's p2p thread to the task that received it
    flows = [e for e in trace["traceEvents"] if e.get("cat") == "flow"]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert len(starts) == len(ends) == 2 * m and set(starts) == set(ends)
    for fid, s in starts.items():
        assert s["pid"] != ends[fid]["pid"] and ends[fid]["ts"] >= s["ts"] and ends[fid]["tid"] == 1


def test_missing_kernel_is_named(tmp_path):
    with pytest.raises(MissingKernelError, match="kernel 'adam'"):
        run(tmp_path, make_workload(), kernels={k: v for k, v in KERNEL_US.items() if k != "adam"})


def test_cost_does_not_grow_with_data_parallel_width(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    net_small, net_large = FakeNet(NET_US), FakeNet(NET_US)
    a = run(small, make_workload(dp=2, global_batch=8), net_small)
    b = run(large, make_workload(dp=64, global_batch=256), net_large)
    assert a["step_time_s"] == pytest.approx(b["step_time_s"])  # same micro-batches per pipeline
    assert a["events"] == b["events"]
    assert net_small.calls == net_large.calls  # one estimate per distinct collective, not per rank
    assert b["tflops_per_gpu"] == pytest.approx(a["tflops_per_gpu"])


def test_classes_sharing_a_stage_move_at_the_slowest_pace():
    fast, slow = pipeline(1, 1.0, 2.0)[0], pipeline(1, 1.5, 1.0, optimizer=3.0)[0]
    both = slowest([fast, slow])
    assert [p.cost.duration_us for p in both.forward + both.backward] == [1.5, 2.0]
    assert both.optimizer.cost.duration_us == 3.0


def test_interleaved_activation_memory_counts_chunks():
    # stage 0 of PP4 with 2 chunks holds 2 * 3 + 4 + 1 = 11 chunk-micro-batches: 5.5 micro-batches
    order = stage_orders("interleaved", 4, 8, 2)[0]
    costs = pipeline(1, 1.0, 2.0, v=2)[0]
    c = ClassInfo(class_id=0, representative=0, stages=(0,), ranks=1, costs=costs, state_bytes=0,
                  activation_bytes=2 * GIB)
    assert in_flight(order) == 11
    assert class_peak_bytes(c, order) == pytest.approx(11 * GIB)


def test_a_class_spanning_middle_stages(tmp_path):
    w = make_workload(pp=4, global_batch=16)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    apart = run(tmp_path / "a", w)
    merged = run(tmp_path / "b", w, merge_middle=True)
    for key in ("step_time_s", "compute_s", "bubble_s", "executed_flops", "stage_peak_mem_gib", "stage_step_time_s"):
        assert merged[key] == pytest.approx(apart[key]), key
    assert merged["classes"] == 3
    timeline = pq.read_table(tmp_path / "b" / "out" / "timeline.parquet")
    pairs = set(zip(timeline["class_id"].to_pylist(), timeline["pp_rank"].to_pylist(), strict=True))
    assert pairs == {(0, 0), (1, 1), (1, 2), (3, 3)}
    trace = json.loads((tmp_path / "b" / "out" / "trace.json").read_text())
    names = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name")
    assert names == ["class 0 (pp stage 0)", "class 1 (pp stage 1)", "class 1 (pp stage 2)", "class 3 (pp stage 3)"]


def test_mode_refusals(tmp_path):
    w = make_workload()
    with pytest.raises(ValueError, match="simulate mode"):
        run(tmp_path, w, mode="fast")
    with pytest.raises(ValueError, match="needs mode='full'"):
        run(tmp_path, w, compute_scale={1: 2.0})
