"""Runs of kernels replayed at once (echo.simulate.kernel_runs, Gpu.stretch_run) agree with the
kernel-by-kernel replay: on random busy intervals and slowdowns, and inside whole programs whose
transfers slow the kernels after them and whose host may fall behind."""

from __future__ import annotations

import random

import pytest

from echo.simulate.gpu import Flow, Gpu
from echo.simulate.kernel_runs import KernelRuns
from echo.simulate.program import Op, Program, _replay, replay


def busy_gpu(rng: random.Random, t0: float) -> Gpu:
    gpu = Gpu()
    for _ in range(rng.randint(0, 6)):
        a = t0 + rng.uniform(-50, 400)
        b = a + rng.uniform(1, 120)
        gpu.occupy("comm", Flow(0.0, b - a, ((("nic", "tx"), 1.0),)), a, b)
    return gpu


@pytest.mark.parametrize("seed", range(60))
def test_a_run_stretches_as_its_kernels_one_by_one(seed):
    rng = random.Random(seed)
    durs = [rng.choice([0.0, rng.uniform(0.1, 80)]) for _ in range(rng.randint(1, 25))]
    slows = [rng.choice([0.0, -0.1, rng.uniform(0.0, 0.6)]) for _ in durs]
    work, slow = [0.0], [0.0]
    for d, s in zip(durs, slows, strict=True):
        work.append(work[-1] + d)
        slow.append(slow[-1] + (1.0 + max(s, 0.0)) * d)
    t = rng.uniform(0, 200)
    gpu = busy_gpu(rng, t)
    lo = rng.randint(0, len(durs) - 1)
    hi = rng.randint(lo + 1, len(durs))
    want = t
    for d, s in zip(durs[lo:hi], slows[lo:hi], strict=True):
        want = gpu.stretch(want, d, s)
    assert gpu.stretch_run(t, work, slow, lo, hi) == pytest.approx(want, abs=1e-9)


def test_a_run_ends_at_a_wait_a_transfer_or_a_host_sync():
    ops = [Op(0, "compute", "compute", 5.0), Op(1, "compute", "compute", 5.0),
           Op(2, "collective", "comm", 9.0, comm_kind="dp", op="all_reduce"),
           Op(3, "compute", "compute", 5.0), Op(4, "compute", "compute", 5.0, host_sync=True),
           Op(5, "compute", "compute", 5.0), Op(6, "compute", "compute", 5.0)]
    prog = Program(ops, waits={6: (2,)})
    # runs: [0, 2) and [5, 6) (op 6 waits for the all-reduce; op 4 is a host sync)
    assert prog.runs.end == (2, 2, 2, 4, 4, 6, 6)
    assert prog.runs.work[-1] == pytest.approx(30.0)


def test_room_is_how_far_the_host_must_lead():
    # three 1 us kernels launched in 4 us each: the third is launched 12 us after the host's clock
    # and reached 2 us after the run starts, so the host must lead the GPU by 10 us
    def kernels(durs):
        ch = [4.0 * i for i in range(len(durs) + 1)]
        return KernelRuns.of([(0, d, 0.0, Op(i, "compute", "compute", d, host_us=4.0), None)
                              for i, d in enumerate(durs)], {}, ch, 0)

    assert kernels((1.0, 1.0, 1.0)).room == pytest.approx((-10.0, -7.0, -4.0))
    # long kernels hide later launches: only the first launch binds
    assert kernels((10.0, 10.0, 10.0)).room == pytest.approx((-4.0, -4.0, -4.0))


def reference(prog: Program, gpu: Gpu, start: float):
    """The op-by-op replay (the probe turns every shortcut off)."""
    return _replay(prog, gpu, start, [], probe=[])


@pytest.mark.parametrize("seed", range(40))
def test_programs_replay_as_kernel_by_kernel(seed):
    rng = random.Random(seed)
    ops, waits = [], {}
    for seq in range(rng.randint(2, 40)):
        h = rng.choice([0.0, 0.0, 1.0, 15.0])
        if rng.random() < 0.15:  # an overlapped all-to-all or bucket: the kernels after it slow down
            ops.append(Op(seq, "collective", "comm", rng.uniform(5, 150), comm_kind="ep", op="all_to_all",
                          host_us=h))
        else:
            ops.append(Op(seq, "compute", "compute", rng.uniform(0.5, 60), slowdown=rng.choice([0.0, 0.2, 0.5]),
                          slowed_us=rng.choice([0.0, 0.3]), host_us=h, host_sync=rng.random() < 0.05,
                          op_class="gemm"))
            comms = [o.seq for o in ops if o.kind == "collective"]
            if comms and rng.random() < 0.1:
                waits[seq] = (rng.choice(comms),)
    prog = Program(ops, waits=waits)
    for _ in range(4):
        start = rng.uniform(0, 300)
        host = start + rng.uniform(-400, 100)
        got_gpu, want_gpu = busy_gpu(random.Random(seed), start), busy_gpu(random.Random(seed), start)
        got_gpu.host = want_gpu.host = host
        got, want = replay(prog, got_gpu, start), reference(prog, want_gpu, start)
        assert got.end == pytest.approx(want.end, abs=1e-6)
        assert got.compute_us == pytest.approx(want.compute_us, abs=1e-6)
        assert got.slowdown_us == pytest.approx(want.slowdown_us, abs=1e-6)
        assert got_gpu.host == pytest.approx(want_gpu.host, abs=1e-9)
        for kind in set(got.exposed) | set(want.exposed):
            assert got.exposed.get(kind, 0.0) == pytest.approx(want.exposed.get(kind, 0.0), abs=1e-6), kind
