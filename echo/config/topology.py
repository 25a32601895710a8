"""A network: node size, intra-node links, NICs and fabric, and how to calibrate collectives on it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationInfo, field_validator

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class IntraNode(BaseModel):
    """GPU-to-GPU links inside a node (NVLink/NVSwitch, or loopback for local-gloo)."""

    model_config = _STRICT
    bandwidth_GBps: PositiveFloat = Field(description="per GPU per direction")
    latency_us: float = Field(ge=0, description="per-hop latency")
    nvls: bool = Field(False, description="NVLink SHARP (in-switch reduction) available")
    ll128: bool = Field(True, description="NCCL's LL128 protocol available (NVLink nodes)")


class InterNode(BaseModel):
    """Node-to-node network."""

    model_config = _STRICT
    nic_Gbps: PositiveFloat = Field(description="per NIC, gigabits per second")
    nics_per_node: PositiveInt
    latency_us: float = Field(ge=0)
    oversubscription: float = Field(1.0, ge=1.0, description="fabric oversubscription ratio (1 = full bisection)")


class ProtocolFigures(BaseModel):
    """One NCCL protocol's costs, where a topology states them instead of deriving them from the
    hop latencies (see echo.network.costs)."""

    model_config = _STRICT
    base_us: float = Field(ge=0, description="fixed cost of one collective with this protocol")
    intra_hop_us: float = Field(ge=0, description="per algorithm step inside a node")
    inter_hop_us: float = Field(ge=0, description="per algorithm step between nodes")
    bw_fraction: float = Field(gt=0, le=1, description="share of the link bandwidth the protocol delivers")
    tree_efficiency: float = Field(0.9, gt=0, le=1, description="share of the links a tree gets with this protocol")


class Pipeline(BaseModel):
    """NCCL's chunk pipeline: until fill_MB of link traffic has gone through, data moves at
    1/fill_slowdown of the bandwidth (the climb of bus bandwidth with message size)."""

    model_config = _STRICT
    fill_MB: float = Field(0.0, ge=0)
    fill_slowdown: float = Field(1.0, ge=1)


class Calibration(BaseModel):
    """Where collective costs come from: nominal figures, a local gloo benchmark, or nccl-tests logs."""

    model_config = _STRICT
    source: Literal["nominal", "gloo_benchmark", "nccl_tests"] = "nominal"
    min_bytes: PositiveInt = Field(1024, description="gloo benchmark: smallest message")
    max_bytes: PositiveInt = Field(1 << 24, description="gloo benchmark: largest message")
    ranks: PositiveInt = Field(2, description="gloo benchmark: processes")
    iters: PositiveInt = Field(5, description="gloo benchmark: timed repeats per size")
    logs: tuple[str, ...] = Field((), validate_default=True,
                                  description="nccl_tests: log files, relative to the reference folder (echo.reference)")

    @field_validator("logs", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value

    @field_validator("logs")
    @classmethod
    def _logs_match_source(cls, logs: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        source = info.data.get("source")
        if source == "nccl_tests" and not logs:
            raise ValueError("source nccl_tests needs at least one log file")
        if logs and source != "nccl_tests":
            raise ValueError(f"logs are read only with source nccl_tests (source is {source})")
        if len(set(logs)) != len(logs):
            raise ValueError("a log file is listed twice")
        return logs


class Topology(BaseModel):
    """config/topologies/{name}.yaml"""

    model_config = _STRICT
    name: str
    description: str = ""
    gpus_per_node: PositiveInt
    intra_node: IntraNode
    inter_node: InterNode
    bus_efficiency: float = Field(0.8, gt=0, le=1, description="achievable fraction of link bandwidth for large collectives")
    protocols: dict[Literal["LL", "LL128", "simple"], ProtocolFigures] | None = Field(
        None, description="NCCL protocol costs; default: derived from the hop latencies")
    pipeline: Pipeline = Pipeline()
    calibration: Calibration = Calibration()
