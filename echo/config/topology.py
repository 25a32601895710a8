"""A network: node size, intra-node links, NICs and fabric, and how to calibrate collectives on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from echo.config.figure import Figure

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)

# NCCL's tuner (src/graph/tuning.cc): NVLS and NVLS-tree cost 25 us on NVLink whatever the number
# of ranks; the switch's reduction delivers 0.85 (Hopper) or 0.74 (Blackwell) of the links.
NVLS_LATENCY_US = 25.0
NVLS_EFFICIENCY = 0.85


def parse_nccl_list(setting: str, names: Mapping[str, str | None], variable: str) -> frozenset[str]:
    """What an NCCL_ALGO / NCCL_PROTO value leaves, as NCCL parses it: comma-separated names,
    case-insensitive; a leading ``^`` keeps all but those. ``names``: NCCL's name (lower case) ->
    Echo's (None: one NCCL has that Echo does not model). A ValueError names what is wrong."""
    text = setting.strip()
    exclude = text.startswith("^")
    tokens = [t.strip().lower() for t in text.lstrip("^").split(",") if t.strip()]
    if ":" in text:
        raise ValueError(f"{variable}={setting!r}: per-collective settings ('allreduce:...') are not modelled; "
                         "give one list for all collectives")
    unknown = [t for t in tokens if t not in names]
    if not tokens or unknown:
        raise ValueError(f"{variable}={setting!r}: unknown name(s) {', '.join(unknown) or '(none given)'}; "
                         f"NCCL knows {', '.join(names)}")
    chosen = {names[t] for t in tokens} - {None}
    known = {v for v in names.values() if v}
    return frozenset(known - chosen if exclude else chosen)


class IntraNode(BaseModel):
    """GPU-to-GPU links inside a node (NVLink/NVSwitch, or loopback for local-gloo)."""

    model_config = _STRICT
    bandwidth_GBps: PositiveFloat = Field(description="per GPU per direction")
    latency_us: float = Field(ge=0, description="per-hop latency")
    nvls: bool = Field(False, description="NVLink SHARP (in-switch reduction) available")
    nvls_latency_us: float = Field(NVLS_LATENCY_US, ge=0, description="one NVLS all-reduce's fixed cost, the "
                                   "switch's: the same for any number of GPUs (default NCCL's tuner figure)")
    nvls_efficiency: float = Field(NVLS_EFFICIENCY, gt=0, le=1, description="share of the links an NVLS "
                                   "all-reduce gets (NCCL's tuner: 0.85 Hopper, 0.74 Blackwell)")
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


class Nccl(BaseModel):
    """NCCL settings the job runs with, as its environment variables would set them."""

    model_config = _STRICT
    algo: str | None = Field(None, description="NCCL_ALGO, e.g. Ring, 'Ring,Tree', ^NVLS (default: NCCL's choice)")
    proto: str | None = Field(None, description="NCCL_PROTO, e.g. Simple, ^LL128 (default: NCCL's choice)")

    @field_validator("algo")
    @classmethod
    def _known_algo(cls, value: str | None) -> str | None:
        if value is not None:
            parse_nccl_list(value, NCCL_ALGO_NAMES, "NCCL_ALGO")
        return value

    @field_validator("proto")
    @classmethod
    def _known_proto(cls, value: str | None) -> str | None:
        if value is not None:
            parse_nccl_list(value, NCCL_PROTO_NAMES, "NCCL_PROTO")
        return value


# NCCL's names as parse_nccl_list takes them (echo.network.costs keeps the same mapping)
NCCL_ALGO_NAMES = {"ring": "ring", "tree": "tree", "nvls": "nvls", "nvlstree": "nvls_tree",
                    "collnetdirect": None, "collnetchain": None, "pat": None}
NCCL_PROTO_NAMES = {"ll": "LL", "ll128": "LL128", "simple": "simple"}


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


class LinkVariability(BaseModel):
    """How much the bandwidth a node's NICs deliver differs from node to node (echo.simulate.slow_links)."""

    model_config = _STRICT
    nic_bw_sigma: Figure = Field(description="relative standard deviation of a node's persistent factor on its NICs' "
                                 "delivered bandwidth across the nodes of a cluster (0.02: 2%)")

    @field_validator("nic_bw_sigma")
    @classmethod
    def _below_one(cls, fig: Figure) -> Figure:
        if not 0.0 <= fig.value < 0.25:
            raise ValueError(f"nic_bw_sigma must be within [0, 0.25) (a node's bandwidth factor 1 - 4 sigma must stay "
                             f"positive), got {fig.value}")
        return fig


class Topology(BaseModel):
    """config/topologies/{name}.yaml"""

    model_config = _STRICT
    name: str
    description: str = ""
    gpus_per_node: PositiveInt = Field(description="GPUs of one node: one NVLink domain (a server, or an NVL72 rack)")
    ranks_per_node: PositiveInt | None = Field(
        None, description="GPUs of each node a job's ranks fill, in rank order, the others left idle (default: "
        "gpus_per_node). GB200/GB300 NVL72 jobs commonly run 64 of a rack's 72 GPUs (16 of 18 compute trays) so "
        "that power-of-two TP/EP groups stay in one rack")
    gpus_per_host: PositiveInt | None = Field(
        None, description="GPUs of one server (its CPUs, memory, NICs, power supplies), whose failure stops them "
        "all (default: gpus_per_node; an NVL72 rack's compute tray holds 4)")
    intra_node: IntraNode
    inter_node: InterNode
    bus_efficiency: float = Field(0.8, gt=0, le=1, description="achievable fraction of link bandwidth for large collectives")
    protocols: dict[Literal["LL", "LL128", "simple"], ProtocolFigures] | None = Field(
        None, description="NCCL protocol costs; default: derived from the hop latencies")
    pipeline: Pipeline = Pipeline()
    nccl: Nccl = Nccl()
    calibration: Calibration = Calibration()
    link_variability: LinkVariability | None = Field(
        None, description="node-to-node spread of the NICs' delivered bandwidth, for the summary's step_link_p50_s "
        "... (echo.simulate.slow_links); None: every node's NICs alike")

    @model_validator(mode="after")
    def _ranks_fit_a_node(self) -> Topology:
        if self.gpus_per_host is not None and self.gpus_per_node % self.gpus_per_host:
            raise ValueError(f"gpus_per_host {self.gpus_per_host} does not divide gpus_per_node {self.gpus_per_node}")
        if self.ranks_per_node is not None and self.ranks_per_node > self.gpus_per_node:
            raise ValueError(f"ranks_per_node {self.ranks_per_node} is more than the node's gpus_per_node "
                             f"{self.gpus_per_node}")
        return self

    @property
    def host_gpus(self) -> int:
        """GPUs of one server (echo.plan.reliability: a host's failure stops them all)."""
        return self.gpus_per_host or self.gpus_per_node

    @property
    def node_ranks(self) -> int:
        """GPUs of each node a job fills: rank r runs on node r // node_ranks."""
        return self.ranks_per_node or self.gpus_per_node

    def nodes(self, world_size: int) -> int:
        """Nodes a job of ``world_size`` ranks fills (node = rank // node_ranks; the last may be partial
        for a job smaller than a node)."""
        return -(-world_size // self.node_ranks)

    def placement_problem(self, world_size: int) -> tuple[str, str] | None:
        """(key, reason) when a job of ``world_size`` ranks cannot be placed on this topology's nodes,
        else None: a job larger than one node fills whole nodes, ``node_ranks`` GPUs on each."""
        g = self.node_ranks
        if world_size <= g or world_size % g == 0:
            return None
        key = "ranks_per_node" if self.ranks_per_node is not None else "gpus_per_node"
        used = (f"{g} of each node's {self.gpus_per_node} GPUs" if g != self.gpus_per_node
                else f"all {g} GPUs of each node")
        hint = "" if self.ranks_per_node is not None else (
            "; a job may use part of each node: set ranks_per_node (e.g. 64 of an NVL72 rack's 72)")
        return key, (f"world size {world_size} is above {g} and not a multiple of it: a job larger than a node "
                     f"fills whole nodes, {used}{hint}")
