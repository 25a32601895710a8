"""GPU-to-GPU speed spread and stragglers (echo.simulate.variability): the order statistics, the
symmetric quantiles against full mode's explicitly sampled ranks, and stragglers in each kind
of group against hand-computed steps."""

from __future__ import annotations

import math
import random

import numpy as np
import pyarrow as pa
import pytest
from test_simulate import HARDWARE, NET_US, NONE, TOPOLOGY, FakeNet, make_workload, write_inputs

from echo.artifacts import KERNELS
from echo.config.figure import Figure
from echo.config.hardware import Variability
from echo.io import write_parquet
from echo.simulate import run_simulate
from echo.simulate.variability import (
    absorbed_by,
    expected_max_normal,
    nested_groups,
    quantile_max_normal,
    stage_factors,
    step_quantiles,
)

SIGMA = 0.013
SPREAD = HARDWARE.model_copy(update={"variability": Variability(
    speed_sigma=Figure(value=SIGMA, status="assumed", basis="test"))})


def simulate(tmp_path, w, out: str, *, hardware=HARDWARE, **kw) -> dict:
    if not (tmp_path / "trace").exists():
        write_inputs(tmp_path, w)
    return run_simulate(w, hardware, TOPOLOGY, tmp_path / "trace", tmp_path / "rank_classes.parquet",
                        tmp_path / "kernels.parquet", tmp_path / "calib", tmp_path / out, network=FakeNet(NET_US),
                        overlap=NONE, **kw).to_pylist()[0]


def test_order_statistics_of_normal_maxima():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi))  # E[max(Z1, Z2)] = 1 / sqrt(pi)
    rng = np.random.default_rng(0)
    for n in (8, 1024):
        sample = rng.standard_normal((20_000, n)).max(axis=1)
        assert expected_max_normal(n) == pytest.approx(sample.mean(), abs=0.01)
        for q in (0.5, 0.9, 0.99):
            assert quantile_max_normal(n, q) == pytest.approx(np.quantile(sample, q), abs=0.03)
    with pytest.raises(ValueError, match="quantile"):
        quantile_max_normal(8, 1.0)


def test_the_nested_synchronizations_share_the_expected_slowdown():
    groups = nested_groups(tp=8, cp=1, pp=4, dp=32)
    assert groups == {"tp": 8, "pp": 32, "dp": 1024}
    absorbed = absorbed_by(2.0, SIGMA, groups)
    assert absorbed["tp"] == pytest.approx(SIGMA * expected_max_normal(8) * 2.0)
    assert sum(absorbed.values()) == pytest.approx(SIGMA * expected_max_normal(1024) * 2.0)
    q = step_quantiles(10.0, 2.0, SIGMA, 1024)
    assert q[0.5] == pytest.approx(10.0 + SIGMA * quantile_max_normal(1024, 0.5) * 2.0)
    assert q[0.5] < q[0.9] < q[0.99]
    assert step_quantiles(10.0, 2.0, 0.0, 1024) == {0.5: 10.0, 0.9: 10.0, 0.99: 10.0}


def test_the_summary_carries_the_quantiles(tmp_path):
    w = make_workload(tp=2, pp=2, dp=2)
    s = simulate(tmp_path, w, "spread", hardware=SPREAD)
    assert s["speed_sigma"] == SIGMA
    expected = step_quantiles(s["step_time_s"], s["compute_s"], SIGMA, 8)
    assert [s["step_p50_s"], s["step_p90_s"], s["step_p99_s"]] == pytest.approx(list(expected.values()))
    assert s["step_mean_s"] == pytest.approx(s["step_time_s"] + s["variance_tp_s"] + s["variance_pp_s"] + s["variance_dp_s"])
    alike = simulate(tmp_path, w, "alike")  # a hardware file without a spread: every GPU alike
    assert alike["step_p99_s"] == alike["step_time_s"] and alike["variance_dp_s"] == 0.0


def _sampled(tmp_path, w, samples: int) -> tuple[dict, list[float], list[float]]:
    """The symmetric summary, and per sample full mode's step and the order-statistics step."""
    sym = simulate(tmp_path, w, "sym", hardware=SPREAD)
    full, predicted = [], []
    for i in range(samples):
        rng = random.Random(i)
        scale = {r: 1 + SIGMA * rng.gauss(0.0, 1.0) for r in range(w.world_size)}
        full.append(simulate(tmp_path, w, f"full{i}", mode="full", compute_scale=scale, summary_only=True)["step_time_s"])
        predicted.append(sym["step_time_s"] + (max(scale.values()) - 1) * sym["compute_s"])
    return sym, full, predicted


def test_each_sampled_job_steps_as_its_slowest_gpu(tmp_path):
    """Full mode replays every rank with its own factor; the step is the ideal one plus the
    slowest GPU's excess on the critical stage's compute, sample by sample."""
    w = make_workload(tp=2, pp=4, dp=4, global_batch=32)
    _, full, predicted = _sampled(tmp_path, w, 10)
    for f, p in zip(full, predicted, strict=True):
        assert f == pytest.approx(p, rel=0.02)


@pytest.mark.slow
def test_symmetric_quantiles_of_a_1024_gpu_job_match_full_mode_sampling(tmp_path):
    w = make_workload(tp=8, pp=2, dp=64, global_batch=128)
    assert w.world_size == 1024
    sym, full, predicted = _sampled(tmp_path, w, 20)
    for f, p in zip(full, predicted, strict=True):
        assert f == pytest.approx(p, rel=0.02)
    assert float(np.quantile(full, 0.5)) == pytest.approx(sym["step_p50_s"], rel=0.02)
    # twenty samples put their 99th percentile at the largest: within the spread of the maximum
    assert float(np.quantile(full, 0.99)) == pytest.approx(sym["step_p99_s"], rel=0.02)


# --- stragglers: one GPU 10% slower -------------------------------------------------------------
# The synthetic trace (test_simulate.trace_stage): forward 100 us + a 10 us TP all-reduce, backward
# 200 + 10, p2p sends 5, a 30 us reduce-scatter, adam 50, a 20 us all-gather.


@pytest.mark.parametrize("rank,kind", [(1, "tp"), (2, "dp"), (3, "tp and dp")])
def test_a_straggler_in_a_tp_or_dp_group(tmp_path, rank, kind):
    # TP2 DP2, one stage, 2 micro-batches: 2 x (100 + 10 + 200 + 10) + 30 + 50 + 20 = 740 us.
    # A 10% slower GPU: its TP partner waits at every all-reduce, its DP partner at the
    # reduce-scatter and the all-gather: 2 x (110 + 10 + 220 + 10) + 30 + 55 + 20 = 805 us.
    w = make_workload(tp=2, pp=1, dp=2, global_batch=4)
    ideal = simulate(tmp_path, w, "ideal")
    assert ideal["step_time_s"] == pytest.approx(740e-6)
    for mode in ("symmetric", "full"):
        s = simulate(tmp_path, w, f"{mode}", mode=mode, stragglers={rank: 1.1})
        assert s["step_time_s"] == pytest.approx(805e-6), (kind, mode)


@pytest.mark.parametrize("stage,expected_us", [(0, 785.0), (1, 780.0)])
def test_a_straggler_in_a_pipeline_stage(tmp_path, stage, expected_us):
    # PP2 TP2, one micro-batch. Stage 0: F 110, send 5, (stage 1: F 110, B 210), send 5, B 210,
    # reduce-scatter 30, adam 50, all-gather 20: 750 us. A slow GPU on stage 0 makes its F 120,
    # B 230 and adam 55: 785; on stage 1 its F and B take 120 and 230 inside stage 0's wait: 780.
    w = make_workload(tp=2, pp=2, dp=1, global_batch=1)
    assert simulate(tmp_path, w, "ideal")["step_time_s"] == pytest.approx(750e-6)
    rank = 2 * stage  # rank = tp + 2 x pp here
    for mode in ("symmetric", "full"):
        s = simulate(tmp_path, w, mode, mode=mode, stragglers={rank: 1.1})
        assert s["step_time_s"] == pytest.approx(expected_us * 1e-6), mode


def test_stragglers_are_checked():
    assert stage_factors({1: 1.1, 0: 1.3, 3: 1.05}, {0: 0, 1: 0, 2: 1, 3: 1}) == {0: 1.3, 1: 1.05}
    with pytest.raises(ValueError, match="rank 9 is not in the job"):
        stage_factors({9: 1.1}, {0: 0})
    with pytest.raises(ValueError, match="must be > 0"):
        stage_factors({0: 0.0}, {0: 0})


# --- heterogeneous jobs: stages or replicas on different GPU models -------------------------------


def _slow_kernels(tmp_path, factor: float):
    """A second GPU model's kernels.parquet: every kernel of the synthetic trace ``factor`` slower."""
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "kernels.parquet").to_pylist()
    for r in table:
        r["duration_us"] *= factor
    path = tmp_path / "slow_kernels.parquet"
    write_parquet(pa.Table.from_pylist(table, schema=KERNELS), path)
    return path


def test_a_stage_on_a_slower_gpu_runs_as_a_straggler_stage(tmp_path):
    # PP2 TP2, one micro-batch, stage 1 on a GPU whose kernels take twice as long: its F and B take
    # 200 and 400 inside stage 0's wait, 750 + 100 + 200 = 1050 us, as a 2x straggler there
    w = make_workload(tp=2, pp=2, dp=1, global_batch=1)
    simulate(tmp_path, w, "ideal")
    slow = _slow_kernels(tmp_path, 2.0)
    mixed = simulate(tmp_path, w, "mixed", stage_kernels={1: [slow]})
    assert mixed["step_time_s"] == pytest.approx(1050e-6)
    assert mixed["step_time_s"] == pytest.approx(simulate(tmp_path, w, "straggler", stragglers={2: 2.0})["step_time_s"])
    # a stage's list replaces the job's model there: stage 0 on the slow model, stage 1 on the fast
    # one: F 200 + 10, send 5, (110, 210), send 5, B 400 + 10, reduce-scatter 30, adam 100,
    # all-gather 20: 1100 us
    fast = tmp_path / "kernels.parquet"
    assert simulate(tmp_path, w, "back", stage_kernels={0: [slow], 1: [fast]})["step_time_s"] == pytest.approx(1100e-6)


def test_replicas_on_a_mix_of_gpus_run_at_the_slowest(tmp_path):
    # TP2 DP2 on H100s and A100s alike: every stage takes the slower model's programs
    w = make_workload(tp=2, pp=1, dp=2, global_batch=4)
    simulate(tmp_path, w, "ideal")
    slow = _slow_kernels(tmp_path, 1.5)
    mixed = simulate(tmp_path, w, "mixed", stage_kernels={0: [tmp_path / "kernels.parquet", slow]})
    # 2 x (150 + 10 + 300 + 10) + 30 + 75 + 20 = 1065 us
    assert mixed["step_time_s"] == pytest.approx(1065e-6)
    with pytest.raises(ValueError, match="pipeline stages \\[3\\]"):
        simulate(tmp_path, w, "bad", stage_kernels={3: [slow]})
    # full mode, rank by rank: the second replica (ranks 2 and 3) on the slower model; the first
    # waits for it at the gradient reduce-scatter and all-gather, the step is the same
    full = simulate(tmp_path, w, "full", mode="full", rank_kernels={2: slow, 3: slow})
    assert full["step_time_s"] == pytest.approx(1065e-6)
    with pytest.raises(ValueError, match="rank_kernels .* needs mode='full'"):
        simulate(tmp_path, w, "sym", rank_kernels={2: slow})


def test_a_stage_on_a_slower_gpu_in_full_mode(tmp_path):
    # PP2 TP2, stage 1's ranks (2 and 3) on a 2x slower model, rank by rank: as symmetric mode's
    # stage_kernels (1050 us, test_a_stage_on_a_slower_gpu_runs_as_a_straggler_stage)
    w = make_workload(tp=2, pp=2, dp=1, global_batch=1)
    simulate(tmp_path, w, "ideal")
    slow = _slow_kernels(tmp_path, 2.0)
    full = simulate(tmp_path, w, "full", mode="full", rank_kernels={2: slow, 3: slow})
    assert full["step_time_s"] == pytest.approx(1050e-6)
    assert full["step_time_s"] == pytest.approx(simulate(tmp_path, w, "sym", stage_kernels={1: [slow]})["step_time_s"])


def test_the_simulate_command_parses_stragglers_and_stage_hardware(capsys):
    from echo.cli import build_parser

    args = build_parser().parse_args(["simulate", "--workload", "w", "--hardware", "h", "--topology", "t",
                                      "--straggler", "17:1.1", "--stage-hardware", "4-7:a100-sxm-80gb",
                                      "--stage-hardware", "2:h200-sxm-141gb", "--replica-hardware", "a100-sxm-80gb"])
    assert args.straggler == [(17, 1.1)]
    assert args.stage_hardware == [((4, 5, 6, 7), "a100-sxm-80gb"), ((2,), "h200-sxm-141gb")]
    assert args.replica_hardware == ["a100-sxm-80gb"]
    for bad in (["--straggler", "17"], ["--straggler", "3:0"], ["--stage-hardware", "7-4:a100-sxm-80gb"],
                ["--stage-hardware", "all:a100-sxm-80gb"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["simulate", "--workload", "w", "--hardware", "h", "--topology", "t", *bad])
        assert exc.value.code == 2
    assert "RANK:FACTOR" in capsys.readouterr().err


def test_a_stage_on_a_smaller_gpu_must_fit_its_memory(tmp_path):
    # every stage of the synthetic trace holds the same memory; a stage on a GPU with less memory
    # than that does not fit, though the job's own GPU holds it
    w = make_workload(tp=2, pp=2, dp=1, global_batch=1)
    ideal = simulate(tmp_path, w, "ideal")
    need = max(ideal["stage_device_mem_gib"])
    assert ideal["fits"] and ideal["stage_capacity_gib"] == [HARDWARE.memory_gib] * 2
    slow = _slow_kernels(tmp_path, 1.0)
    small = simulate(tmp_path, w, "small", stage_kernels={1: [slow]}, stage_memory_gib={1: need * 0.9})
    assert not small["fits"] and small["stage_capacity_gib"] == [HARDWARE.memory_gib, need * 0.9]
    large = simulate(tmp_path, w, "large", stage_kernels={1: [slow]}, stage_memory_gib={1: need * 1.1})
    assert large["fits"]
