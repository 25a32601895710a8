"""Config validation: every shipped file loads; every bad input is refused naming file, key, reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO, edit_yaml

from echo.config import Hardware, Topology, Workload, load_hardware, load_topology, load_workload
from echo.config.loader import check_placement, config_path
from echo.errors import ConfigError
from echo.workflow.settings import Settings

SHIPPED = {
    "workloads": (load_workload, Workload),
    "hardware": (load_hardware, Hardware),
    "topologies": (load_topology, Topology),
}


def shipped(kind: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "config" / kind).glob("*.yaml"))


@pytest.mark.parametrize("kind,name", [(k, n) for k in SHIPPED for n in shipped(k)])
def test_shipped_config_loads_and_round_trips(kind: str, name: str) -> None:
    load, model = SHIPPED[kind]
    cfg = load(name)
    assert cfg.name == name
    # the workflow passes configs to rule scripts as plain dicts and rebuilds them there
    assert model.model_validate(cfg.model_dump()) == cfg


def test_design_names_are_shipped() -> None:
    assert {"a100-sxm-80gb", "h100-sxm-80gb", "h200-sxm-141gb", "local-cpu"} <= set(shipped("hardware"))
    assert {"dgx-a100-hdr", "dgx-h100-ndr", "local-gloo"} <= set(shipped("topologies"))


def test_default_experiments_are_valid() -> None:
    experiments = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["experiments"]
    assert experiments
    for e in experiments:
        assert set(e) == {"workload", "hardware", "topology"}
        workload = load_workload(e["workload"])
        load_hardware(e["hardware"])
        topology = load_topology(e["topology"])
        check_placement(workload, topology, config_path("topology", e["topology"]))


# --- refused input ----------------------------------------------------------------------------


def refused(load, name: str, root: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(name, root=root)
    err = info.value
    assert str(err).startswith(err.file)  # the message leads with the file
    assert err.key and err.reason
    return err


def check(err: ConfigError, file: Path, key: str, *reason_words: str) -> None:
    assert Path(err.file) == file, str(err)
    assert err.key == key, str(err)
    for word in reason_words:
        assert word in err.reason, str(err)


WORKLOAD_CASES = {
    # name: (edits to tiny-tp2.yaml, expected key, words of the reason)
    "heads_not_divisible_by_tp": ({"parallel.tp": 3}, "parallel.tp", ["heads 8", "tp 3"]),
    "layers_not_divisible_by_pp": ({"parallel.tp": 1, "parallel.pp": 3}, "model.layers", ["layers 4", "pp"]),
    "global_batch_not_divisible": (
        {"parallel.tp": 1, "parallel.dp": 2, "training.global_batch": 10, "training.micro_batch": 2},
        "training.global_batch", ["global_batch 10", "micro_batch x dp = 4"],
    ),
    "missing_key": ({"model.layers": None}, "model.layers", ["required"]),
    "unknown_key": ({"model.n_layers": 4}, "model.n_layers", ["unknown key"]),
    "wrong_type": ({"parallel.tp": "2"}, "parallel.tp", ["'2'"]),
    "bad_choice": ({"parallel.schedule": "zero-bubble"}, "parallel.schedule", ["1f1b"]),
}


@pytest.mark.parametrize("case", sorted(WORKLOAD_CASES))
def test_bad_workload_refused(config_root: Path, case: str) -> None:
    edits, key, words = WORKLOAD_CASES[case]
    path = config_root / "workloads" / "bad.yaml"
    path.write_text((config_root / "workloads" / "tiny-tp2.yaml").read_text())
    edit_yaml(path, **edits)
    check(refused(load_workload, "bad", config_root), path, key, *words)


def test_world_size_must_fill_whole_nodes(config_root: Path) -> None:
    path = config_root / "workloads" / "dp6.yaml"
    path.write_text((config_root / "workloads" / "tiny-dp2.yaml").read_text())
    edit_yaml(path, **{"parallel.dp": 12, "training.global_batch": 24})  # world size 12
    topo_path = config_root / "topologies" / "eight.yaml"
    topo_path.write_text((config_root / "topologies" / "dgx-a100-hdr.yaml").read_text())
    workload = load_workload("dp6", root=config_root)
    topology = load_topology("eight", root=config_root)
    with pytest.raises(ConfigError) as info:
        check_placement(workload, topology, config_path("topology", "eight", config_root))
    check(info.value, topo_path, "gpus_per_node", "world size 12", "8")
    # a job within one node, or of whole nodes, is fine
    check_placement(load_workload("tiny-dp2", root=config_root), topology, topo_path)
    edit_yaml(path, **{"parallel.dp": 16, "training.global_batch": 32})
    check_placement(load_workload("dp6", root=config_root), topology, topo_path)


@pytest.mark.parametrize("load,kind,folder", [
    (load_workload, "workload", "workloads"),
    (load_hardware, "hardware", "hardware"),
    (load_topology, "topology", "topologies"),
])
def test_unknown_name_refused_with_known_names(config_root: Path, load, kind: str, folder: str) -> None:
    err = refused(load, "no-such-thing", config_root)
    check(err, config_root / folder / "no-such-thing.yaml", kind, f"unknown {kind} 'no-such-thing'")
    assert shipped(folder)[0] in err.reason  # lists what exists


def test_not_yaml_refused(config_root: Path) -> None:
    path = config_root / "hardware" / "broken.yaml"
    path.write_text("peak_tflops: {bf16: 1\n")
    check(refused(load_hardware, "broken", config_root), path, "-", "not valid YAML")


def topology_with(config_root: Path, **edits: object) -> Path:
    path = config_root / "topologies" / "bad.yaml"
    path.write_text((config_root / "topologies" / "dgx-a100-hdr.yaml").read_text())
    edit_yaml(path, **edits)
    return path


def test_unit_given_as_string_refused(config_root: Path) -> None:
    path = topology_with(config_root, **{"intra_node.bandwidth_GBps": "300 GB/s"})
    check(refused(load_topology, "bad", config_root), path, "intra_node.bandwidth_GBps",
          "valid number", "300 GB/s", "units are in the key names")


def test_wrong_unit_key_refused(config_root: Path) -> None:
    path = topology_with(config_root, **{"intra_node.bandwidth_GBps": None, "intra_node.bandwidth_Gbps": 2400})
    err = refused(load_topology, "bad", config_root)
    assert Path(err.file) == path
    # either the stray key or the one it should have been is named
    assert err.key in ("intra_node.bandwidth_Gbps", "intra_node.bandwidth_GBps"), str(err)


def test_wrong_unit_key_gets_a_hint(config_root: Path) -> None:
    path = topology_with(config_root, **{"intra_node.bandwidth_GBps": None, "intra_node.bandwidth_Gbps": 2400})
    check(refused(load_topology, "bad", config_root), path, "intra_node.bandwidth_Gbps",
          "did you mean 'bandwidth_GBps'")


def test_hardware_wrong_unit_and_range_refused(config_root: Path) -> None:
    path = config_root / "hardware" / "bad.yaml"
    path.write_text((config_root / "hardware" / "a100-sxm-80gb.yaml").read_text())
    edit_yaml(path, **{"hbm_GBps": "2 TB/s"})
    check(refused(load_hardware, "bad", config_root), path, "hbm_GBps", "2 TB/s")
    path.write_text((config_root / "hardware" / "a100-sxm-80gb.yaml").read_text())
    edit_yaml(path, **{"compute_model.matmul_efficiency": 1.5})
    check(refused(load_hardware, "bad", config_root), path, "compute_model.matmul_efficiency", "1")


# --- config/config.yaml (echo.workflow.settings) -----------------------------------------------


def test_shipped_config_yaml_is_valid() -> None:
    settings = Settings.from_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    assert settings.experiments and settings.sweeps == ()
    # the params the simulate and measure rules have always carried (a change re-runs every job)
    assert settings.simulate.model_dump() == {"mode": "symmetric", "overlap_grad_reduce": None}
    assert settings.measure.model_dump() == {"warmup": 3, "iters": 20, "profile": True, "priority": "rt"}
    assert settings.validation.local[:3] == ("tiny-dp2", "tiny-tp2", "tiny-pp2")


SETTINGS_CASES = {
    # name: (config given, expected key, words of the reason)
    "simulate_mode": ({"simulate": {"mode": "fast"}}, "simulate.mode", ["expected one of", "'fast'"]),
    "simulate_option": ({"simulate": {"speed": 1}}, "simulate.speed", ["unknown option", "mode"]),
    "measure_key": ({"measure": {"iter": 4}}, "measure.iter", ["unknown key", "iters"]),
    "measure_priority": ({"measure": {"priority": "max"}}, "measure.priority", ["'rt'", "'max'"]),
    "measure_iters": ({"measure": {"iters": 0}}, "measure.iters", ["greater than or equal to 1", "0"]),
    "measure_type": ({"measure": {"profile": 2}}, "measure.profile", ["bool", "2"]),
    "validate_key": ({"validate": {"locals": []}}, "validate.locals", ["unknown key", "local"]),
    "experiment_keys": ({"experiments": [{"workload": "tiny-dp2", "hardware": "local-cpu"}]}, "experiments.0",
                        ["expected exactly the keys workload, hardware, topology"]),
    "experiments_list": ({"experiments": "tiny-dp2"}, "experiments", ["expected a list"]),
    "sweep_name": ({"sweeps": [1]}, "sweeps.0", ["string"]),
    "top_level_key": ({"experiment": []}, "experiment", ["unknown key", "experiments"]),
}


@pytest.mark.parametrize("case", sorted(SETTINGS_CASES))
def test_bad_config_yaml_refused(case: str) -> None:
    given, key, words = SETTINGS_CASES[case]
    with pytest.raises(ConfigError) as info:
        Settings.from_config(given)
    check(info.value, Path("config/config.yaml"), key, *words)


def test_config_yaml_values_given_as_text() -> None:
    """Snakemake's --config hands nested values over as text (`--config 'measure={iters: 4}'`)."""
    settings = Settings.from_config({"measure": {"iters": "4", "profile": "false"}, "sweeps": "a",
                                     "simulate": {"mode": "full", "overlap_grad_reduce": "true"},
                                     "validate": {"published": "true", "reference_dir": "/r"}, "experiments": None})
    assert (settings.measure.iters, settings.measure.profile, settings.sweeps) == (4, False, ("a",))
    assert settings.simulate.model_dump() == {"mode": "full", "overlap_grad_reduce": True}
    assert settings.validation.published is True and settings.validation.reference_dir == Path("/r")
    assert settings.experiments == ()
