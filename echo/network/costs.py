"""NCCL-style cost formulas: how long one collective takes on a group of a given placement shape.

A group sits on ``nodes`` nodes with ``per_node`` GPUs on each (``Shape``). Each way NCCL could
run a collective (algorithm x protocol) is a ``Candidate``; as NCCL's tuner does, the fastest
candidate wins. One candidate's time for a message of ``S`` bytes is

    time = latency + (w + (fill_slowdown - 1) * min(w, fill_bytes)) / bandwidth,   w = traffic * S

- *latency*, NCCL's tuning model: the protocol's base cost plus one hop latency per algorithm
  step, an NVLink hop for steps inside a node and a network hop for steps between nodes
  (ring all-reduce: ``2(n-1)`` steps of which ``2(m-1)`` cross nodes; tree all-reduce:
  ``2((k-1) + ceil(log2 m))``: a chain inside each node, a double binary tree across nodes).
- *traffic*: bytes each GPU moves over its bottleneck link per message byte (ring all-reduce
  ``2(n-1)/n``, all-gather/reduce-scatter ``(n-1)/n``, NVLS ``(n+1)/n``, ...).
- *bandwidth*: inside a node, the GPU's NVLink/NVSwitch bandwidth; across nodes, the NICs the
  group's GPUs own on a node (``per_node`` x one GPU's share). Either is scaled by the protocol's
  ``bw_fraction`` (LL carries a flag in every 8-byte line; LL128 one in every 128 bytes).
- *pipeline fill*: NCCL moves a message as a pipeline of chunks; until ``fill_bytes`` have gone
  through, not every stage (channel, step) is busy and data moves at ``1/fill_slowdown`` of the
  bandwidth. It is why bus bandwidth keeps climbing over 1 MiB..1 GiB while small messages are
  fast; a topology without a measured ramp uses ``fill_slowdown = 1`` (none).

Trees: in NCCL's double binary tree a node is interior in one tree and a leaf in the other, so
the busiest node moves ``2 S`` over its NICs, at each protocol's ``tree_efficiency`` of the links
(NCCL's tuner: 0.9, uneven load). On two nodes the busiest node moves only ``S``, but NCCL's
tuner caps tree bandwidth (``maxTreeBw``) so that large messages still run as rings; the model
charges ``2 S`` on any node count, which keeps a tree's bandwidth a ring's x tree_efficiency and
lets trees win, as in NCCL, by their ``log2`` latency.

NVLS (NVLink SHARP: the NVSwitch reduces and multicasts) is an all-reduce of one NVLink domain:
each GPU moves ``(n+1)/n`` per message byte over its port (reduce-scatter through the switch,
then a multicast all-gather) at ``nvls_efficiency`` of the links, and its latency is the
switch's, ``nvls_latency_us``, the same for 4 GPUs as for 72: the GPUs do not pass the data
along a chain of peers (NCCL's tuner: 25 us on NVLink for NVLS and NVLS-tree, whatever the
number of ranks). That is what keeps small all-reduces over a 72-GPU NVL72 rack in tens of
microseconds where a ring's 2(n-1) steps would take hundreds. Across nodes NVLS-tree runs NVLS
inside each node and a double binary tree of the nodes over the NICs, each GPU carrying its
1/k shard through its own NIC: ``(k+1)/k`` over NVLink, ``2/k`` over the NICs (``1/k`` on two
nodes, where each node is the root of one tree and the leaf of the other: NCCL's tuner doubles
NVLS-tree's network bandwidth on up to two nodes), latency ``nvls_latency_us + 2 log2(m)``
network hops. Both run the simple protocol only, and need two or more GPUs of a node.

All-to-all is NCCL's grouped send/recv to every peer: the peers are served at once, not one after
another, as far as NCCL's peer-to-peer channels reach (``P2P_PEERS_AT_ONCE``); beyond that in
rounds. Its latency is therefore ``max(1, (n-1) / P2P_PEERS_AT_ONCE)`` rounds of one send/recv's
latency (the protocol's base cost and one hop, a network hop when a peer is on another node),
not ``n-1`` hops in a row. XLA's measured all-to-alls inside a GB200 NVL72 rack show it
(reference ``kernels/xla_collective_table.csv``): the small-message floor is 11-12 us for 8, 16
and 18 GPUs, 20-21 us for 32 and 36, 54-64 us for 64 and 72, each round about one
collective-permute's 10-14 us, where ``n-1`` NVLink steps in a row would grow with every GPU.
Its NVLink and NIC data parts overlap (each GPU's remote traffic goes through its own NIC: about
one NIC per peer); broadcast/reduce are a pipelined chain; send/recv one hop over NVLink or the
GPU's NIC.

Each candidate also says how many bytes per message byte it puts on each GPU's NVLink port and
NIC (``nvlink_traffic``, ``nic_traffic``): what ``echo.network.contention`` shares when
transfers overlap.

A gloo benchmark fit (``op_links``) replaces the intra-node figures with measured per-step
latency and bandwidth per op, with the single protocol the benchmark exercised.

A job (or a measurement) may force NCCL's choice as ``NCCL_ALGO`` / ``NCCL_PROTO`` do
(``NetworkParams.nccl_algo``, ``nccl_proto``; the topology's ``nccl:`` section): only the
candidates of the listed algorithms (``Ring``, ``Tree``, ``NVLS``, ``NVLSTree``; ``^`` excludes)
and protocols (``LL``, ``LL128``, ``Simple``) stay; all-to-all and send/recv, which NCCL runs as
peer-to-peer transfers, are left to the protocol setting only. A setting that leaves a
collective nothing to run is an error, as in NCCL.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from echo.config.topology import (
    NCCL_ALGO_NAMES,
    NCCL_PROTO_NAMES,
    NVLS_EFFICIENCY,
    NVLS_LATENCY_US,
    Topology,
    parse_nccl_list,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv")
P2P_OPS = ("send", "recv")
PROTOCOLS = ("LL", "LL128", "simple")
PROTOCOL_FIELDS = ("base_us", "intra_hop_us", "inter_hop_us", "bw_fraction", "tree_efficiency")

# Nominal protocol constants (properties of NCCL's protocols, not of a machine), relative to a
# topology's hop latencies: LL pays one hop per step (the flag travels with the data) and moves
# data at 1/4 of the link (half of every 8-byte line is flag, and 8-byte stores reach about half
# the peak; NCCL's tuner uses 1/4); LL128 gives up 8 of every 128 bytes (NCCL's 0.92) and costs
# about 1.5 hops per step; simple streams at the full link but each step's data is followed by
# a separate flag and credit, a round trip: 2 hops per step.
NOMINAL_PROTOCOLS = {
    "LL": {"hop_factor": 1.0, "bw_fraction": 0.25},
    "LL128": {"hop_factor": 1.5, "bw_fraction": 0.92},
    "simple": {"hop_factor": 2.0, "bw_fraction": 1.0},
}
TREE_EFFICIENCY = 0.9   # NCCL's tuner figure: trees load links unevenly
# Peers an all-to-all serves at once: NCCL's 32 peer-to-peer channels at two channels a peer
# (NCCL_NCHANNELS_PER_NET_PEER's default). Assumed from NCCL's defaults; XLA's GB200 all-to-all
# floors (one round up to 18 GPUs, two at 32-36, four at 64-72) agree with it (module docstring).
P2P_PEERS_AT_ONCE = 16
_GBPS_TO_BYTES_PER_US = 1e3  # 1 GB/s = 1e9 B/s = 1e3 B/us


@dataclass(frozen=True)
class Shape:
    """Where a group sits: ``gpus`` ranks on ``nodes`` nodes, at least ``per_node`` on each."""

    gpus: int
    nodes: int
    per_node: int

    @classmethod
    def of_group(cls, group: Sequence[int], gpus_per_node: int) -> Shape:
        """Rank r lives on node r // gpus_per_node; the least-populated node bounds NIC bandwidth."""
        counts = Counter(int(r) // gpus_per_node for r in set(group))
        return cls(sum(counts.values()), len(counts), min(counts.values(), default=0))

    @classmethod
    def of_first(cls, gpus: int, gpus_per_node: int) -> Shape:
        """Ranks 0..gpus-1 (a partial last node holds the remainder)."""
        nodes = -(-gpus // gpus_per_node)
        return cls(gpus, nodes, min(gpus, gpus - (nodes - 1) * gpus_per_node))


@dataclass(frozen=True)
class Candidate:
    """One way to run a collective (see the module docstring for the time formula)."""

    algorithm: str
    protocol: str
    latency_us: float
    bytes_per_us: float          # bandwidth of the bottleneck link
    traffic: float               # bytes over the bottleneck link per message byte
    fill_bytes: float = 0.0      # link bytes that move at 1/fill_slowdown of the bandwidth
    fill_slowdown: float = 1.0
    nvlink_traffic: float = 0.0  # per GPU, NVLink bytes per message byte (for contention)
    nic_traffic: float = 0.0     # per GPU, bytes through its NIC per message byte (for contention)

    def data_us(self, nbytes: float) -> float:
        """Microseconds the data takes after the latency (scalar)."""
        w = self.traffic * nbytes
        return (w + (self.fill_slowdown - 1.0) * min(w, self.fill_bytes)) / self.bytes_per_us

    def time_us(self, nbytes: float) -> float:
        return self.latency_us + self.data_us(nbytes)


@dataclass(frozen=True)
class NetworkParams:
    """Every number the cost formulas use; nominal ones come from a Topology, fitted ones from a fit.

    ``protocols``: name -> ``{"base_us", "intra_hop_us", "inter_hop_us", "bw_fraction",
    "tree_efficiency"}`` (the last: the share of the links a tree gets with this protocol).
    """

    gpus_per_node: int
    intra_bw_GBps: float   # achievable per GPU per direction inside a node (simple protocol)
    nic_bw_GBps: float     # one GPU's share of its node's NICs, after oversubscription
    nvls: bool
    protocols: dict[str, dict[str, float]]
    fill_bytes: float = 0.0     # pipeline fill (link bytes), see the module docstring
    fill_slowdown: float = 1.0
    nvls_efficiency: float = NVLS_EFFICIENCY
    nvls_latency_us: float = NVLS_LATENCY_US  # an NVLS (or NVLS-tree's in-node) pass, whatever the GPUs
    # NCCL_ALGO / NCCL_PROTO as the job sets them ("" = NCCL's own choice), e.g. "Ring", "^LL128"
    nccl_algo: str = ""
    nccl_proto: str = ""
    # CPU time one thread spends launching a collective on one GPU. nccl-tests -g N queues its
    # iterations back to back, so its times are at least N x launch_us; jobs with one process
    # per GPU (what is simulated) issue ahead of the GPU and never see this floor.
    launch_us: float = 0.0
    # op -> {"latency_us": per step, "bandwidth_GBps": ...}: measured intra-node figures per op
    op_links: dict[str, dict[str, float]] = field(default_factory=dict)
    # api -> op -> {"latency_us", "bandwidth_GBps"}: what a collective costs on top when called
    # through that API instead of plain c10d: torch's functional collectives (DTensor's path)
    # copy the input and run Python on the calling thread. Measured by a gloo benchmark; a GPU
    # queues that work ahead of its kernels, so NCCL fits leave it empty.
    api_overheads: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def api_overhead_us(self, api: str, op: str, nbytes: float) -> float:
        """Extra microseconds of one ``op`` of ``nbytes`` called through ``api`` (0 if unmeasured)."""
        extra = self.api_overheads.get(api, {}).get(op)
        if not extra:
            return 0.0
        return extra["latency_us"] + nbytes / (extra["bandwidth_GBps"] * _GBPS_TO_BYTES_PER_US)

    def __post_init__(self):
        unknown = set(self.protocols) - set(PROTOCOLS)
        if unknown or not self.protocols:
            raise ValueError(f"network params: protocols must be some of {PROTOCOLS}, got {sorted(self.protocols)}")
        for name, proto in self.protocols.items():
            if set(proto) != set(PROTOCOL_FIELDS):
                raise ValueError(f"network params: protocol {name} needs {', '.join(PROTOCOL_FIELDS)}; "
                                 f"got {sorted(proto)}")
        if self.fill_slowdown < 1 or self.fill_bytes < 0:
            raise ValueError("network params: fill_slowdown must be >= 1 and fill_bytes >= 0")
        allowed_algorithms(self.nccl_algo)  # a setting NCCL would not parse fails here, not mid-simulation
        allowed_protocols(self.nccl_proto)

    @classmethod
    def from_topology(cls, topo: Topology) -> NetworkParams:
        # bus_efficiency derates the intra-node bus (NVLink packet overhead keeps collectives at
        # ~80% of the wire rate); NICs stream near their line rate, so their share is not derated.
        nic_node_GBps = topo.inter_node.nic_Gbps * topo.inter_node.nics_per_node / 8
        if topo.protocols:
            protocols = {name: p.model_dump() for name, p in topo.protocols.items()}
        else:
            protocols = {
                name: {"base_us": 0.0, "intra_hop_us": c["hop_factor"] * topo.intra_node.latency_us,
                       "inter_hop_us": c["hop_factor"] * topo.inter_node.latency_us, "bw_fraction": c["bw_fraction"],
                       "tree_efficiency": TREE_EFFICIENCY}
                for name, c in NOMINAL_PROTOCOLS.items() if name != "LL128" or topo.intra_node.ll128
            }
        return cls(
            gpus_per_node=topo.node_ranks,
            intra_bw_GBps=topo.intra_node.bandwidth_GBps * topo.bus_efficiency,
            # each GPU its own share of its node's NICs (idle GPUs of a partly used node leave theirs idle)
            nic_bw_GBps=nic_node_GBps / topo.gpus_per_node / topo.inter_node.oversubscription,
            nvls=topo.intra_node.nvls,
            protocols=protocols,
            fill_bytes=topo.pipeline.fill_MB * 1e6,
            fill_slowdown=topo.pipeline.fill_slowdown,
            nvls_efficiency=topo.intra_node.nvls_efficiency,
            nvls_latency_us=topo.intra_node.nvls_latency_us,
            nccl_algo=topo.nccl.algo or "",
            nccl_proto=topo.nccl.proto or "",
        )

    @classmethod
    def from_dict(cls, data: dict) -> NetworkParams:
        return cls(**data)

    def forcing(self, algo: str | None, proto: str | None) -> NetworkParams:
        """A copy with NCCL_ALGO / NCCL_PROTO as given (None or "": NCCL's own choice)."""
        return replace(self, nccl_algo=algo or "", nccl_proto=proto or "")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_protocols(self, **changes: dict[str, float]) -> NetworkParams:
        """A copy with some protocols' fields changed: ``with_protocols(LL={"base_us": 5.0})``."""
        protocols = {name: dict(p) for name, p in self.protocols.items()}
        for name, fields in changes.items():
            protocols[name].update(fields)
        return replace(self, protocols=protocols)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: what a link carries relative to the message."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def ring_steps(op: str, n: int, m: int = 1) -> tuple[int, int]:
    """(steps, of which inter-node) for the ring/chain schedule of ``op`` over n ranks on m nodes."""
    if op in P2P_OPS:
        return 1, int(m > 1)
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (m - 1)
    return n - 1, m - 1  # all_gather, reduce_scatter, all_to_all rounds, broadcast/reduce chain


def ring_traffic(op: str, n: int) -> float:
    """Bytes per message byte over each GPU's link for the ring/chain/direct schedule of ``op``."""
    if op in ("broadcast", "reduce", *P2P_OPS):
        return 1.0  # the whole message passes every link of the chain once
    return bus_factor(op, n)


TREE_NIC_TRAFFIC = 2.0  # NIC bytes per message byte on a tree's busiest node (module docstring)


def _fill(params: NetworkParams, bw: float, intra_bw: float) -> float:
    """Fill bytes of a candidate whose bottleneck runs at ``bw``: the pipeline fill is a fixed
    time (measured on the intra-node links), so a slower bottleneck fills with fewer bytes."""
    return params.fill_bytes * min(1.0, bw / intra_bw)


def _intra(params: NetworkParams, op: str, proto: dict) -> tuple[float, float]:
    """(hop latency us, bandwidth GB/s) inside a node for ``op``: measured if a fit has it."""
    link = params.op_links.get(op)
    if link:
        return link["latency_us"], link["bandwidth_GBps"]
    return proto["intra_hop_us"], params.intra_bw_GBps * proto["bw_fraction"]


def _ring(params: NetworkParams, op: str, s: Shape, name: str, proto: dict) -> Candidate:
    hop_i, bw_i = _intra(params, op, proto)
    steps, inter = ring_steps(op, s.gpus, s.nodes)
    latency = proto["base_us"] + (steps - inter) * hop_i + inter * proto["inter_hop_us"]
    traffic = ring_traffic(op, s.gpus)
    if s.nodes == 1:
        return Candidate("p2p" if op in P2P_OPS else "ring", name, latency, bw_i * _GBPS_TO_BYTES_PER_US, traffic,
                         params.fill_bytes, params.fill_slowdown, traffic, 0.0)
    k = s.per_node
    node_bw = k * params.nic_bw_GBps * proto["bw_fraction"]  # every node boundary is crossed via these NICs
    bw = min(bw_i, node_bw) if k > 1 else node_bw
    # per GPU: of the k rings through a node, one leaves it through this GPU's NIC
    return Candidate("p2p" if op in P2P_OPS else "ring", name, latency, bw * _GBPS_TO_BYTES_PER_US, traffic,
                     _fill(params, bw, bw_i), params.fill_slowdown, traffic * (k - 1) / k, traffic / k)


def _tree(params: NetworkParams, s: Shape, name: str, proto: dict) -> Candidate:
    """NCCL's multi-node all-reduce tree: a chain inside each node, a double binary tree across."""
    k, m = s.per_node, s.nodes
    latency = proto["base_us"] + 2 * ((k - 1) * proto["intra_hop_us"] + math.ceil(math.log2(m)) * proto["inter_hop_us"])
    frac = proto["bw_fraction"]
    nic = TREE_NIC_TRAFFIC / k
    per_byte = nic / (params.nic_bw_GBps * frac * proto["tree_efficiency"])
    if k > 1:  # up and down the chain inside the node
        per_byte = max(per_byte, 2.0 / (params.intra_bw_GBps * frac))
    per_byte /= _GBPS_TO_BYTES_PER_US
    # traffic 2 (nccl-tests' tree convention: algbw = busbw / 2), so that the pipeline fill
    # counts bus bytes as it does for rings
    return Candidate("tree", name, latency, 2.0 / per_byte, 2.0,
                     _fill(params, 2.0 / per_byte / _GBPS_TO_BYTES_PER_US, params.intra_bw_GBps * frac), params.fill_slowdown,
                     2.0 if k > 1 else 0.0, nic)


def _nvls(params: NetworkParams, s: Shape) -> Candidate:
    """NVLink SHARP all-reduce inside one NVLink domain (simple protocol only, as in NCCL):
    reduce-scatter through the switch, then a multicast all-gather; the switch's latency,
    the same on any number of GPUs (module docstring)."""
    n = s.gpus
    bw = params.intra_bw_GBps * params.nvls_efficiency
    traffic = (n + 1) / n
    return Candidate("nvls", "simple", params.nvls_latency_us, bw * _GBPS_TO_BYTES_PER_US, traffic,
                     params.fill_bytes, params.fill_slowdown, traffic, 0.0)


def _nvls_tree(params: NetworkParams, s: Shape) -> Candidate:
    """NCCL's NVLS-tree all-reduce across nodes: NVLS inside each node, a double binary tree of
    the nodes on each GPU's 1/k shard through its own NIC (simple protocol only)."""
    k, m = s.per_node, s.nodes
    proto = params.protocols.get("simple") or next(iter(params.protocols.values()))
    latency = params.nvls_latency_us + 2 * math.ceil(math.log2(m)) * proto["inter_hop_us"]
    nvlink = (k + 1) / k
    nic = (1.0 if m <= 2 else TREE_NIC_TRAFFIC) / k
    per_byte = max(nvlink / (params.intra_bw_GBps * params.nvls_efficiency),
                   nic / (params.nic_bw_GBps * proto["bw_fraction"] * proto["tree_efficiency"])) / _GBPS_TO_BYTES_PER_US
    # traffic 2, as a tree's (nccl-tests' tree convention), for the pipeline fill
    return Candidate("nvls_tree", "simple", latency, 2.0 / per_byte, 2.0,
                     _fill(params, 2.0 / per_byte / _GBPS_TO_BYTES_PER_US, params.intra_bw_GBps), params.fill_slowdown,
                     nvlink, nic)


def _direct(params: NetworkParams, op: str, s: Shape, name: str, proto: dict) -> Candidate:
    """All-to-all as grouped send/recv to every peer, in rounds of P2P_PEERS_AT_ONCE peers;
    NVLink and NIC parts move concurrently."""
    n, k = s.gpus, s.per_node
    hop_i, bw_i = _intra(params, op, proto)
    # rounds of concurrent send/recv pairs, each a send/recv's latency (module docstring)
    rounds = max(1.0, (n - 1) / P2P_PEERS_AT_ONCE)
    latency = rounds * (proto["base_us"] + (proto["inter_hop_us"] if n > k else hop_i))
    nic_bw = params.nic_bw_GBps * proto["bw_fraction"]
    # microseconds per message byte of each part; the slower part sets the pace
    per_byte = max((k - 1) / n / bw_i, (n - k) / n / nic_bw if n > k else 0.0) / _GBPS_TO_BYTES_PER_US
    traffic = (n - 1) / n
    return Candidate("direct", name, latency, traffic / per_byte, traffic, params.fill_bytes, params.fill_slowdown,
                     (k - 1) / n, (n - k) / n)


NO_COST = Candidate("none", "none", 0.0, math.inf, 0.0)  # a group of one GPU moves nothing


# NCCL's names (NCCL_ALGO, NCCL_PROTO) -> Echo's (echo.config.topology); CollNet and PAT not modelled
_FORCEABLE = frozenset(a for a in NCCL_ALGO_NAMES.values() if a)  # direct / p2p: NCCL's p2p, not an algorithm


def allowed_algorithms(setting: str) -> frozenset[str] | None:
    """Echo algorithm names an NCCL_ALGO setting leaves (None: no setting)."""
    return parse_nccl_list(setting, NCCL_ALGO_NAMES, "NCCL_ALGO") if setting else None


def allowed_protocols(setting: str) -> frozenset[str] | None:
    """Echo protocol names an NCCL_PROTO setting leaves (None: no setting)."""
    return parse_nccl_list(setting, NCCL_PROTO_NAMES, "NCCL_PROTO") if setting else None


def _all_candidates(params: NetworkParams, op: str, shape: Shape) -> list[Candidate]:
    out = []
    measured = op in params.op_links
    for name, proto in params.protocols.items():
        if op == "all_to_all":
            out.append(_direct(params, op, shape, name, proto))
            continue
        out.append(_ring(params, op, shape, name, proto))
        if op == "all_reduce" and shape.nodes > 1 and not measured:
            out.append(_tree(params, shape, name, proto))
    if op == "all_reduce" and params.nvls and not measured and shape.per_node >= 2:
        out.append(_nvls(params, shape) if shape.nodes == 1 else _nvls_tree(params, shape))
    return out


def candidates(params: NetworkParams, op: str, shape: Shape) -> list[Candidate]:
    """Every (algorithm, protocol) NCCL could pick for ``op`` on ``shape`` (as far as the job's
    NCCL_ALGO / NCCL_PROTO allow); none for one GPU."""
    if op not in OPS:
        raise ValueError(f"unknown collective '{op}'; known: {', '.join(OPS)}")
    if shape.gpus < 2:
        return []
    out = _all_candidates(params, op, shape)
    algos, protos = allowed_algorithms(params.nccl_algo), allowed_protocols(params.nccl_proto)
    if algos is None and protos is None:
        return out
    kept = [c for c in out if (algos is None or c.algorithm not in _FORCEABLE or c.algorithm in algos)
            and (protos is None or c.protocol in protos)]
    if not kept:
        settings = ", ".join(f"{k}={v}" for k, v in (("NCCL_ALGO", params.nccl_algo), ("NCCL_PROTO", params.nccl_proto))
                             if v)
        raise ValueError(f"no algorithm/protocol available for {op} on {shape.gpus} GPUs ({shape.nodes} node(s)): "
                         f"{settings} excludes all of "
                         f"{', '.join(sorted({c.algorithm + '/' + c.protocol for c in out}))}")
    return kept


def best(cands: list[Candidate], nbytes: float) -> tuple[float, Candidate]:
    """(time us, candidate) of the fastest candidate for one size: the scalar fast path."""
    if nbytes <= 0 or not cands:
        return 0.0, NO_COST
    best_time, best_cand = math.inf, NO_COST
    for c in cands:
        w = c.traffic * nbytes
        fill = c.fill_bytes if w > c.fill_bytes else w
        t = c.latency_us + (w + (c.fill_slowdown - 1.0) * fill) / c.bytes_per_us
        if t < best_time:
            best_time, best_cand = t, c
    return best_time, best_cand


def candidate_times(cands: list[Candidate], nbytes: np.ndarray) -> np.ndarray:
    """Times (us), one row per candidate, one column per size."""
    sizes = np.asarray(nbytes, dtype=np.float64).reshape(1, -1)
    # one array of the candidates' figures, a column each (one conversion: the fits call this often)
    figs = np.array([(c.latency_us, c.traffic, 1.0 / c.bytes_per_us, c.fill_bytes, c.fill_slowdown) for c in cands])
    lat, traffic, inv_bw, fill, slow = (figs[:, i:i + 1] for i in range(5))
    w = traffic * sizes
    return lat + (w + (slow - 1.0) * np.minimum(w, fill)) * inv_bw


def predict(params: NetworkParams, op: str, shape: Shape, nbytes: np.ndarray) -> tuple[np.ndarray, list[Candidate]]:
    """Times (us) of the best candidate for each size, and which candidate won for each.

    Vectorised over ``nbytes``; a group of one GPU or an empty message costs nothing."""
    sizes = np.asarray(nbytes, dtype=np.float64)
    cands = candidates(params, op, shape)
    if not cands:
        return np.zeros_like(sizes), [NO_COST] * sizes.size
    times = candidate_times(cands, sizes.reshape(-1))
    best_idx = times.argmin(axis=0)
    chosen = times[best_idx, np.arange(times.shape[1])]
    chosen = np.where(sizes.reshape(-1) > 0, chosen, 0.0)
    return chosen.reshape(sizes.shape), [cands[i] if s > 0 else NO_COST for i, s in zip(best_idx, sizes.reshape(-1), strict=True)]
