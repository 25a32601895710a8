"""NCCL-style cost formulas: how long one collective takes on a group of a given placement shape.

Every candidate (algorithm x protocol) is ``time = latency + traffic * bytes / bandwidth``, and,
as NCCL's tuner does, the fastest candidate wins. The pieces:

- *traffic*: bytes each GPU pushes over its bottleneck link per message byte (ring all-reduce
  ``2(n-1)/n``, ring all-gather/reduce-scatter ``(n-1)/n``, tree all-reduce ``2``, NVLS
  all-reduce ``(n+1)/n``: one reduced shard in and the multicast result of every shard).
- *bandwidth*: intra-node links (``bandwidth_GBps * bus_efficiency``); between nodes, the NICs
  the group's GPUs own on a node (each GPU's share is ``nic_Gbps * nics_per_node / 8 /
  gpus_per_node / oversubscription``). A ring crossing nodes runs at the slower of the two.
- *latency*: one hop latency per algorithm step (intra-node or inter-node hop), scaled by the
  protocol.
- all-to-all is ``n-1`` rounds of pairwise exchange whose NVLink and NIC parts overlap;
  broadcast/reduce are a pipelined chain; send/recv one hop over NVLink or the GPU's NIC share.

Protocols (their constants are properties of NCCL's protocols, not of a machine):
- ``LL`` (low latency): the flag travels inside each 8-byte line, so a step costs one hop; half
  of every line is flag and its 8-byte stores reach about half the link peak, so it moves data
  at ``LL_BW_FRACTION`` = 1/4 of the link (the factor NCCL's own tuner uses for ring LL).
- ``simple``: full link bandwidth, but each step's data is followed by a separate flag and
  credit, a round trip: ``SIMPLE_STEP_HOPS`` = 2 hop latencies per step.
- Trees move data at ``TREE_EFFICIENCY`` = 0.9 of the links (NCCL's tuner figure): in a
  double binary tree a node is interior in one tree and a leaf in the other, so its links in
  each direction are not evenly loaded. This is what makes rings win for large messages.
- NVLS (NVLink SHARP, in-switch reduction) runs at ``NVLS_EFFICIENCY`` = 0.85 of the links
  (NCCL's tuner figure for Hopper switches: the switch's reduction rate, not the links, limits
  it); each of its two phases ends in a barrier signalled peer by peer (``n-1`` hops a phase).

A fitted model (from a benchmark) replaces the intra-node figures with measured per-step latency
and bandwidth, per op where measured, and uses the single protocol the benchmark exercised.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from echo.config.topology import Topology

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send", "recv")
P2P_OPS = ("send", "recv")

LL_BW_FRACTION = 0.25
SIMPLE_STEP_HOPS = 2.0
NVLS_EFFICIENCY = 0.85
TREE_EFFICIENCY = 0.9
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
    """One way to run a collective: ``time = latency_us + traffic * bytes / bytes_per_us``."""

    algorithm: str
    protocol: str
    latency_us: float
    bytes_per_us: float
    traffic: float


@dataclass(frozen=True)
class Protocol:
    name: str
    bw_fraction: float  # share of link bandwidth the protocol delivers
    step_hops: float    # hop latencies one algorithm step costs


@dataclass(frozen=True)
class NetworkParams:
    """Every number the cost formulas use; nominal ones come from a Topology, fitted ones from a fit."""

    gpus_per_node: int
    intra_bw_GBps: float   # achievable per GPU per direction inside a node
    intra_lat_us: float    # one intra-node hop
    nic_bw_GBps: float     # one GPU's share of its node's NICs, after oversubscription
    inter_lat_us: float    # one inter-node hop
    nvls: bool
    nvls_efficiency: float = NVLS_EFFICIENCY
    tree_efficiency: float = TREE_EFFICIENCY
    ll_bw_fraction: float = LL_BW_FRACTION  # 0 disables the LL protocol
    simple_step_hops: float = SIMPLE_STEP_HOPS
    # op -> {"latency_us": per step, "bandwidth_GBps": ...}: measured intra-node figures per op
    op_links: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_topology(cls, topo: Topology) -> NetworkParams:
        # bus_efficiency derates the intra-node bus (NVLink packet overhead keeps collectives at
        # ~80% of the wire rate); NICs stream near their line rate, so their share is not derated.
        nic_node_GBps = topo.inter_node.nic_Gbps * topo.inter_node.nics_per_node / 8
        return cls(
            gpus_per_node=topo.gpus_per_node,
            intra_bw_GBps=topo.intra_node.bandwidth_GBps * topo.bus_efficiency,
            intra_lat_us=topo.intra_node.latency_us,
            nic_bw_GBps=nic_node_GBps / topo.gpus_per_node / topo.inter_node.oversubscription,
            inter_lat_us=topo.inter_node.latency_us,
            nvls=topo.intra_node.nvls,
        )

    @classmethod
    def from_dict(cls, data: dict) -> NetworkParams:
        return cls(**data)

    def to_dict(self) -> dict:
        return asdict(self)

    def protocols(self) -> list[Protocol]:
        simple = Protocol("simple", 1.0, self.simple_step_hops)
        if self.ll_bw_fraction <= 0:
            return [simple]
        return [Protocol("LL", self.ll_bw_fraction, 1.0), simple]


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


def _intra(params: NetworkParams, op: str) -> tuple[float, float]:
    """(hop latency us, bandwidth GB/s) inside a node for ``op``: measured if a fit has it."""
    link = params.op_links.get(op)
    if link:
        return link["latency_us"], link["bandwidth_GBps"]
    return params.intra_lat_us, params.intra_bw_GBps


def _ring(params: NetworkParams, op: str, s: Shape, proto: Protocol) -> Candidate:
    lat_i, bw_i = _intra(params, op)
    steps, inter = ring_steps(op, s.gpus, s.nodes)
    latency = proto.step_hops * ((steps - inter) * lat_i + inter * params.inter_lat_us)
    bw = bw_i
    if s.nodes > 1:
        node_bw = s.per_node * params.nic_bw_GBps  # every node boundary is crossed via these NICs
        bw = min(bw_i, node_bw) if s.per_node > 1 else node_bw
    algo = "p2p" if op in P2P_OPS else "ring"
    return Candidate(algo, proto.name, latency, bw * proto.bw_fraction * _GBPS_TO_BYTES_PER_US,
                     ring_traffic(op, s.gpus))


def _tree(params: NetworkParams, s: Shape, proto: Protocol) -> Candidate:
    """NCCL's multi-node all-reduce tree: a chain inside each node, a double binary tree across.

    Each node sends the message up and down once (2x), but latency grows with log2(nodes)."""
    hops = 2 * ((s.per_node - 1) * params.intra_lat_us + math.ceil(math.log2(s.nodes)) * params.inter_lat_us)
    node_bw = s.per_node * params.nic_bw_GBps
    bw = (min(params.intra_bw_GBps, node_bw) if s.per_node > 1 else node_bw) * params.tree_efficiency
    return Candidate("tree", proto.name, proto.step_hops * hops,
                     bw * proto.bw_fraction * _GBPS_TO_BYTES_PER_US, 2.0)


def _nvls(params: NetworkParams, s: Shape) -> Candidate:
    """NVLink SHARP all-reduce inside one node (simple protocol only, as in NCCL)."""
    n = s.gpus
    bw = params.intra_bw_GBps * params.nvls_efficiency
    return Candidate("nvls", "simple", 2 * (n - 1) * params.intra_lat_us, bw * _GBPS_TO_BYTES_PER_US,
                     (n + 1) / n)


def _direct(params: NetworkParams, op: str, s: Shape, proto: Protocol) -> Candidate:
    """All-to-all as n-1 rounds of pairwise exchange; NVLink and NIC parts move concurrently."""
    n, k = s.gpus, s.per_node
    lat_i, bw_i = _intra(params, op)
    latency = proto.step_hops * ((k - 1) * lat_i + (n - k) * params.inter_lat_us)
    # seconds-per-message-byte of each part; the slower part sets the pace
    per_byte = max((k - 1) / n / bw_i, (n - k) / n / params.nic_bw_GBps)
    traffic = (n - 1) / n
    return Candidate("direct", proto.name, latency,
                     traffic / per_byte * proto.bw_fraction * _GBPS_TO_BYTES_PER_US, traffic)


NO_COST = Candidate("none", "none", 0.0, math.inf, 0.0)  # a group of one GPU moves nothing


def candidates(params: NetworkParams, op: str, shape: Shape) -> list[Candidate]:
    """Every (algorithm, protocol) NCCL could pick for ``op`` on ``shape``; none for one GPU."""
    if op not in OPS:
        raise ValueError(f"unknown collective '{op}'; known: {', '.join(OPS)}")
    if shape.gpus < 2:
        return []
    out = []
    for proto in params.protocols():
        if op == "all_to_all":
            out.append(_direct(params, op, shape, proto))
            continue
        out.append(_ring(params, op, shape, proto))
        if op == "all_reduce" and shape.nodes > 1 and "all_reduce" not in params.op_links:
            out.append(_tree(params, shape, proto))
    if op == "all_reduce" and shape.nodes == 1 and params.nvls and "all_reduce" not in params.op_links:
        out.append(_nvls(params, shape))
    return out


def best(cands: list[Candidate], nbytes: float) -> tuple[float, Candidate]:
    """(time us, candidate) of the fastest candidate for one size: the scalar fast path."""
    if nbytes <= 0 or not cands:
        return 0.0, NO_COST
    return min(((c.latency_us + c.traffic * nbytes / c.bytes_per_us, c) for c in cands), key=lambda tc: tc[0])


def predict(params: NetworkParams, op: str, shape: Shape, nbytes: np.ndarray) -> tuple[np.ndarray, list[Candidate]]:
    """Times (us) of the best candidate for each size, and which candidate won for each.

    Vectorised over ``nbytes``; a group of one GPU or an empty message costs nothing."""
    sizes = np.asarray(nbytes, dtype=np.float64)
    cands = candidates(params, op, shape)
    if not cands:
        return np.zeros_like(sizes), [NO_COST] * sizes.size
    lat = np.array([c.latency_us for c in cands])[:, None]
    per_byte = np.array([c.traffic / c.bytes_per_us for c in cands])[:, None]
    times = lat + per_byte * sizes.reshape(1, -1)
    best_idx = times.argmin(axis=0)
    chosen = times[best_idx, np.arange(times.shape[1])]
    chosen = np.where(sizes.reshape(-1) > 0, chosen, 0.0)
    return chosen.reshape(sizes.shape), [cands[i] if s > 0 else NO_COST for i, s in zip(best_idx, sizes.reshape(-1), strict=True)]
