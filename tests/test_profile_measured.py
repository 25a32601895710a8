"""Measured mode on this CPU, on real traces of the tiny workloads: repeatability and the cache.

Timings on a shared 2-core machine are noisy; the measurement (1 thread, batched samples, the
minimum over windows spread across the run) must still agree with itself: 95% of kernels within
10% (around the common factor by which the machine's speed moved every kernel), every kernel
within 50%, their sum within 5%. When the machine itself changes speed between the two profiles
(re-timed probe calls drift by over 10%, all kernels moved by over 5%, or the load is over twice
the cores) only looser bounds are asserted and the test says so by skipping.
"""

from __future__ import annotations

import os
import statistics
import timeit

import pytest
import torch

from echo.config import load_hardware, load_workload
from echo.io import read_parquet
from echo.profile import distinct_kernels, run_profile
from echo.profile import measure as measure_mod
from echo.trace import run_trace

# the kernels' own timings are compared; the eager per-op charge is measured once per CPU
# real kernel timing, minutes; timing: run alone (make test), a busy neighbour moves what they bound
pytestmark = [pytest.mark.usefixtures("fixed_eager_step"), pytest.mark.slow, pytest.mark.timing]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    out = {}
    for name in ("tiny-tp2", "tiny-dp2", "tiny-pp2"):
        d = tmp_path_factory.mktemp(name)
        run_trace(load_workload(name), d)
        out[name] = d
    return out


def rows(path):
    return {r["kernel_key"]: r for r in read_parquet(path).to_pylist()}


class _MachineSpeed:
    """Best times of three fixed calls on tensors allocated once (a memory-bound add over 64 MiB,
    a cache-resident matmul, and a 256-element add whose time is the per-call overhead that most
    of the tiny workloads' kernels are made of): re-timed between the profiles they show whether
    the machine itself got slower or faster (a neighbour on the memory bus, a clock change). The
    same buffers each time, so a new allocation's page placement cannot pass for a change of the
    machine."""

    def __init__(self):
        self.x, self.a, self.t = torch.ones(16 * 2**20), torch.ones(256, 256), torch.ones(256)

    def __call__(self) -> list[float]:
        calls = ((lambda: self.x.add_(1.0), 5), (lambda: self.a @ self.a, 50), (lambda: self.t.add_(1.0), 2000))
        with measure_mod.torch_threads(1), torch.no_grad():
            return [min(timeit.repeat(f, number=n, repeat=15)) / n for f, n in calls]


def test_repeated_profiling_agrees_within_10pct_per_kernel(traces, tmp_path):
    hw = load_hardware("local-cpu")
    trace = traces["tiny-tp2"]
    machine_speed = _MachineSpeed()
    load, speed = [os.getloadavg()[0]], [machine_speed()]
    for i in (1, 2):  # two independent profiles: separate caches, every kernel timed twice
        run_profile(hw, trace, tmp_path / f"k{i}.parquet", cache_dir=tmp_path / f"cache{i}")
        load.append(os.getloadavg()[0])
        speed.append(machine_speed())
    first, second = rows(tmp_path / "k1.parquet"), rows(tmp_path / "k2.parquet")
    measured = [k for k, r in first.items() if r["source"] == "measured"]
    assert len(measured) >= 0.9 * len(first) and len(first) > 40
    spread = sorted(((max(first[k]["duration_us"], second[k]["duration_us"]) /
                      min(first[k]["duration_us"], second[k]["duration_us"]), first[k]["name"], first[k]["shapes"])
                     for k in measured), reverse=True)
    drift = max(max(col) / min(col) for col in zip(*speed, strict=True))
    assert all(first[k]["threads"] == second[k]["threads"] == measure_mod.MEASURE_THREADS == 1 for k in measured)
    # a change of the whole machine's speed between the profiles moves every kernel alike: the
    # measurement's own repeatability is the spread around that common factor
    common = statistics.median(second[k]["duration_us"] / first[k]["duration_us"] for k in measured)
    ratios = [max(q, 1 / q) for q in (second[k]["duration_us"] / first[k]["duration_us"] / common for k in measured)]
    within = sum(r <= 1.10 for r in ratios) / len(ratios)
    print("worst five (ratio, op, shapes):", spread[:5], "probe drift", drift, "common factor", common, "load", load)
    total = [sum(run[k]["duration_us"] for k in measured) for run in (first, second)]
    tight = within >= 0.95 and max(total) / min(total) <= 1.05 and spread[0][0] <= 1.5
    busy = max(load) > 2 * (os.cpu_count() or 1) or drift > 1.10 or max(common, 1 / common) > 1.05
    if not tight and busy:
        # the machine changed speed under the profiles: what can still be asked is that most
        # kernels and their sum agree loosely around that change (this 2-core VM drifts by up to
        # 23% between profiles even when idle: half the kernels within 10%, the sum within 25% of
        # the common factor catch a broken timer, not a noisy one); the tight bounds need a
        # machine that holds still
        moved = total[1] / (total[0] * common)
        assert within >= 0.5 and max(moved, 1 / moved) <= 1.25, (within, total, common, spread[:5])
        pytest.skip(f"machine changed speed between profiles (probe drift {drift:.2f}, common factor "
                    f"{common:.2f}, 1-min load "
                    f"{max(load):.1f} on {os.cpu_count()} cores): {within:.0%} of kernels within 10%, "
                    f"worst {spread[0]}")
    # what the simulator consumes: the bulk of kernels and their sum must repeat tightly; the few
    # kernels outside 10% may drift further when a neighbour shares the memory bus through one
    # profile (CI saw the optimizer step and the gradient norm over the same 2.7M parameters, 42 and
    # 11 MB streamed, both 1.27x slower in one profile while the other kernels held within 8% and the
    # probes within 6%): they are bounded loosely, a broken timer is off by far more
    assert within >= 0.95, (within, spread[:5])
    assert max(total) / min(total) <= 1.05, total
    assert spread[0][0] <= 1.5, spread[:5]


def test_a_second_workload_times_only_its_new_kernels(traces, tmp_path):
    hw, cache = load_hardware("local-cpu"), tmp_path / "cache"
    dp2 = {k.kernel_key for k in distinct_kernels(read_parquet(traces["tiny-dp2"] / "ops.parquet"))}
    pp2 = {k.kernel_key for k in distinct_kernels(read_parquet(traces["tiny-pp2"] / "ops.parquet"))}
    assert dp2 & pp2 and pp2 - dp2  # the tiny workloads share their layers' kernels, not all of them
    first = run_profile(hw, traces["tiny-dp2"], tmp_path / "dp2.parquet", cache_dir=cache)
    second = run_profile(hw, traces["tiny-pp2"], tmp_path / "pp2.parquet", cache_dir=cache)
    new_in_pp2 = len(pp2 - dp2)
    assert first["measure"]["cached"] == 0
    # fallbacks to the model are not cached: they may count again, but nothing shared is re-timed
    assert second["measure"]["timed"] + second["measure"]["modelled"] - first["measure"]["modelled"] <= new_in_pp2
    assert second["measure"]["timed"] >= new_in_pp2 - second["measure"]["modelled"]
    assert second["measure"]["cached"] >= len(pp2 & dp2) - first["measure"]["modelled"]
    a, b = rows(tmp_path / "dp2.parquet"), rows(tmp_path / "pp2.parquet")
    shared = [k for k in pp2 & dp2 if a[k]["source"] == "measured"]
    # read back, not re-timed (the in-loop factor is the workload's own: of its op classes in its trace)
    assert all(a[k]["isolated_us"] == b[k]["isolated_us"] for k in shared)
    assert all(b[k]["duration_us"] == pytest.approx(b[k]["isolated_us"] * b[k]["inloop_factor"] + b[k]["host_us"])
               for k in shared)  # host_us: the eager engine's per-op time (fixed here, FIXED_EAGER)
    # only the tasks holding new kernels were replayed in order
    assert first["measure"]["inloop"]["cached"] == 0 and first["measure"]["inloop"]["replayed"] > 0
    assert second["measure"]["inloop"]["cached"] >= 0.9 * len(shared)
    # the same workload again: nothing is timed or replayed, and the durations repeat exactly
    again = run_profile(hw, traces["tiny-pp2"], tmp_path / "pp2b.parquet", cache_dir=cache)
    assert again["measure"]["timed"] == 0 and again["measure"]["inloop"]["replayed"] == 0
    c = rows(tmp_path / "pp2b.parquet")
    assert all(c[k]["duration_us"] == b[k]["duration_us"] for k in b)


def test_in_loop_replay_times_every_kernel_in_recorded_order_with_outputs_chained(traces):
    import pyarrow.parquet as pq

    from echo.profile import inloop

    ops = pq.read_table(traces["tiny-dp2"] / "ops.parquet").to_pylist()
    deps = pq.read_table(traces["tiny-dp2"] / "deps.parquet").to_pylist()
    chained: list[int] = []
    real_chain = inloop._chain

    def counting(args, produced):
        chained.append(len(produced))
        return real_chain(args, produced)

    inloop._chain = counting
    try:
        times = inloop.replay_times(ops, deps, repeats=1, windows=1)
    finally:
        inloop._chain = real_chain
    kernels = {o["kernel_key"] for o in ops if o["kind"] in ("compute", "memcpy")}
    assert set(times) == kernels and all(t > 0 for t in times.values())
    # most ops of a task read what an earlier op of the same task wrote (forward: the residual
    # stream through every layer), and those inputs are the earlier ops' real outputs
    in_task = sum(1 for t in inloop.tasks_of(ops).values() for _ in t)
    assert len(chained) > 0.4 * in_task * 2  # warm-up + one timed replay
    # only the tasks holding a wanted kernel are replayed
    opt = next(o for o in ops if o["phase"] == "optimizer" and o["kind"] == "compute")
    assert set(inloop.replay_times(ops, deps, {opt["kernel_key"]}, repeats=1, windows=1)) == {
        o["kernel_key"] for o in ops if o["phase"] == "optimizer" and o["kind"] in ("compute", "memcpy")}
