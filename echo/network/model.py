"""The network model the simulator queries: collective time on a topology, NCCL-style.

``NetworkModel(topology).estimate("all_reduce", group=[0, 1, ..., 7], nbytes=1 << 30)`` returns an
``Estimate`` (time, algbw, busbw, algorithm, protocol). Sizes follow nccl-tests (``bytes`` in
COMMS): the all-reduce buffer, the whole all-gather output, the whole reduce-scatter input.
The formulas live in ``echo.network.costs``; this module adds placement, caching and the
``network.json`` file that the calibrate stage writes and the simulate stage reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import NamedTuple

import numpy as np

from echo.artifacts import RESULTS
from echo.config import Topology, load_topology
from echo.io import write_json
from echo.network import costs
from echo.network.costs import NetworkParams, Shape, best, bus_factor, candidates

SOURCES = ("nominal", "fitted")
_CACHE_SIZE = 1 << 16


class Estimate(NamedTuple):
    """One collective's predicted cost; bandwidths in nccl-tests' sense (GB/s = 1e9 B/s).

    (A named tuple: the simulator makes millions, and a frozen dataclass is slower to build.)"""

    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    algorithm: str   # ring | tree | nvls | direct | p2p | none (group of one)
    protocol: str    # LL | simple | none


class NetworkModel:
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
        self._group_shape = lru_cache(maxsize=_CACHE_SIZE)(partial(Shape.of_group, gpus_per_node=topology.gpus_per_node))
        self._candidates = lru_cache(maxsize=_CACHE_SIZE)(partial(candidates, self.params))
        self._cached = lru_cache(maxsize=_CACHE_SIZE)(self._estimate_shape)

    # --- placement --------------------------------------------------------------------
    def shape(self, group: Sequence[int] | None = None, gpus: int | None = None) -> Shape:
        """Placement shape of ``group`` (global ranks) or of ranks 0..gpus-1."""
        if (group is None) == (gpus is None):
            raise ValueError("give exactly one of group= (global ranks) or gpus=")
        if group is not None:
            return self._group_shape(tuple(group))
        return Shape.of_first(int(gpus), self.topology.gpus_per_node)

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

    def concurrent(self, transfers: Sequence, starts_us: Sequence[float] | None = None) -> list[float]:
        """Durations (us) of transfers that overlap, sharing the links they have in common.

        ``transfers``: ``(op, group, nbytes)`` tuples (group = global ranks; for ``send`` the
        group is ``[src, dst]``, for ``recv`` ``[self, peer]``, as in COMMS), all starting at 0
        unless ``starts_us`` says otherwise. Each transfer runs its standalone algorithm; where
        several use one GPU's NVLink port or NIC at once they get max-min fair shares of it
        (``echo.network.contention``). A transfer alone takes exactly ``estimate(...).time_us``."""
        from echo.network.contention import simulate_transfers

        return simulate_transfers(self, transfers, starts_us)

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


def model_for(topology_name: str, results: str | Path = RESULTS, config_root: Path | None = None) -> NetworkModel:
    """The calibrated model of a topology: calibrate's network.json if it was written for this
    very config (and this version of the model), else, for a topology calibrated from nccl-tests
    logs, a fit of them made now (a few seconds), else the nominal model.

    A network.json written for an older version of the topology file is ignored: its fit
    describes a network that no longer exists. A local gloo benchmark is not run here (it takes
    the machine for a while): ``python -m echo calibrate`` does that."""
    topo = load_topology(topology_name, root=config_root)
    path = Path(results) / "calibrate" / topology_name / "network.json"
    if path.is_file():
        try:
            model = NetworkModel.load(path)
        except (KeyError, TypeError, ValueError):  # written by another version of the model
            model = None
        if model is not None and model.topology == topo:
            return model
    if topo.calibration.source == "nccl_tests":
        from echo.config import config_path
        from echo.network.calibrate import calibrated_model

        config_file = config_path("topology", topology_name, config_root)
        model, _ = calibrated_model(topo, config_file=config_file, root=config_file.parents[2], holdout=False)
        return model
    return NetworkModel(topo)


def collective_main(topology_name: str, op: str, gpus: int, nbytes: int, *,
                    results: str | Path = RESULTS, config_root: Path | None = None) -> dict:
    """``python -m echo collective``: one collective on ranks 0..gpus-1, as a JSON-able dict.

    Ranks fill nodes in order, so N <= gpus_per_node GPUs share one node and N = k x
    gpus_per_node span k whole nodes (other N leave the last node partly used)."""
    if gpus < 1 or nbytes < 0:
        raise ValueError(f"collective: need --gpus >= 1 and --bytes >= 0, got {gpus} and {nbytes}")
    model = model_for(topology_name, results, config_root)
    est = model.estimate(op, gpus=gpus, nbytes=nbytes)
    shape = model.shape(gpus=gpus)
    return {"topology": topology_name, "op": op, "gpus": gpus, "nodes": shape.nodes, "bytes": nbytes,
            "time_us": est.time_us, "algbw_GBps": est.algbw_GBps, "busbw_GBps": est.busbw_GBps,
            "algorithm": est.algorithm, "protocol": est.protocol, "source": model.source}
