"""The launching host (echo.simulate.program's host clock, Hardware.host): ops wait for their
launch, a host sync empties the queue, and the replay's shortcuts (the shifted clean replay, the
jump over a task's tail) agree with the op-by-op replay whatever the host's clock."""

from __future__ import annotations

import random

import pytest
from test_simulate import HARDWARE, NET_US, NONE, FakeNet, make_workload, topology, write_inputs  # noqa: I001

from echo.config.hardware import Hardware
from echo.fit.host_launch import launch_pace_us
from echo.reference import reference_root
from echo.simulate import run_simulate
from echo.simulate.costing import mark_host_syncs
from echo.simulate.gpu import Flow, Gpu
from echo.simulate.program import Op, Program, _replay, replay


def compute(seq: int, us: float, host: float, sync: bool = False) -> Op:
    return Op(seq, "compute", "compute", us, host_us=host, host_sync=sync, op_class="gemm")


def test_a_host_slower_than_the_gpu_paces_it():
    # 4 ops of 10 us, 25 us to launch each: op i starts at its launch 25 (i + 1) and the task ends
    # at 4 x 25 + 10 = 110; the GPU computed 40 and waited 70 for the host.
    prog = Program([compute(i, 10.0, 25.0) for i in range(4)])
    gpu = Gpu()
    run = replay(prog, gpu, 0.0)
    assert run.end == pytest.approx(110.0)
    assert run.compute_us == pytest.approx(40.0) and run.exposed["host"] == pytest.approx(70.0)
    assert gpu.host == pytest.approx(100.0)
    # the clean replay has the host far ahead: no waits
    assert prog.cost.duration_us == pytest.approx(40.0)


def test_a_host_ahead_of_the_gpu_is_hidden_until_a_sync():
    # two ops of 100 us launched in 5 us each, then a sync op (the host waits for the GPU at 200,
    # then launches it: 205), then a 100 us op: [0, 100] [100, 200] [205, 305] [305, 405].
    prog = Program([compute(0, 100.0, 5.0), compute(1, 100.0, 5.0), compute(2, 100.0, 5.0, sync=True),
                    compute(3, 100.0, 5.0)])
    gpu = Gpu()
    gpu.host = -1e9  # far ahead
    run = replay(prog, gpu, 0.0)
    assert run.end == pytest.approx(405.0) and run.exposed["host"] == pytest.approx(5.0)
    assert gpu.host == pytest.approx(210.0)
    assert prog.cost.duration_us == pytest.approx(405.0)


def reference(prog: Program, gpu: Gpu, start: float):
    """The op-by-op replay (the probe turns the shortcuts off)."""
    return _replay(prog, gpu, start, [], probe=[])


@pytest.mark.parametrize("seed", range(40))
def test_the_shortcuts_agree_with_the_op_by_op_replay(seed):
    rng = random.Random(seed)
    ops = []
    for seq in range(rng.randint(1, 30)):
        h = rng.choice([0.0, 2.0, 20.0, 60.0])
        if rng.random() < 0.05:  # a bucket on the comm stream: no shortcut over it
            ops.append(Op(seq, "collective", "comm", rng.uniform(5, 80), comm_kind="dp", op="all_reduce", host_us=h))
        elif rng.random() < 0.15:
            ops.append(Op(seq, "collective", "comm", rng.uniform(5, 80), blocking=True, comm_kind="ep",
                          op="all_to_all", host_us=h, host_sync=rng.random() < 0.5))
        else:
            ops.append(compute(seq, rng.uniform(1, 60), h, sync=rng.random() < 0.1))
    prog = Program(ops)
    for _ in range(5):
        start = rng.uniform(0, 500)
        host = start + rng.uniform(-600, 300)
        busy_until = rng.choice([0.0, start + rng.uniform(0, 100)])
        got_gpu, want_gpu = Gpu(), Gpu()
        for g in (got_gpu, want_gpu):
            g.host = host
            if busy_until:
                g.occupy("comm", Flow(0.0, busy_until, ((("nic", "tx"), 1.0),)), 0.0, busy_until)
        got, want = replay(prog, got_gpu, start), reference(prog, want_gpu, start)
        assert got.end == pytest.approx(want.end, abs=1e-9)
        assert got.compute_us == pytest.approx(want.compute_us, abs=1e-9)
        assert got_gpu.host == pytest.approx(want_gpu.host, abs=1e-9)
        for kind in set(got.exposed) | set(want.exposed):
            assert got.exposed.get(kind, 0.0) == pytest.approx(want.exposed.get(kind, 0.0), abs=1e-9), kind
        assert got.end - start == pytest.approx(got.compute_us + sum(got.exposed.values()) + got.bubble_us)


def row(seq: int, phase: str) -> dict:
    return {"seq": seq, "phase": phase}


def a2a(seq: int) -> Op:
    return Op(seq, "collective", "compute", 1.0, blocking=True, comm_kind="ep", op="all_to_all")


def gemm(seq: int) -> Op:
    return Op(seq, "compute", "compute", 1.0, op_class="gemm")


def test_the_first_all_to_all_of_each_forward_dispatch_is_a_host_sync():
    # layer: router gemm, dispatch (tokens, probs, a copy between), experts, combine; twice;
    # then the backward's all-to-alls (no sync) and a recomputed layer (its dispatch syncs).
    seqs = [("forward", gemm), ("forward", a2a), ("forward", lambda s: Op(s, "compute", "compute", 1.0,
                                                                          op_class="copy")),
            ("forward", a2a), ("forward", gemm), ("forward", a2a),
            ("forward", gemm), ("forward", a2a), ("forward", a2a), ("forward", gemm), ("forward", a2a),
            ("recompute", gemm), ("recompute", a2a), ("recompute", a2a), ("recompute", gemm), ("recompute", a2a),
            ("backward", a2a), ("backward", gemm), ("backward", a2a), ("backward", a2a)]
    rows = [(row(i, phase), make(i)) for i, (phase, make) in enumerate(seqs)]
    marked = [op.seq for _, op in mark_host_syncs(rows) if op.host_sync]
    assert marked == [1, 7, 12]


def test_the_launch_paces_lie_in_what_real_traces_show():
    """A100 hosts take the A100 Kineto traces' floor (21.5 us, derived); the Hopper and Blackwell
    hosts one pace fitted on the Megatron-Bridge fit rows (H100, B200, GB200: fitted; their
    siblings: the same, assumed), inside the traces' range (21.5 to 112 us)."""
    if not (reference_root() / "kineto").is_dir():
        pytest.skip("no reference folder kineto/")
    from echo.config import load_hardware
    from echo.fit.host_launch import PLAUSIBLE_US, job_paces

    floor, basis = launch_pace_us()
    assert floor == pytest.approx(21.5, abs=0.05) and "a100_16rank_rank0" in basis
    a100 = load_hardware("a100-sxm-80gb").host.launch_us
    assert a100.status == "derived" and a100.value == pytest.approx(floor, abs=0.05)
    paces = job_paces()
    fitted = {n: load_hardware(n).host.launch_us for n in ("h100-sxm-80gb", "b200-sxm", "gb200")}
    carried = {n: load_hardware(n).host.launch_us for n in ("h200-sxm-141gb", "b300-sxm", "gb300")}
    assert {f.status for f in fitted.values()} == {"fitted"} and {f.status for f in carried.values()} == {"assumed"}
    assert len({f.value for f in (*fitted.values(), *carried.values())}) == 1
    value = fitted["h100-sxm-80gb"].value
    assert all("echo.fit.host_launch" in f.basis for f in (*fitted.values(), *carried.values()))
    assert floor <= value <= max(paces.values()) and PLAUSIBLE_US[0] <= value <= PLAUSIBLE_US[1]


def test_host_and_host_synchronous_exclude_each_other():
    data = HARDWARE.model_dump() | {"host_synchronous": True,
                                    "host": {"launch_us": {"value": 20.0, "status": "assumed", "basis": "x"}}}
    with pytest.raises(ValueError, match="host_synchronous"):
        Hardware.model_validate(data)


@pytest.mark.parametrize("pp,schedule,v", [(2, "1f1b", 1), (2, "interleaved", 2), (1, "1f1b", 1)])
def test_a_slow_host_lengthens_the_step_alike_in_both_modes(tmp_path, pp, schedule, v):
    w = make_workload(pp=pp, schedule=schedule, v=v, global_batch=8)
    write_inputs(tmp_path, w)
    out = {}
    for launch in (0.0, 40.0):
        hw = HARDWARE if not launch else Hardware.model_validate(
            HARDWARE.model_dump() | {"host": {"launch_us": {"value": launch, "status": "assumed", "basis": "test"}}})
        for mode in ("symmetric", "full"):
            s = run_simulate(w, hw, topology(), tmp_path / "trace", tmp_path / "rank_classes.parquet",
                             tmp_path / "kernels.parquet", tmp_path / "calib", tmp_path / f"out-{launch}-{mode}",
                             network=FakeNet(NET_US), overlap=NONE, mode=mode).to_pylist()[0]
            out[launch, mode] = s
    for launch in (0.0, 40.0):
        sym, full = out[launch, "symmetric"], out[launch, "full"]
        assert full["step_time_s"] == pytest.approx(sym["step_time_s"], rel=1e-9)
        assert full["host_wait_s"] == pytest.approx(sym["host_wait_s"], rel=1e-9, abs=1e-15)
        assert sym["compute_s"] + sym["exposed_comm_s"] + sym["host_wait_s"] + sym["bubble_s"] == \
            pytest.approx(sym["step_time_s"])
    assert out[0.0, "symmetric"]["host_wait_s"] == 0.0
    assert out[40.0, "symmetric"]["host_wait_s"] > 0
    assert out[40.0, "symmetric"]["step_time_s"] > out[0.0, "symmetric"]["step_time_s"]
