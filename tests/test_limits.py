"""Cost guards (echo.config.limits): a workload whose trace could not finish is refused while the
config loads, naming the key and the estimate; every real size is admitted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import edit_yaml

from echo.config import load_workload
from echo.config.limits import estimated_parameters
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
