"""A network: node size, intra-node links, NICs and fabric, and how to calibrate collectives on it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class IntraNode(BaseModel):
    """GPU-to-GPU links inside a node (NVLink/NVSwitch, or loopback for local-gloo)."""

    model_config = _STRICT
    bandwidth_GBps: PositiveFloat = Field(description="per GPU per direction")
    latency_us: float = Field(ge=0, description="per-hop latency")
    nvls: bool = Field(False, description="NVLink SHARP (in-switch reduction) available")


class InterNode(BaseModel):
    """Node-to-node network."""

    model_config = _STRICT
    nic_Gbps: PositiveFloat = Field(description="per NIC, gigabits per second")
    nics_per_node: PositiveInt
    latency_us: float = Field(ge=0)
    oversubscription: float = Field(1.0, ge=1.0, description="fabric oversubscription ratio (1 = full bisection)")


class Calibration(BaseModel):
    """Where collective costs come from: nominal figures, or a local gloo benchmark."""

    model_config = _STRICT
    source: Literal["nominal", "gloo_benchmark"] = "nominal"
    min_bytes: PositiveInt = Field(1024, description="gloo benchmark: smallest message")
    max_bytes: PositiveInt = Field(1 << 24, description="gloo benchmark: largest message")
    ranks: PositiveInt = Field(2, description="gloo benchmark: processes")
    iters: PositiveInt = Field(5, description="gloo benchmark: timed repeats per size")


class Topology(BaseModel):
    """config/topologies/{name}.yaml"""

    model_config = _STRICT
    name: str
    description: str = ""
    gpus_per_node: PositiveInt
    intra_node: IntraNode
    inter_node: InterNode
    bus_efficiency: float = Field(0.8, gt=0, le=1, description="achievable fraction of link bandwidth for large collectives")
    calibration: Calibration = Calibration()
