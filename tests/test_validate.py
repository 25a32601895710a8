"""Validation: real multi-process training (measure), compare, published tables, rules.

The real runs are short (a few steps of the tiny GPT) and assert consistency, never absolute
wall times: samples are positive and agree with their median, the job trains (the loss falls)
and data-parallel replicas end with identical parameters.
"""

from __future__ import annotations

import csv
import random
import statistics
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, dry_run, job

from echo.config import load_hardware, load_topology, load_workload
from echo.config.loader import parse_workload
from echo.errors import ConfigError
from echo.training.data_parallel import bucket_members, buckets
from echo.training.run import EVENTS
from echo.validate import bridge
from echo.validate.compare import COMPARE, compare_table
from echo.validate.measure import (
    MEASURED,
    MIN_CLEAN,
    PHASES,
    MeasureRefused,
    check_measurable,
    run_measure,
    step_times,
)
from echo.validate.published import (
    megatron_flops,
    published_rows,
    published_table,
    sc21_flops,
    table_errors,
    virtual_stages,
    workload_yaml,
)
from echo.validate.targets import measured_here, published_targets


def tiny(name: str = "tiny-dp2", training: dict | None = None, **parallel) -> object:
    w = load_workload(name)
    data = w.model_dump(exclude={"name"})
    data["parallel"].update(parallel)
    data["training"].update(training or {})
    return parse_workload(data, Path(f"config/workloads/{name}.yaml"))


# --- data-parallel buckets --------------------------------------------------------------------


@pytest.mark.parametrize("dp", [1, 2, 8])
def test_bucket_members_fill_the_tracer_buckets(dp):
    rng = random.Random(dp)
    for _ in range(20):
        numels = [rng.choice([64, 4096, 3_000_000, 25_000_000]) for _ in range(rng.randint(1, 30))]
        members = bucket_members(numels, dp)
        assert sorted(i for m in members for i in m) == list(range(len(numels)))  # each parameter once
        assert [i for m in members for i in m] == list(reversed(range(len(numels))))  # backward order
        sizes = [-(-sum(numels[i] for i in m) // dp) * dp for m in members]
        assert sizes == buckets(numels, dp)


# --- what fits -------------------------------------------------------------------------------


def test_big_workloads_are_refused_with_file_and_reason():
    with pytest.raises(MeasureRefused) as err:
        check_measurable(load_workload("gpt3-175b"))
    msg = str(err.value)
    assert "config/workloads/gpt3-175b.yaml" in msg and "too big to train here" in msg and "GiB" in msg


def test_tiny_fits_but_not_in_a_tiny_machine():
    check_measurable(load_workload("tiny-dp2"), memory_bytes=16 << 30, cores=2)
    with pytest.raises(MeasureRefused, match="too big"):
        check_measurable(load_workload("tiny-dp2"), memory_bytes=256 << 20, cores=2)
    with pytest.raises(MeasureRefused, match="processes per core"):
        check_measurable(tiny(dp=16, training={"global_batch": 32}), memory_bytes=1 << 40, cores=2)
    with pytest.raises(MeasureRefused, match="too slow"):
        check_measurable(load_workload("tiny-dp2"), memory_bytes=16 << 30, cores=2, max_step_s=1e-3)


def test_unsupported_features_are_refused_before_any_process():
    with pytest.raises(MeasureRefused, match="parallel.zero"):
        check_measurable(tiny(zero=3))


# --- real runs ---------------------------------------------------------------------------------


def _check_run(w, out: Path, iters: int):
    measured = pq.read_table(out / "measured.parquet")
    phases = pq.read_table(out / "phases.parquet")
    events = pq.read_table(out / "events.parquet")
    assert measured.schema.names[: len(MEASURED)] == MEASURED.names
    assert phases.schema.names[: len(PHASES)] == PHASES.names
    assert events.schema.names == EVENTS.names
    rows = measured.to_pylist()
    samples = [r["step_time_s"] for r in rows]
    assert len(samples) == iters and all(s > 0 for s in samples)
    clean = [r["step_time_s"] for r in rows if r["clean"]]
    headline = statistics.median(clean) if len(clean) >= MIN_CLEAN else statistics.median(samples)
    assert rows[0]["median_step_time_s"] == pytest.approx(headline)
    assert rows[0]["median_all_step_time_s"] == pytest.approx(statistics.median(samples))
    assert all(r["run_delay_s"] is None or r["run_delay_s"] >= 0 for r in rows)
    assert max(samples) < 5 * min(samples)  # consistent samples, whatever the machine's speed
    assert rows[0]["loss_last"] < rows[0]["loss_first"]  # it trains
    # the step time is the span of the ranks' step intervals
    assert step_times(events) == pytest.approx(dict(enumerate(samples)))
    # every rank ran every forward and backward of the schedule in every step
    per_step = w.micro_batches * w.parallel.virtual_stages
    for rank in range(w.world_size):
        for kind in ("forward", "backward"):
            n = sum(1 for e in events.to_pylist() if e["rank"] == rank and e["kind"] == kind and not e["profiled"]
                    and e["iteration"] >= 0)
            assert n == per_step * iters, (rank, kind)
    # phases of a rank fit in its step; the profiled operators fit in their phases
    for r in phases.to_pylist():
        step = next(p["wall_s"] for p in phases.to_pylist() if p["rank"] == r["rank"] and p["phase"] == "step")
        if r["phase"] != "step":
            assert 0 <= r["wall_s"] <= step * 1.01
        if r["op_s"] is not None and r["profiled_wall_s"]:
            assert r["op_s"] <= r["profiled_wall_s"] * 1.05
    return rows, phases


@pytest.mark.slow  # a real training run
def test_measure_trains_data_parallel_zero1_for_real(tmp_path):
    w = load_workload("tiny-dp2-zero1")
    run_measure(w, tmp_path, warmup=1, iters=2)
    rows, phases = _check_run(w, tmp_path, iters=2)
    # the gradient reduction ran on both ranks (replicas agreeing is checked by run_measure itself)
    assert {(r["rank"], r["phase"]) for r in phases.to_pylist()} >= {(0, "grad_sync"), (1, "grad_sync")}
    assert all(r["world_size"] == 2 for r in rows)


@pytest.mark.slow  # a real training run
def test_measure_runs_the_interleaved_pipeline(tmp_path):
    w = load_workload("tiny-pp2-interleaved")
    run_measure(w, tmp_path, warmup=1, iters=2, profile=False)
    _, phases = _check_run(w, tmp_path, iters=2)
    # stage 0 waits for activations from stage 1 (the second chunk wraps around the pipeline)
    waits = {r["rank"]: r["wall_s"] for r in phases.to_pylist() if r["phase"] == "recv"}
    assert set(waits) == {0, 1} and all(v > 0 for v in waits.values())


# --- compare -----------------------------------------------------------------------------------


def test_compare_lines_up_items_and_errors():
    summary = {"workload": "w", "hardware": "local-cpu", "topology": "local-gloo", "step_time_s": 1.0,
               "compute_s": 0.8, "exposed_tp_s": 0.1, "critical_stage": 0}
    timeline = pa.table({"pp_rank": [0, 0, 0, 0], "stream": ["compute", "compute", "compute", "comm"],
                         "kind": ["forward", "backward", "optimizer", "collective"],
                         "name": ["F0", "B0", "optimizer", "grad_sync"],
                         "start_s": [0.0, 0.3, 0.9, 0.85], "end_s": [0.3, 0.85, 1.0, 0.9]})
    measured = pa.table({"median_step_time_s": [1.25]})
    phases = pa.Table.from_pylist([
        {"rank": r, "pp_rank": 0, "phase": ph, "wall_s": wall, "op_s": op, "comm_s": comm}
        for r in (0, 1) for ph, wall, op, comm in (("forward", 0.4, 0.3, 0.05), ("backward", 0.6, 0.5, 0.05),
                                                    ("optimizer", 0.1, 0.1, None), ("grad_sync", 0.1, None, 0.1))])
    t = compare_table(summary, timeline, measured, phases)
    assert t.schema == COMPARE
    got = {(r["item"], r["stage"]): r for r in t.to_pylist()}
    assert got[("step_time", -1)]["error"] == pytest.approx(1.0 / 1.25 - 1)
    assert got[("forward", 0)]["predicted_s"] == pytest.approx(0.3)
    assert got[("forward", 0)]["error"] == pytest.approx(0.3 / 0.4 - 1)
    assert got[("grad_sync", 0)]["predicted_s"] == pytest.approx(0.05)
    assert got[("wait", 0)]["measured_s"] == pytest.approx(1.25 - 1.2)
    assert got[("kernels", -1)]["measured_s"] == pytest.approx(0.9)  # operators of fwd + bwd + optimizer
    assert got[("tp_comm", -1)]["error"] == pytest.approx(0.1 / 0.1 - 1)


def test_measurements_here_compare_only_with_this_machine():
    cpu, gloo = load_hardware("local-cpu"), load_topology("local-gloo")
    assert measured_here(cpu, gloo) == []
    with pytest.raises(ConfigError, match="kind"):
        measured_here(load_hardware("a100-sxm-80gb"), gloo)
    with pytest.raises(ConfigError, match="calibration.source"):
        measured_here(cpu, load_topology("dgx-a100-hdr"))


# --- published tables ----------------------------------------------------------------------------


def test_sc21_flop_formula_reproduces_the_derived_iteration_times(reference):
    with (reference / "megatron_sc21_table1_a100.csv").open() as f:
        for r in csv.DictReader(f):
            flops = sc21_flops(int(r["global_batch"]), int(r["seq_len"]), int(r["layers"]), int(r["hidden"]),
                               int(r["vocab"]))
            step = flops / (int(r["gpus"]) * float(r["tflops_per_gpu"]) * 1e12)
            assert step == pytest.approx(float(r["iter_time_s_derived"]), abs=0.006), r["params_B"]


def test_megatron_flop_formula_reproduces_the_published_mfu(reference):
    with (reference / "megatron_core_h100.csv").open() as f:
        for r in csv.DictReader(f):
            row = next(x for x in published_rows(reference) if x.name == f"mcore-h100-gpt-{r['model'].lower()}")
            flops = megatron_flops(int(r["global_batch"]), int(r["seq_len"]), int(r["layers"]), int(r["hidden"]),
                                   int(r["vocab"]))
            assert flops / (row.gpus * row.measured_step_s) / 989e12 == pytest.approx(
                float(r["mfu_pct"]) / 100, abs=0.006), r["model"]


def test_generated_workload_files_are_current_and_valid(reference):
    rows = published_rows(reference)
    counts = Counter(r.source.key for r in rows)
    # 10 SC21, 9 Megatron-Core; every Megatron-Bridge row is either a workload or left out with a reason
    assert counts["sc21"] == 10 and counts["mcore-h100"] == 9
    with (reference / "megatron_bridge_perf_all.csv").open() as f:
        table = sum(1 for line in f if not line.startswith("#")) - 1
    assert counts["mbridge"] + len(bridge.skipped(reference)) == table and counts["mbridge"] > 100
    # every row carries the split its table declared
    assert {r.split for r in rows if r.source.key == "mbridge"} == {"fit", "validation"}
    assert [r.label for r in rows if r.split == "fit" and r.source.key == "mcore-h100"] == ["7.1B", "32B", "119B", "314B"]
    for row in rows:
        path = REPO / "config" / "workloads" / f"{row.name}.yaml"
        assert path.read_text() == workload_yaml(row), f"{path} is stale: run python -m echo.validate.published"
        w = load_workload(row.name)
        assert w.world_size == row.gpus
        if row.source.key == "mbridge":  # the row states VP; n/a is one chunk
            assert (w.parallel.schedule == "interleaved") == (w.parallel.virtual_stages > 1)
        else:  # SC21 and Megatron-Core interleave whenever they pipeline (ROW_DEFAULTS)
            assert (w.parallel.schedule == "interleaved") == (w.parallel.pp > 1)


def test_virtual_stages_default():
    assert virtual_stages(96, 1) == 1
    assert virtual_stages(80, 8) == 2    # 10 layers per stage -> 2 chunks of 5
    assert virtual_stages(60, 4) == 3    # 15 -> 3 chunks of 5
    assert virtual_stages(92, 4) == 23   # 23 (prime) -> one layer per chunk
    assert virtual_stages(64, 64) == 1   # one layer per stage: nothing to interleave


def test_published_table_errors_and_worst_row(reference):
    rows = published_rows(reference)[:3]
    summaries = {r.name: {"step_time_s": r.measured_step_s * f} for r, f in zip(rows, (1.1, 0.8, 1.0), strict=True)}
    t = published_table(rows, summaries)
    assert [round(e, 6) for e in t["error"].to_pylist()] == [0.1, -0.2, 0.0]
    errs = table_errors(t)["sc21"]
    assert errs["mean_abs_error"] == pytest.approx(0.1)
    assert errs["worst"]["row"] == rows[1].label


def test_validate_settings_are_checked():
    from echo.workflow.settings import Settings

    assert Settings.from_config({}).validation.local[:3] == ("tiny-dp2", "tiny-tp2", "tiny-pp2")
    with pytest.raises(ConfigError, match="validate.locals"):
        Settings.from_config({"validate": {"locals": []}})


def test_published_targets_follow_the_reference_setting(tmp_path, monkeypatch):
    # validate.reference_dir is the setting of echo.reference, ahead of $ECHO_REFERENCE
    monkeypatch.setenv("ECHO_REFERENCE", str(tmp_path / "env"))
    assert published_targets(True, tmp_path) == ([], tmp_path)
    assert published_targets(True) == ([], tmp_path / "env")


def test_published_rows_can_be_chosen(reference):
    with pytest.raises(ConfigError, match="no published row"):
        published_targets(("sc21-gpt-2t",), reference)
    rows, _ = published_targets(("sc21-gpt-1.7b",), reference)
    assert [r.name for r in rows] == ["sc21-gpt-1.7b"]


# --- a published subset, end to end ---------------------------------------------------------------
# Rows small enough for CI, traced and simulated by the workflow; each row's |error| may not exceed
# the bound beside it (today's error, measured at the commit that set the bound, plus a margin).
PUBLISHED_SUBSET = {
    # A100, fp16, full recompute (validation row): +4.0% at 5588459; -10.9% once the traced step runs
    # SC21's fused scale-mask-softmax and bias-dropout-add kernels (memory-bound passes removed)
    # and the A100 HDR topology is the nccl-tests fit; cause of the remaining under-prediction open
    "sc21-gpt-1.7b": 0.14,
    "mcore-h100-gpt-1.7b": 0.35,     # H100 bf16, the smallest row: -27.7% (validation row; cause not isolated)
    # FP8 current scaling: -3.0% when the bound was set; -6.6% at 1e8f34d (GQA heads as they are: the
    # repeated K / V copies gone; sequence-parallel FP8 gathers earlier)
    "mbridge-h100-llama-3.1-70b-fp8cs-64g-tp4pp8cp1vp5ep1-gbs128mbs1-fp8ag": 0.08,
}


@pytest.mark.slow
def test_a_published_subset_end_to_end_within_its_bounds(workflow_copy, reference, monkeypatch):
    from conftest import snakemake

    monkeypatch.setenv("ECHO_REFERENCE", str(reference))
    cfg = workflow_copy / "subset.yaml"
    cfg.write_text(yaml.safe_dump({"validate": {"published": sorted(PUBLISHED_SUBSET)}}))
    proc = snakemake(workflow_copy, "results/validate/published.parquet", "--cores", "2", "--configfile", str(cfg))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = pq.read_table(workflow_copy / "results" / "validate" / "published.parquet").to_pylist()
    assert {r["workload"] for r in rows} == set(PUBLISHED_SUBSET)
    errors = {r["workload"]: r["error"] for r in rows}
    print(errors)
    assert all(abs(e) <= PUBLISHED_SUBSET[w] for w, e in errors.items()), errors


# --- rules ---------------------------------------------------------------------------------------


def test_validate_dag(workflow_copy):
    jobs = dry_run(workflow_copy, "results/validate/local.parquet")
    for w in ("tiny-dp2", "tiny-tp2", "tiny-pp2"):
        assert job("measure", workload=w) in jobs
        assert job("compare", workload=w, hardware="local-cpu", topology="local-gloo") in jobs
        assert job("simulate", workload=w, hardware="local-cpu", topology="local-gloo") in jobs
    assert job("validate_local") in jobs


def test_compare_refuses_a_gpu_prediction(workflow_copy):
    from conftest import snakemake

    proc = snakemake(workflow_copy, "-n", "results/validate/tiny-dp2/a100-sxm-80gb/dgx-a100-hdr/compare.parquet")
    assert proc.returncode != 0
    assert "compared only with a cpu hardware file" in proc.stdout + proc.stderr


def test_measure_refuses_a_big_workload_while_the_dag_is_built(workflow_copy):
    from conftest import snakemake

    proc = snakemake(workflow_copy, "-n", "results/measure/gpt3-175b/measured.parquet")
    assert proc.returncode != 0
    assert "config/workloads/gpt3-175b.yaml" in proc.stdout + proc.stderr
    assert "too big to train here" in proc.stdout + proc.stderr


def test_shipped_validation_layouts_are_small():
    for name in ("tiny-tp2pp2", "tiny-pp2-interleaved", "tiny-dp2-zero1", "tiny-dp2-recompute"):
        w = load_workload(name)
        check_measurable(w, memory_bytes=8 << 30, cores=2)
        assert yaml.safe_load((REPO / "config" / "workloads" / f"{name}.yaml").read_text())["description"]


# --- the real run's model and layout ------------------------------------------------------------


def test_real_run_splits_layers_as_the_workload_does():
    """Each rank builds its chunks from ``parallel.layers_of`` (uneven stage_layers included), as
    the tracer does, and the measure stage's estimates count the rank holding the most layers."""
    from echo.config.workload import Workload
    from echo.training.model import build_chunks
    from echo.validate.measure import estimate_rank_bytes, rank_layers

    spec = load_workload("tiny-pp2-interleaved").model_dump()
    spec["model"]["layers"] = 6
    even = Workload.model_validate(spec)
    spec["parallel"]["stage_layers"] = [3, 1, 1, 1]  # stage v*pp + s: rank 0 holds stages 0 and 2
    w = Workload.model_validate(spec)
    assert w.parallel.layers_of(6) == [3, 1, 1, 1] and even.parallel.layers_of(6) == [1, 1, 1, 1]
    built = {s: [len(c.blocks) for c in build_chunks(w, s)] for s in (0, 1)}
    assert built == {0: [3, 1], 1: [1, 1]}
    assert {s: [len(c.blocks) for c in build_chunks(even, s)] for s in (0, 1)} == {0: [1, 1], 1: [1, 1]}
    assert (rank_layers(w), rank_layers(even)) == (4, 2)
    assert estimate_rank_bytes(w) > estimate_rank_bytes(even)


@pytest.mark.slow
def test_compare_end_to_end(workflow_copy):
    """trace, profile, calibrate, simulate, measure and compare of tiny-dp2 through Snakemake."""
    from conftest import snakemake

    target = "results/validate/tiny-dp2/local-cpu/local-gloo/compare.parquet"
    proc = snakemake(workflow_copy, "--cores", "2", target, "--config", "measure={iters: 3, warmup: 1}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["item"], r["stage"]): r for r in pq.read_table(workflow_copy / target).to_pylist()}
    step = rows[("step_time", -1)]
    assert step["predicted_s"] > 0 and step["measured_s"] > 0
    assert step["error"] == pytest.approx(step["predicted_s"] / step["measured_s"] - 1)
    for item in ("forward", "backward", "optimizer", "grad_sync"):
        assert rows[(item, 0)]["predicted_s"] > 0 and rows[(item, 0)]["measured_s"] > 0, item
    measured = pq.read_table(workflow_copy / "results/measure/tiny-dp2/measured.parquet")
    assert measured.num_rows == 3


def test_local_gloo_calibration_runs_its_ranks_at_the_given_priority(monkeypatch):
    """The calibrate stage benchmarks gloo as the measure stage runs its ranks (measure.priority)."""
    import functools

    from echo import launch
    from echo.network import gloo_bench
    from echo.network.calibrate import calibrated_model

    seen = []

    class Stop(Exception):
        pass

    def popen(*args, **kwargs):
        seen.append(kwargs["preexec_fn"])
        raise Stop

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        calibrated_model(load_topology("local-gloo"), priority="rt")
    assert isinstance(seen[0], functools.partial) and seen[0].func is launch.prioritize and seen[0].args == ("rt",)
    with pytest.raises(ValueError, match="priority"):
        gloo_bench.run_gloo_benchmark(load_topology("local-gloo").calibration, priority="urgent")
