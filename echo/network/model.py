"""The network model the simulator queries: collective time on a topology, NCCL-style.

``NetworkModel(topology).estimate("all_reduce", group=[0, 1, ..., 7], nbytes=1 << 30)`` returns an
``Estimate`` (time, algbw, busbw, algorithm, protocol). Sizes follow nccl-tests (``bytes`` in
COMMS): the all-reduce buffer, the whole all-gather output, the whole reduce-scatter input.
The formulas live in ``echo.network.costs``, link sharing in ``echo.network.contention``; this
module adds placement, caching and the ``network.json`` file that the calibrate stage writes and
the simulate stage reads. ``CollectiveCosts`` is what the simulator asks of a network.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import NamedTuple

import numpy as np

from echo.config import Topology
from echo.io import write_json
from echo.network import costs
from echo.network.contention import Flow, flow_of, simulate_flows
from echo.network.costs import NetworkParams, Shape, best, bus_factor, candidates

SOURCES = ("nominal", "fitted")
_CACHE_SIZE = 1 << 16


class Estimate(NamedTuple):
    """One collective's predicted cost; bandwidths in nccl-tests' sense (GB/s = 1e9 B/s).

    (A named tuple: the simulator makes millions, and a frozen dataclass is slower to build.)"""

    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    algorithm: str   # ring | tree | nvls | nvls_tree | direct | p2p | none (group of one)
    protocol: str    # LL | simple | none


class CollectiveCosts(ABC):
    """What the simulator asks of a network (``NetworkModel``, or a test's stand-in): a
    collective's time and, optionally, its link loads and its calling API's own overhead."""

    @abstractmethod
    def estimate(self, op: str, group: Sequence[int], *, nbytes: int) -> Estimate:
        """Cost of one ``op`` of ``nbytes`` on ``group`` (global ranks)."""

    def flow(self, op: str, group: Sequence[int], nbytes: int) -> Flow | None:
        """Latency, data time and link loads of the transfer; None: it fills its device's link."""
        return None

    def api_overhead_us(self, api: str, op: str, nbytes: int) -> float:
        """Extra microseconds of a collective called through ``api`` (c10d | functional)."""
        return 0.0


class NetworkModel(CollectiveCosts):
    """Collective costs on one topology, from its nominal figures or from fitted parameters."""

    def __init__(self, topology: Topology, params: NetworkParams | None = None,
                 source: str = "nominal", fit: dict | None = None):
        if source not in SOURCES:
            raise ValueError(f"network model source must be one of {SOURCES}, got '{source}'")
        self.topology = topology
        self.params = params or NetworkParams.from_topology(topology)
        self.source = source
        self.fit = fit or {}  # what the fit saw and how well it matched (kept in network.json)
        # Per-instance caches, so that a model with other parameters never reads a stale entry:
        # group -> shape, (op, shape) -> candidates, (op, shape, bytes) -> Estimate.
        # ranks fill nodes in order, node_ranks GPUs on each (topology.ranks_per_node, default all)
        self._group_shape = lru_cache(maxsize=_CACHE_SIZE)(partial(Shape.of_group, gpus_per_node=topology.node_ranks))
        self._candidates = lru_cache(maxsize=_CACHE_SIZE)(partial(candidates, self.params))
        self._cached = lru_cache(maxsize=_CACHE_SIZE)(self._estimate_shape)

    def forcing(self, algo: str | None, proto: str | None) -> NetworkModel:
        """This model as a job with NCCL_ALGO / NCCL_PROTO set would see it (None: NCCL's own choice)."""
        return NetworkModel(self.topology, self.params.forcing(algo, proto), self.source, self.fit)

    # --- placement --------------------------------------------------------------------
    def shape(self, group: Sequence[int] | None = None, gpus: int | None = None) -> Shape:
        """Placement shape of ``group`` (global ranks) or of ranks 0..gpus-1."""
        if (group is None) == (gpus is None):
            raise ValueError("give exactly one of group= (global ranks) or gpus=")
        if group is not None:
            return self._group_shape(tuple(group))
        return Shape.of_first(int(gpus), self.topology.node_ranks)

    # --- queries ----------------------------------------------------------------------
    def estimate(self, op: str, group: Sequence[int] | None = None, *, gpus: int | None = None,
                 nbytes: int) -> Estimate:
        """Cost of one ``op`` of ``nbytes`` on ``group`` (or on ranks 0..gpus-1); cached."""
        return self._cached(op, self.shape(group, gpus), int(nbytes))

    def time_us(self, op: str, group: Sequence[int] | None = None, *, gpus: int | None = None,
                nbytes: np.ndarray | Sequence[int]) -> np.ndarray:
        """Vectorised time in microseconds for many sizes of one op on one group."""
        times, _ = costs.predict(self.params, op, self.shape(group, gpus), np.asarray(nbytes))
        return times

    def predict(self, op: str, shape: Shape, nbytes: np.ndarray) -> dict[str, np.ndarray | list]:
        """Columns (time_us, algbw_GBps, busbw_GBps, algorithm, protocol) for many sizes."""
        sizes = np.asarray(nbytes, dtype=np.float64)
        times, chosen = costs.predict(self.params, op, shape, sizes)
        with np.errstate(divide="ignore", invalid="ignore"):
            algbw = np.where(times > 0, sizes / (times * 1e3), 0.0)
        return {
            "time_us": times, "algbw_GBps": algbw,
            "busbw_GBps": algbw * (bus_factor(op, shape.gpus) if shape.gpus > 1 else 0.0),
            "algorithm": [c.algorithm for c in chosen], "protocol": [c.protocol for c in chosen],
        }

    def flow(self, op: str, group: Sequence[int], nbytes: int) -> Flow:
        """One transfer alone as link sharing sees it (``echo.network.contention.flow_of``)."""
        group = list(dict.fromkeys(int(r) for r in group))
        return flow_of(self.params, self.shape(group), op, group, nbytes)

    def api_overhead_us(self, api: str, op: str, nbytes: int) -> float:
        return self.params.api_overhead_us(api, op, nbytes)

    def concurrent(self, transfers: Sequence, starts_us: Sequence[float] | None = None) -> list[float]:
        """Durations (us) of transfers that overlap, sharing the links they have in common, each
        measured from its own start.

        ``transfers``: ``(op, group, nbytes)`` tuples (group = global ranks; for ``send`` the
        group is ``[src, dst]``, for ``recv`` ``[self, peer]``, as in COMMS), all starting at 0
        unless ``starts_us`` says otherwise. Each transfer runs its standalone algorithm; where
        several use one GPU's NVLink port or NIC at once they get max-min fair shares of it
        (``echo.network.contention``). A transfer alone takes exactly ``estimate(...).time_us``."""
        starts = [0.0] * len(transfers) if starts_us is None else [float(s) for s in starts_us]
        if len(starts) != len(transfers):
            raise ValueError(f"concurrent: {len(transfers)} transfers but {len(starts)} start times")
        ends = simulate_flows([self.flow(op, group, nbytes) for op, group, nbytes in transfers], starts)
        return [end - start for end, start in zip(ends, starts, strict=True)]

    def _estimate_shape(self, op: str, shape: Shape, nbytes: int) -> Estimate:
        time_us, chosen = best(self._candidates(op, shape), nbytes)
        algbw = nbytes / (time_us * 1e3) if time_us > 0 else 0.0
        busbw = algbw * bus_factor(op, shape.gpus) if shape.gpus > 1 else 0.0
        return Estimate(time_us, algbw, busbw, chosen.algorithm, chosen.protocol)

    # --- persistence ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"source": self.source, "topology": self.topology.model_dump(mode="json"),
                "params": self.params.to_dict(), "fit": self.fit}

    @classmethod
    def from_dict(cls, data: dict) -> NetworkModel:
        try:
            topo = Topology.model_validate(data["topology"])
            params = NetworkParams.from_dict(data["params"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"network model written by another version of echo.network ({exc}); "
                             "re-run the calibrate stage") from None
        return cls(topo, params, data["source"], data.get("fit"))

    def save(self, path: str | Path) -> None:
        write_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> NetworkModel:
        return cls.from_dict(json.loads(Path(path).read_text()))

