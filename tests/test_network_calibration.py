"""Calibrating azure-ndv4 from its real nccl-tests logs: the fit per tier, leave-one-out
extrapolation to a node count it never saw, the calibrate stage's outputs, the CLI, the workflow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import copy_workflow, snakemake

from echo.artifacts import COLLECTIVES
from echo.config import load_topology
from echo.errors import ConfigError
from echo.network import NetworkModel, collective_main, run_calibrate
from echo.network.calibrate import read_topology_logs
from echo.network.costs import NetworkParams
from echo.network.fit import fit_nccl_tests, leave_one_out, runs_from_measurements
from echo.network.nccl_tests import MEASUREMENTS

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, reference) -> tuple[Path, NetworkModel]:
    """The calibrate stage run once for azure-ndv4 (the fit, its leave-one-out checks, the plot)."""
    out = tmp_path_factory.mktemp("results") / "calibrate" / "azure-ndv4"
    model = run_calibrate(load_topology("azure-ndv4"), out, root=reference)
    return out, model


@pytest.fixture(scope="module")
def fit(calibrated) -> dict:
    return calibrated[1].fit


def _by_gpus(entries: list[dict]) -> dict[int, dict]:
    return {e["gpus"]: e for e in entries}


# --- the fit reproduces the logs ----------------------------------------------------------

def test_fit_reproduces_every_log(fit):
    """Issue 9: mean absolute time error <= 10% from 1 MiB per log (aim 5%; 1.7-5.3% at writing),
    small-message latency within 20% (within 5% at writing)."""
    acc = _by_gpus(fit["accuracy"])
    assert set(acc) == {2, 4, 8, 16, 64}
    for gpus, a in acc.items():
        assert a["points"] >= 11, gpus
        assert a["mean_abs_err"] <= 0.08, (gpus, a)
        assert a["max_abs_err"] <= 0.30, (gpus, a)
        assert abs(a["floor_err"]) <= 0.10, (gpus, a)
    assert np.mean([a["mean_abs_err"] for a in acc.values()]) <= 0.05


def test_leave_one_out_predicts_eight_servers_from_one_and_two(fit):
    """Issue 9: refit without the 64-GPU log and predict it: <= 15% mean from 1 MiB (aim 7%;
    about 6% at writing, worst size 64 MiB at about -14%)."""
    loo = _by_gpus(fit["leave_one_out"])
    held = loo[64]
    assert held["nodes"] == 8 and held["points"] == 13
    assert held["mean_abs_err"] <= 0.08, held
    assert held["max_abs_err"] <= 0.25 and held["worst_bytes"] >= MIB
    # the other way round (predict 2 servers from 1 and 8) is also sound
    assert loo[16]["mean_abs_err"] <= 0.12, loo[16]


def test_fitted_figures_are_physical(calibrated):
    p = calibrated[1].params
    assert 200 <= p.intra_bw_GBps <= 250        # A100 NVLink3 ring: ~230 GB/s bus bandwidth
    assert 12 <= p.nic_bw_GBps <= 25            # one HDR link (25 GB/s line rate) per GPU
    assert 2 <= p.launch_us <= 8                # nccl-tests -g 8: one thread launches on 8 GPUs
    assert p.protocols["LL"]["intra_hop_us"] < 1.5 < p.protocols["LL"]["inter_hop_us"]
    assert p.protocols["LL"]["bw_fraction"] < p.protocols["LL128"]["bw_fraction"] < 1.0


def test_per_tier_fit_does_not_touch_the_other_tier(reference):
    """Single-server logs alone leave the network tier nominal; and vice versa."""
    topo = load_topology("azure-ndv4")
    base = NetworkParams.from_topology(topo)
    runs = runs_from_measurements(read_topology_logs(topo, root=reference))
    intra_only, summary = fit_nccl_tests(base, [r for r in runs if r.shape.nodes == 1])
    assert intra_only.nic_bw_GBps == base.nic_bw_GBps
    assert {n: p["inter_hop_us"] for n, p in intra_only.protocols.items()} == {
        n: p["inter_hop_us"] for n, p in base.protocols.items()}
    assert intra_only.intra_bw_GBps != base.intra_bw_GBps and list(summary["tiers"]) == ["intra"]
    inter_only, summary = fit_nccl_tests(base, [r for r in runs if r.shape.nodes > 1])
    assert inter_only.intra_bw_GBps == base.intra_bw_GBps and inter_only.nic_bw_GBps != base.nic_bw_GBps
    assert list(summary["tiers"]) == ["inter"]
    with pytest.raises(ValueError, match="no measurements"):
        fit_nccl_tests(base, [])
    # leave-one-out is a refit: the held log's own figures cannot leak into its prediction
    held = next(r for r in runs if r.shape.gpus == 64)
    assert leave_one_out(base, runs, held)["gpus"] == 64


def test_other_node_counts_come_from_the_formulas(calibrated):
    """4 and 16 servers were never measured: large messages stay NIC-bound (ring bus bandwidth
    about the 2- and 8-server logs' 127 GB/s), small ones grow with the tree depth."""
    model = calibrated[1]
    big = {m: model.estimate("all_reduce", gpus=8 * m, nbytes=4 * GIB) for m in (2, 4, 8, 16)}
    for m, est in big.items():
        assert 115 <= est.busbw_GBps <= 135, (m, est)
    small = [model.estimate("all_reduce", gpus=8 * m, nbytes=8 * KIB).time_us for m in (2, 4, 8, 16, 64)]
    assert all(a < b for a, b in zip(small, small[1:], strict=False))
    assert small[-1] < 4 * small[0]  # log2 of the servers, not their number


# --- the stage's outputs ------------------------------------------------------------------

def test_calibrate_writes_measurements_table_plot_and_model(calibrated):
    out, model = calibrated
    measured = pq.read_table(out / "measurements.parquet")
    assert measured.schema.names[: len(MEASUREMENTS.names)] == MEASUREMENTS.names
    assert measured.num_rows == 2 * (28 * 3 + 25 + 23)
    assert set(measured.column("source").to_pylist()) == set(load_topology("azure-ndv4").calibration.logs)
    table = pq.read_table(out / "collectives.parquet")
    assert set(COLLECTIVES.names) <= set(table.column_names)
    rows = [r for r in table.to_pylist() if r["measured_time_us"] is not None]
    assert {(r["gpus"], r["nodes"]) for r in rows} == {(2, 1), (4, 1), (8, 1), (16, 2), (64, 8)}
    assert {r["op"] for r in rows} == {"all_reduce"} and {r["source"] for r in table.to_pylist()} == {"fitted"}
    png = (out / "busbw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    saved = json.loads((out / "network.json").read_text())
    assert saved["source"] == "fitted" and saved["fit"]["leave_one_out"] and saved["fit"]["tiers"].keys() == {
        "intra", "inter"}
    assert NetworkModel.load(out / "network.json").params == model.params


def test_nominal_topology_writes_an_empty_measurements_table_and_a_plot(tmp_path):
    run_calibrate(load_topology("dgx-b200"), tmp_path)
    assert pq.read_table(tmp_path / "measurements.parquet").num_rows == 0
    assert (tmp_path / "busbw.png").stat().st_size > 20_000


def test_missing_or_misfit_logs_are_refused(tmp_path, reference):
    topo = load_topology("azure-ndv4")
    missing = topo.model_copy(update={"calibration": topo.calibration.model_copy(
        update={"logs": (*topo.calibration.logs, "nccl-tests/nope.log")})})
    with pytest.raises(ConfigError, match=r"azure-ndv4.yaml: calibration.logs.5: 'nccl-tests/nope.log' not found in "
                                          r"the reference folder"):
        run_calibrate(missing, tmp_path, root=reference)
    four = topo.model_copy(update={"gpus_per_node": 4})
    with pytest.raises(ConfigError, match=r"calibration.logs.2: .*8gpus.log ran more than gpus_per_node=4"):
        run_calibrate(four, tmp_path, root=reference)


def test_logs_must_match_the_source(config_root):
    path = config_root / "topologies" / "azure-ndv4.yaml"
    data = yaml.safe_load(path.read_text())
    data["calibration"]["source"] = "nominal"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="calibration.logs: .*logs are read only with source nccl_tests"):
        load_topology("azure-ndv4", root=config_root)
    data["calibration"] = {"source": "nccl_tests"}
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="azure-ndv4.yaml: calibration.logs: .*needs at least one log file"):
        load_topology("azure-ndv4", root=config_root)


# --- the collective CLI -------------------------------------------------------------------

def test_collective_answers_any_gpu_count_on_azure(calibrated):
    out, model = calibrated
    times = {}
    for gpus in (*range(1, 9), 16, 24, 64, 128):
        res = collective_main("azure-ndv4", "all_reduce", gpus, GIB, network_json=out / "network.json")
        assert res["source"] == "fitted" and res["nodes"] == max(1, gpus // 8)
        times[gpus] = res["time_us"]
        if gpus == 1:
            assert res["time_us"] == 0.0 and res["algorithm"] == "none"
        else:
            assert res["algorithm"] in ("ring", "tree") and res["protocol"] in ("LL", "LL128", "simple")
            assert res["busbw_GBps"] == pytest.approx(res["algbw_GBps"] * 2 * (gpus - 1) / gpus)
    assert times[8] < times[16]  # NVLink beats the NICs
    proc = subprocess.run([sys.executable, "-m", "echo", "collective", "--topology", "azure-ndv4", "--op",
                           "all_reduce", "--gpus", "32", "--bytes", "1GiB", "--results", str(out.parents[1])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["nodes"] == 4 and result["source"] == "fitted"
    assert 115 <= result["busbw_GBps"] <= 135


def test_collective_fits_the_logs_when_calibrate_has_not_run(tmp_path, reference):
    # no network.json: the logs are found in the reference folder and fitted now
    res = collective_main("azure-ndv4", "all_reduce", 64, 4 * GIB, network_json=tmp_path / "network.json")
    assert res["source"] == "fitted" and 115 <= res["busbw_GBps"] <= 135


# --- the workflow -------------------------------------------------------------------------

def test_workflow_sees_the_logs_as_calibrate_inputs(tmp_path, monkeypatch, reference):
    wf = copy_workflow(tmp_path / "wf")  # no shared/reference beside the copy
    monkeypatch.setenv("ECHO_REFERENCE", str(tmp_path / "nowhere"))
    proc = snakemake(wf, "-n", "results/calibrate/azure-ndv4/busbw.png")
    assert proc.returncode != 0
    assert ("config/topologies/azure-ndv4.yaml: calibration.logs.0: 'nccl-tests/azure-ndv4-a100/"
            "all_reduce_perf_2gpus.log' not found in the reference folder") in proc.stdout + proc.stderr
    # validate.reference_dir is the same setting, and wins over the environment
    proc = snakemake(wf, "-n", "results/calibrate/azure-ndv4/busbw.png", "--config",
                     f"validate={{reference_dir: {reference}}}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    inputs = next(line for line in (proc.stdout + proc.stderr).splitlines() if line.strip().startswith("input:"))
    for gpus in (2, 4, 8, 16, 64):
        assert f"all_reduce_perf_{gpus}gpus.log" in inputs
