"""What the fits share: parameter bounds, parameters replaced, the network model, a fit's result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from echo.config import Hardware, load_topology
from echo.config.hardware import ComputeModel
from echo.network import NetworkModel

FIT_BOUNDS = {"hbm_efficiency": (0.3, 1.0), "matmul_efficiency": (0.3, 1.0), "sustained_compute": (0.5, 1.0)}


def with_params(hw: Hardware, **params) -> Hardware:
    """``hw`` with compute-model parameters replaced (validated like the file)."""
    cm = hw.compute_model.model_dump()
    cm.update(params)
    return Hardware.model_validate({**hw.model_dump(), "compute_model": cm})


def parameters(hw: Hardware) -> dict:
    """Every compute-model parameter of ``hw``, by name."""
    return {p: getattr(hw.compute_model, p) for p in ComputeModel.parameter_names()}


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
