"""Cost guards (echo.config.limits): a workload whose trace could not finish is refused while the
config loads, naming the key and the estimate; every real size is admitted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import edit_yaml

from echo.config import load_workload
from echo.config.limits import estimated_parameters, trace_estimate
from echo.errors import ConfigError


def test_a_billion_layers_is_refused_in_seconds_naming_model_layers(config_root: Path):
    path = config_root / "workloads" / "gpt3-175b.yaml"
    edit_yaml(path, **{"model.layers": 1_000_000_000})
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_workload("gpt3-175b", root=config_root)
    assert time.perf_counter() - t0 < 5.0
    assert err.value.key == "model.layers" and "gpt3-175b.yaml" in err.value.file
    assert "per role" in err.value.reason or "layers put" in err.value.reason


def test_the_parameter_estimate_matches_published_model_sizes():
    # GPT-3 175B, Llama 3.1 405B, DeepSeek-V3 671B total (plus its 14B multi-token-prediction head)
    for name, published in (("gpt3-175b", 175e9), ("llama3-405b-16k", 405e9)):
        assert estimated_parameters(load_workload(name).model) == pytest.approx(published, rel=0.03), name


def test_every_real_size_is_admitted(config_root: Path):
    """A 10-trillion-parameter dense model on a million GPUs loads."""
    path = config_root / "workloads" / "gpt3-175b.yaml"
    # 10T: 256 layers of width 57,344 (12 h^2 per layer); a million GPUs: tp 8 x pp 128 x dp 1024
    edit_yaml(path, **{"model.layers": 256, "model.hidden": 57344, "model.heads": 448,
                       "parallel.tp": 8, "parallel.pp": 128, "parallel.dp": 1024, "training.global_batch": 1024 * 128})
    w = load_workload("gpt3-175b", root=config_root)
    assert estimated_parameters(w.model) == pytest.approx(1.0e13, rel=0.02)
    assert w.world_size == 1_048_576


def test_a_limit_is_raised_for_one_run(config_root: Path, monkeypatch):
    path = config_root / "workloads" / "tiny-dp2.yaml"
    edit_yaml(path, **{"model.layers": 40_000})
    with pytest.raises(ConfigError, match="ECHO_MAX_LAYERS_PER_ROLE"):
        load_workload("tiny-dp2", root=config_root)
    monkeypatch.setenv("ECHO_MAX_LAYERS_PER_ROLE", "50000")
    assert load_workload("tiny-dp2", root=config_root).model.layers == 40_000


def test_many_roles_are_refused_by_the_trace_time_estimate(config_root: Path):
    path = config_root / "workloads" / "tiny-pp2.yaml"
    edit_yaml(path, **{"model.layers": 20_000, "parallel.pp": 20_000, "training.global_batch": 40_000,
                       "training.micro_batch": 1})
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_workload("tiny-pp2", root=config_root)
    assert time.perf_counter() - t0 < 5.0
    assert err.value.key == "parallel.pp" and "20,000 roles" in err.value.reason and "h on one core" in err.value.reason


def test_a_role_too_large_for_host_memory_is_refused(config_root: Path, monkeypatch):
    path = config_root / "workloads" / "tiny-dp2.yaml"
    edit_yaml(path, **{"model.layers": 2_000})
    assert trace_estimate(load_workload("tiny-dp2", root=config_root))["worker_gib"] > 1.0
    monkeypatch.setenv("ECHO_MAX_TRACE_WORKER_GIB", "1")
    with pytest.raises(ConfigError, match=r"model\.layers: tracing one role would record about 320,160 ops"):
        load_workload("tiny-dp2", root=config_root)


def test_the_trace_estimate_bounds_what_a_trace_records(tmp_path: Path):
    import pyarrow.parquet as pq

    from echo.trace import run_trace

    w = load_workload("tiny-pp2")
    run_trace(w, tmp_path)
    ops = pq.read_table(tmp_path / "ops.parquet", columns=["rank"])["rank"].value_counts().to_pylist()
    est = trace_estimate(w)
    assert est["roles"] == len(ops) == w.parallel.pp
    assert max(c["counts"] for c in ops) <= est["ops_per_role"]


def test_full_mode_on_a_huge_job_is_refused_while_the_dag_is_built(workflow_copy: Path):
    from conftest import snakemake

    target = "results/simulate/llama3-405b-16k/h100-sxm-80gb/dgx-h100-ndr/summary.parquet"
    t0 = time.perf_counter()
    proc = snakemake(workflow_copy, "-n", target, "--config", "simulate={mode: full}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60
    assert "config/config.yaml: simulate.mode: full mode replays every rank: llama3-405b-16k has 16,384 ranks" in out
    assert snakemake(workflow_copy, "-n", target).returncode == 0  # symmetric mode takes it
