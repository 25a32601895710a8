"""Read config files and turn every problem into a ConfigError naming the file, key and reason."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from echo.config.hardware import Hardware
from echo.config.hf import expand_model_section
from echo.config.limits import cost_problems
from echo.config.site import Site
from echo.config.topology import Topology
from echo.config.workload import Workload
from echo.errors import ConfigError

CONFIG_ROOT = Path(__file__).resolve().parents[2] / "config"
_KINDS = {"workload": "workloads", "hardware": "hardware", "topology": "topologies", "site": "sites"}
M = TypeVar("M", bound=BaseModel)


def config_path(kind: str, name: str, root: Path | None = None) -> Path:
    """The file of a named config; unknown names are refused with the names that exist."""
    folder = (root or CONFIG_ROOT) / _KINDS[kind]
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        raise ConfigError(path, kind, f"unknown {kind} '{name}'; known: {', '.join(known) or 'none'}")
    return path


def read_yaml(path: Path) -> dict:
    """A config file's top-level mapping; bad YAML or another top level is a ConfigError."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(path, "-", f"not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(path, "-", "expected a mapping at the top level")
    return data


def _validate(model: type[M], data: dict, path: Path) -> M:
    data = {"name": path.stem, **data}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        # an unknown key usually explains a "missing" one (a misspelt unit): report it first
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        key = ".".join(str(p) for p in err["loc"]) or "-"
        reason = err["msg"]
        if err["type"] == "extra_forbidden":
            reason = _unknown_key_reason(model, err["loc"])
        elif "input" in err and err["type"] != "missing":
            reason = f"{reason} (got {err['input']!r}; units are in the key names)"
        raise ConfigError(path, key, reason) from None


def _unknown_key_reason(model: type[BaseModel], loc: tuple) -> str:
    fields = model.model_fields
    for part in loc[:-1]:
        ann = fields[part].annotation if part in fields else None
        fields = getattr(ann, "model_fields", {})
    close = difflib.get_close_matches(str(loc[-1]), list(fields), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'? (units are in the key names)" if close else ""
    return f"unknown key{hint}; allowed: {', '.join(fields)}"


def parse_workload(data: dict, path: Path) -> Workload:
    if isinstance(data.get("model"), dict):
        data = {**data, "model": expand_model_section(data["model"], path)}
    workload = _validate(Workload, data, path)
    # contradictions first (a config that cannot hold), then the cost guards (one that could not finish)
    problems = workload.contradictions() or cost_problems(workload)
    if problems:
        key, reason = problems[0]
        raise ConfigError(path, key, reason)
    return workload


def parse_hardware(data: dict, path: Path) -> Hardware:
    return _validate(Hardware, data, path)


def parse_topology(data: dict, path: Path) -> Topology:
    return _validate(Topology, data, path)


def parse_site(data: dict, path: Path) -> Site:
    return _validate(Site, data, path)


def load_workload(name: str, root: Path | None = None) -> Workload:
    path = config_path("workload", name, root)
    return parse_workload(read_yaml(path), path)


def load_hardware(name: str, root: Path | None = None) -> Hardware:
    path = config_path("hardware", name, root)
    return parse_hardware(read_yaml(path), path)


def load_topology(name: str, root: Path | None = None) -> Topology:
    path = config_path("topology", name, root)
    return parse_topology(read_yaml(path), path)


def load_site(name: str, root: Path | None = None) -> Site:
    path = config_path("site", name, root)
    return parse_site(read_yaml(path), path)


def check_placement(workload: Workload, topology: Topology, topology_path: Path | str) -> None:
    """A job larger than a node must fill whole nodes (``ranks_per_node`` GPUs of each)."""
    problem = topology.placement_problem(workload.world_size)
    if problem:
        raise ConfigError(topology_path, problem[0], f"workload '{workload.name}': {problem[1]}")


def check_numerics(workload: Workload, hardware: Hardware, hardware_path: Path | str) -> None:
    """The workload's precision runs on the hardware's tensor cores: FP8 needs FP8 tensor cores
    (Hopper on), the block-scaled MXFP8 and NVFP4 recipes the block-scaled tensor cores that came
    with FP4 (Blackwell). A cpu hardware file times kernels for real: its CPU runs per-tensor FP8
    GEMMs only (torch's CPU _scaled_mm takes no block scales)."""
    t, peaks = workload.training, hardware.peak_tflops
    if t.dtype != "fp8":
        return
    if hardware.kind == "cpu":
        if t.fp8_recipe not in ("delayed", "current"):
            raise ConfigError(hardware_path, "kind", f"fp8_recipe {t.fp8_recipe} of workload '{workload.name}' "
                              "needs a GPU: this CPU times per-tensor FP8 GEMMs only (delayed, current)")
        return
    if peaks.fp8 is None:
        raise ConfigError(hardware_path, "peak_tflops.fp8",
                          f"workload '{workload.name}' trains in FP8; this GPU has no FP8 tensor cores")
    if t.fp8_recipe in ("mxfp8", "nvfp4") and peaks.fp4 is None:
        raise ConfigError(hardware_path, "peak_tflops.fp4",
                          f"fp8_recipe {t.fp8_recipe} of workload '{workload.name}' needs block-scaled (MX / NV) tensor "
                          "cores, which came with FP4 (Blackwell); this GPU has none (no fp4 peak)")
