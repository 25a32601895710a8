"""What the fits share: parameter bounds, parameters replaced, the network model, a fit's result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from echo.config import Hardware, load_topology
from echo.config.hardware import ComputeModel
from echo.network import NetworkModel

# bounds of the parameters a whole-job or per-layer fit may vary (echo.fit.step, echo.fit.compute: today
# their machinery validates the kernel model and fits nothing by default)
FIT_BOUNDS = {"hbm_efficiency": (0.3, 1.0), "gemm.bf16.peak_fraction": (0.3, 1.0), "matmul_efficiency": (0.3, 1.0)}


def with_params(hw: Hardware, params: dict | None = None, **kwargs) -> Hardware:
    """``hw`` with compute-model parameters replaced (dotted names in ``params``, e.g.
    gemm.bf16.peak_fraction; plain ones also as keywords), validated like the file."""
    cm = hw.compute_model.model_dump()
    for name, value in {**(params or {}), **kwargs}.items():
        *path, leaf = name.split(".")
        node = cm
        for part in path:
            node = node[part]
        node[leaf] = value
    return Hardware.model_validate({**hw.model_dump(), "compute_model": cm})


def parameters(hw: Hardware) -> dict:
    """Every compute-model parameter of ``hw``, by dotted name."""
    cm: ComputeModel = hw.compute_model
    return {p: cm.value(p) for p in cm.parameter_names()}


def network_model(topology: str, network_json: Path | None = None) -> NetworkModel:
    """The calibrate stage's network model (its network.json) when given, else the topology's nominal one."""
    return NetworkModel.load(network_json) if network_json is not None else NetworkModel(load_topology(topology))


@dataclass
class Fit:
    """A fit's values, every parameter after it, each measurement reproduced (fit or held out) and the split."""

    hardware: str
    fitted: dict
    params: dict
    rows: list
    split: dict

    def to_dict(self) -> dict:
        return {**asdict(self), "rows": [{**asdict(r), "errors_pct": r.errors_pct} if is_dataclass(r) else r
                                         for r in self.rows]}
