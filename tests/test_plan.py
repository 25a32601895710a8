"""Time-to-train (echo.plan): interruption rates, the checkpoint interval and the effective
training time, checkpoint sizes, energy and cost, each against numbers worked out by hand here,
and ``python -m echo plan`` with its errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pyarrow as pa
import pytest

from echo.artifacts import SUMMARY
from echo.config import CONFIG_ROOT, load_hardware, load_site, load_topology, load_workload
from echo.config.figure import Figure
from echo.config.hardware import GpuPower
from echo.errors import ConfigError
from echo.io import write_parquet
from echo.plan import plan, reliability
from echo.plan.checkpoint import checkpoint_cost, model_parameters
from echo.plan.energy import energy_mwh, gpu_power_w

SITE = load_site("meta-llama3-h100")
LLAMA3_PARAMETERS = 405_853_388_800  # model_parameters(llama3-405b-16k), test_parameters_are_counted_on_the_model


def test_every_site_file_loads_and_every_figure_has_a_basis():
    files = sorted((CONFIG_ROOT / "sites").glob("*.yaml"))
    assert files
    for f in files:
        site = load_site(f.stem)
        figures = [*(getattr(site.failures, k) for k in type(site.failures).model_fields),
                   site.restart_s, site.power.pue, site.power.host_overhead_w, *site.usd_per_gpu_hour.values()]
        assert all(isinstance(x, Figure) and x.basis for x in figures), f


def test_the_llama3_site_reproduces_the_reports_counts_over_its_own_exposure():
    """Rates derived from Table 5 give back its counts on its job: 16,384 GPUs, 2,048 hosts,
    16,384 links, 54 days (a check of the derivation, not a validation: the same data)."""
    parts = reliability.job_parts(16384, load_topology("dgx-h100-ndr"))
    assert parts == reliability.JobParts(16384, 2048, 16384)
    rates = reliability.interruption_rates(SITE.failures, parts)
    hours = 54 * 24
    counts = {k: v * hours for k, v in rates.items()}
    assert counts["gpu"] == pytest.approx(268, abs=0.1)
    assert counts["host"] == pytest.approx(53, abs=0.1)
    assert counts["link"] == pytest.approx(35, abs=0.1)
    assert counts["software"] == pytest.approx(63, abs=0.1)
    assert counts["planned"] == pytest.approx(47, abs=0.1)
    assert sum(counts.values()) == pytest.approx(466, abs=0.2)


def test_job_parts_count_servers_and_scale_out_links():
    nvl72 = load_topology("gb200-nvl72-64")  # 64 of 72 GPUs a rack, 4 GPUs a compute tray
    assert reliability.job_parts(64, nvl72) == reliability.JobParts(64, 16, 0)  # one NVLink domain: no NIC link
    assert reliability.job_parts(128, nvl72) == reliability.JobParts(128, 32, 128)
    dgx = load_topology("dgx-a100-hdr")
    assert reliability.job_parts(8, dgx) == reliability.JobParts(8, 1, 0)
    assert reliability.job_parts(1024, dgx) == reliability.JobParts(1024, 128, 1024)


def test_the_checkpoint_interval_is_dalys_and_maximizes_the_effective_training_time():
    save, mtti, restart, load = 12.8, 10_000.0, 600.0, 2.8
    tau = reliability.optimal_interval_s(save, mtti, restart)
    assert tau == pytest.approx(math.sqrt(2 * 12.8 * 10_600))  # 520.9 s
    ettr = reliability.effective_training_time_ratio(tau, save, restart, load, mtti)
    # by hand: 520.9 / 533.7 * (1 - (600 + 2.8 + 533.7 / 2) / 10,000)
    assert ettr == pytest.approx(tau / (tau + save) * (1 - (restart + load + (tau + save) / 2) / mtti))
    for other in (tau / 2, tau * 2):
        assert reliability.effective_training_time_ratio(other, save, restart, load, mtti) < ettr
    assert reliability.optimal_interval_s(6_000.0, 10_000.0) == 10_000.0  # save >= M/2: checkpoint once per M
    assert reliability.effective_training_time_ratio(1.0, 0.0, 1e6, 0.0, 10.0) == 0.0  # never recovers
    with pytest.raises(ValueError, match="interval"):
        reliability.effective_training_time_ratio(0.0, 1.0, 1.0, 1.0, 10.0)


def test_parameters_are_counted_on_the_model():
    # a GPT of hidden h, vocab V, seq S, L layers: embeddings V h + S h; per block 12 h^2 + 13 h;
    # final LayerNorm 2 h; untied head V h
    h, v, s, n = 256, 4096, 128, 4
    assert model_parameters(load_workload("tiny-dp2")) == v * h + s * h + n * (12 * h * h + 13 * h) + 2 * h + v * h
    # pipeline stages and tensor parallelism do not change the count
    assert model_parameters(load_workload("tiny-tp2pp2")) == model_parameters(
        load_workload("tiny-tp2pp2").model_copy(update={"parallel": load_workload("tiny-dp2").parallel}))


@pytest.mark.slow
def test_large_models_count_their_published_parameters():
    assert model_parameters(load_workload("llama3-405b-16k")) == LLAMA3_PARAMETERS  # 405B (Llama 3.1 405B)
    assert model_parameters(load_workload("gpt3-175b")) / 1e9 == pytest.approx(175.2, abs=0.1)


def test_checkpoint_bytes_and_times():
    w = load_workload("llama3-405b-16k")  # bf16: 2 bytes of weights + 12 of fp32 main weights and moments
    c = checkpoint_cost(w, SITE.checkpoint, LLAMA3_PARAMETERS)
    assert c.bytes == LLAMA3_PARAMETERS * 14
    assert c.save_s == pytest.approx(10.0 + LLAMA3_PARAMETERS * 14 / 2000e9)  # fixed + 5.68 TB at 2 TB/s
    assert c.load_s == pytest.approx(LLAMA3_PARAMETERS * 14 / 2000e9)
    fp32 = load_workload("tiny-dp2")  # fp32: weights are the main copy, 4 + 8 bytes
    assert checkpoint_cost(fp32, SITE.checkpoint, 1000).bytes == 12_000
    asynchronous = SITE.checkpoint.model_copy(update={"blocking": False})
    assert checkpoint_cost(w, asynchronous, LLAMA3_PARAMETERS).save_s == 10.0


def test_energy_by_hand():
    power = GpuPower(tdp_w=Figure(value=700.0, status="datasheet", basis="x"),
                     idle_w=Figure(value=100.0, status="assumed", basis="x"))
    assert gpu_power_w(power, 0.5) == 400.0
    # 8 GPUs x (400 W x 10 h + 100 W x 2 h) + 1 host x 1 kW x 12 h = 32 + 1.6 + 12 kWh, x PUE 1.5
    assert energy_mwh(8, 1, 10.0, 2.0, power, 0.5, 1000.0, 1.5) == pytest.approx((32 + 1.6 + 12) * 1.5 / 1000)
    with pytest.raises(ValueError, match="busy"):
        gpu_power_w(power, 1.5)


def test_a_plan_by_hand():
    """Llama 3 405B on 16,384 H100s at a 6 s step, 15.6T tokens: every figure recomputed here."""
    w, hw, topo = load_workload("llama3-405b-16k"), load_hardware("h100-sxm-80gb"), load_topology("dgx-h100-ndr")
    row = {"step_time_s": 6.0, "compute_s": 4.5, "world_size": 16384}
    p = plan(w, hw, topo, SITE, row, 15.6e12, days=54, parameters=LLAMA3_PARAMETERS)
    per_hour = 466 / (54 * 24)
    assert p.interruptions_per_day["total"] == pytest.approx(per_hour * 24, rel=1e-3)
    assert p.interruptions_in_days == pytest.approx(466, abs=0.5)
    save, load, restart, mtti = 10.0 + LLAMA3_PARAMETERS * 14 / 2e12, LLAMA3_PARAMETERS * 14 / 2e12, 600.0, 3600 / per_hour
    steps = round(math.sqrt(2 * save * (mtti + restart)) / 6.0)
    assert p.checkpoint_interval_steps == steps and p.interval_is_optimal
    tau = steps * 6.0
    ettr = tau / (tau + save) * (1 - (restart + load + (tau + save) / 2) / mtti)
    assert p.effective_training_time == pytest.approx(ettr, rel=1e-3)
    ideal_s = 15.6e12 / (2048 * 8192) * 6.0
    assert p.ideal_days == pytest.approx(ideal_s / 86400)
    assert p.time_to_train_days == pytest.approx(ideal_s / ettr / 86400, rel=1e-3)
    assert p.gpu_hours == pytest.approx(16384 * ideal_s / ettr / 3600, rel=1e-3)
    assert p.cost_usd == pytest.approx(p.gpu_hours * 2.5)
    assert p.gpu_busy == 0.75
    down_h = p.interruptions * (restart + load) / 3600
    wall_h = p.time_to_train_days * 24
    gpu_w = 105.0 + (700.0 - 105.0) * 0.75
    expected = (16384 * (gpu_w * (wall_h - down_h) + 105.0 * down_h) + 2048 * 4600.0 * wall_h) * 1.1 / 1e6
    assert p.energy_mwh == pytest.approx(expected, rel=1e-6)
    given = plan(w, hw, topo, SITE, row, 15.6e12, interval_steps=1000, usd_per_gpu_hour=2.0, parameters=LLAMA3_PARAMETERS)
    assert not given.interval_is_optimal and given.effective_training_time < p.effective_training_time
    assert given.cost_usd == pytest.approx(given.gpu_hours * 2.0)
    no_price = plan(w, load_hardware("b200-sxm"), topo, SITE, row, 1e12, parameters=LLAMA3_PARAMETERS)
    assert no_price.cost_usd is None and no_price.energy_mwh is not None
    with pytest.raises(ValueError, match="tokens"):
        plan(w, hw, topo, SITE, row, 0.0, parameters=LLAMA3_PARAMETERS)


def _summary(path, workload: str, step: float = 2.0, world: int = 2) -> None:
    row = {f.name: 0.0 for f in SUMMARY}
    row.update(workload=workload, hardware="local-cpu", topology="local-gloo", world_size=world, step_time_s=step,
               compute_s=step / 2)
    write_parquet(pa.Table.from_pylist([row], schema=SUMMARY), path)


def _echo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "echo", *args], capture_output=True, text=True, timeout=300)


def test_the_plan_command_prints_json_and_refuses_bad_input(tmp_path):
    summary = tmp_path / "summary.parquet"
    _summary(summary, "tiny-dp2")
    base = ["plan", "tiny-dp2", "--hardware", "a100-sxm-80gb", "--topology", "dgx-a100-hdr"]
    out = _echo(*base, "--tokens", "1e9", "--days", "30", "--summary", str(summary), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in ("interruptions", "effective_training_time", "time_to_train_days", "gpu_hours", "cost_usd",
                "energy_mwh", "interruptions_in_days"):
        assert isinstance(doc[key], float), key
    # 1e9 tokens at 8 x 128 tokens a 2 s step
    assert doc["ideal_days"] == pytest.approx(1e9 / 1024 * 2.0 / 86400)
    text = _echo(*base, "--tokens", "1e9", "--summary", str(summary))
    assert text.returncode == 0 and "effective training time" in text.stdout and "provenance:" in text.stdout
    bad = _echo(*base, "--tokens", "-5", "--summary", str(summary))
    assert bad.returncode == 2 and "--tokens" in bad.stderr and "must be > 0" in bad.stderr
    missing = _echo(*base, "--tokens", "1e9", "--results", str(tmp_path / "none"))
    assert missing.returncode == 1 and "summary.parquet" in missing.stderr and "snakemake" in missing.stderr
    other = tmp_path / "other.parquet"
    _summary(other, "tiny-tp2")
    wrong = _echo(*base, "--tokens", "1e9", "--summary", str(other))
    assert wrong.returncode == 2 and "tiny-tp2" in wrong.stderr and "workload" in wrong.stderr
    unknown = _echo(*base, "--tokens", "1e9", "--summary", str(summary), "--site", "nowhere")
    assert unknown.returncode == 2 and "unknown site 'nowhere'" in unknown.stderr


def test_a_site_with_a_bad_key_names_the_file_and_key(tmp_path):
    from echo.config import parse_site
    from echo.config.loader import read_yaml

    data = read_yaml(CONFIG_ROOT / "sites" / "meta-llama3-h100.yaml")
    data["failures"]["per_gpu_hour"] = {"value": -1.0, "status": "published", "basis": "x"}
    with pytest.raises(ConfigError, match="failures.per_gpu_hour.value"):
        parse_site(data, tmp_path / "bad.yaml")
    data = read_yaml(CONFIG_ROOT / "sites" / "meta-llama3-h100.yaml")
    data["restart_minutes"] = 10
    with pytest.raises(ConfigError, match="restart_minutes"):
        parse_site(data, tmp_path / "bad.yaml")


def test_a_plan_runs_the_expected_step_under_the_gpus_speed_spread():
    w, hw, topo = load_workload("llama3-405b-16k"), load_hardware("h100-sxm-80gb"), load_topology("dgx-h100-ndr")
    row = {"step_time_s": 6.0, "compute_s": 4.5, "world_size": 16384}
    alike = plan(w, hw, topo, SITE, row, 15.6e12, parameters=LLAMA3_PARAMETERS, interval_steps=100)
    spread = plan(w, hw, topo, SITE, {**row, "step_mean_s": 6.3}, 15.6e12, parameters=LLAMA3_PARAMETERS,
                  interval_steps=100)
    assert (spread.step_time_s, spread.expected_step_s) == (6.0, 6.3)
    assert spread.ideal_days == pytest.approx(alike.ideal_days * 6.3 / 6.0)
    assert spread.gpu_busy == alike.gpu_busy == 0.75


def test_time_to_train_against_gpu_count_from_a_search(tmp_path):
    """plan-search plans each GPU count's fastest fitting layout of a ranking (here a written one)."""
    from echo.plan.scaling import fastest_per_gpu_count

    rows = [dict(layout=f"l{i}", topology="dgx-h100-ndr", world_size=g, step_time_s=s, compute_s=s * 0.8, fits=f)
            for i, (g, s, f) in enumerate([(256, 20.0, True), (256, 18.0, False), (256, 19.0, True),
                                           (512, 10.5, True), (1024, 5.6, True)])]
    assert [r["layout"] for r in fastest_per_gpu_count(rows)] == ["l2", "l3", "l4"]
    pq_path = tmp_path / "ranking.parquet"
    write_parquet(pa.Table.from_pylist(rows), pq_path)
    out = _echo("plan-search", "llama3-70b-h100-512-search", "--tokens", "15e12", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "time_to_train.png").stat().st_size > 0
    from echo.io import read_parquet

    table = read_parquet(tmp_path / "time_to_train.parquet").to_pylist()
    assert [t["gpus"] for t in table] == [256, 512, 1024]
    # more GPUs: a shorter run, interrupted more often, so a lower effective training time
    days = [t["time_to_train_days"] for t in table]
    ettr = [t["effective_training_time"] for t in table]
    assert days[0] > days[1] > days[2] and ettr[0] > ettr[1] > ettr[2]
    missing = _echo("plan-search", "llama3-70b-h100-512-search", "--tokens", "1e12", "--out", str(tmp_path / "x"))
    assert missing.returncode == 1 and "python -m echo search" in missing.stderr


def test_the_report_summaries_gain_each_experiments_plan(tmp_path):
    """rule plan_experiment's row (plan_record) joined to the summaries on the experiment's names:
    the plan's figures as plan_ columns, a summary without a plan kept with nulls."""
    import pyarrow.parquet as pq

    from echo.plan.table import PLAN_COLUMNS, plan_record, plan_table
    from echo.report.audit import summaries, with_plans

    w, hw, topo = load_workload("llama3-405b-16k"), load_hardware("h100-sxm-80gb"), load_topology("dgx-h100-ndr")
    p = plan(w, hw, topo, SITE, {"step_time_s": 6.0, "compute_s": 4.5, "world_size": 16384}, 15.6e12,
             parameters=LLAMA3_PARAMETERS)
    record = plan_record(p)
    assert record["interruptions_per_day"] == p.interruptions_per_day["total"]
    assert record["time_to_train_days"] == p.time_to_train_days and record["cost_usd"] == p.cost_usd
    assert json.loads(record["provenance"])["restart_s"].startswith("assumed")
    assert set(PLAN_COLUMNS) <= set(record)
    plan_path = tmp_path / "plan.parquet"
    no_price = plan_record(plan(w, load_hardware("b200-sxm"), topo, SITE, {"step_time_s": 6.0, "compute_s": 4.5,
                                                                     "world_size": 16384}, 1e12, parameters=1))
    assert no_price["cost_usd"] is None
    write_parquet(plan_table([record, {**no_price, "workload": "other"}]), plan_path)
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    _summary(a, "llama3-405b-16k", step=6.0, world=16384)
    _summary(b, "tiny-dp2")
    for path, (hw_name, topo_name) in ((a, ("h100-sxm-80gb", "dgx-h100-ndr")), (b, ("local-cpu", "local-gloo"))):
        t = pq.read_table(path)
        write_parquet(t.set_column(t.schema.get_field_index("hardware"), "hardware", pa.array([hw_name]))
                       .set_column(t.schema.get_field_index("topology"), "topology", pa.array([topo_name])), path)
    table = summaries([a, b])  # a simulated summary has per-stage lists too (no join of Arrow's takes them)
    table = table.append_column("stage_step_time_s", pa.array([[6.0, 5.9], [2.0]]))
    joined = with_plans(table, [plan_path]).to_pylist()
    by = {r["workload"]: r for r in joined}
    assert by["llama3-405b-16k"]["plan_time_to_train_days"] == pytest.approx(p.time_to_train_days)
    assert by["llama3-405b-16k"]["plan_site"] == SITE.name and by["llama3-405b-16k"]["step_time_s"] == 6.0
    assert by["tiny-dp2"]["plan_time_to_train_days"] is None and by["tiny-dp2"]["stage_step_time_s"] == [2.0]


def test_the_plan_settings_are_checked():
    from echo.workflow.params import site_params
    from echo.workflow.settings import Settings

    s = Settings.from_config({"plan": {"tokens": "15e12"}, "searches": "gpt3-175b-a100-scaling"})
    assert s.plan.tokens == 15e12 and s.plan.site == "meta-llama3-h100" and s.searches == ("gpt3-175b-a100-scaling",)
    with pytest.raises(ConfigError, match="plan.tokens"):
        Settings.from_config({"plan": {"tokens": 0}})
    with pytest.raises(ConfigError, match="plan.days"):
        Settings.from_config({"plan": {"days": 3}})
    with pytest.raises(ConfigError, match="unknown site 'nowhere'"):
        site_params("nowhere", CONFIG_ROOT)
