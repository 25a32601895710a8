"""``python -m echo collective``: one collective priced on a topology's calibrated model."""

from __future__ import annotations

from pathlib import Path

from echo.config import config_path, load_topology
from echo.network.calibrate import calibrated_model
from echo.network.model import NetworkModel


def model_for(topology_name: str, network_json: str | Path | None = None,
              config_root: Path | None = None) -> NetworkModel:
    """The calibrated model of a topology: ``network_json`` (calibrate's) if written for this very
    config and version of the model (an older topology file's fit describes a network that no
    longer exists), else a fit of its nccl-tests logs made now (seconds), else the nominal model.
    A local gloo benchmark is not run here: ``python -m echo calibrate`` does that."""
    topo = load_topology(topology_name, root=config_root)
    if network_json is not None and Path(network_json).is_file():
        try:
            model = NetworkModel.load(network_json)
        except (KeyError, TypeError, ValueError):  # written by another version of the model
            model = None
        if model is not None and model.topology == topo:
            return model
    if topo.calibration.source == "nccl_tests":
        config_file = config_path("topology", topology_name, config_root)
        model, _ = calibrated_model(topo, config_file=config_file, holdout=False)
        return model
    return NetworkModel(topo)


def collective_main(topology_name: str, op: str, gpus: int, nbytes: int, *,
                    network_json: str | Path | None = None, config_root: Path | None = None,
                    nccl_algo: str | None = None, nccl_proto: str | None = None) -> dict:
    """One collective on ranks 0..gpus-1 (priced by ``model_for``), as a JSON-able dict.

    Ranks fill nodes in order, so N <= ranks_per_node GPUs share one node and N = k x
    ranks_per_node span k whole nodes (other N leave the last node partly used; ranks_per_node
    is the topology's gpus_per_node unless it says otherwise). ``nccl_algo`` / ``nccl_proto``:
    as NCCL_ALGO / NCCL_PROTO (e.g. "Ring", "Simple"), instead of the topology's ``nccl:``
    settings; None keeps those."""
    if gpus < 1 or nbytes < 0:
        raise ValueError(f"collective: need --gpus >= 1 and --bytes >= 0, got {gpus} and {nbytes}")
    model = model_for(topology_name, network_json, config_root)
    if nccl_algo is not None or nccl_proto is not None:
        p = model.params
        model = model.forcing(p.nccl_algo if nccl_algo is None else nccl_algo,
                              p.nccl_proto if nccl_proto is None else nccl_proto)
    est = model.estimate(op, gpus=gpus, nbytes=nbytes)
    shape = model.shape(gpus=gpus)
    return {"topology": topology_name, "op": op, "gpus": gpus, "nodes": shape.nodes, "bytes": nbytes,
            "time_us": est.time_us, "algbw_GBps": est.algbw_GBps, "busbw_GBps": est.busbw_GBps,
            "algorithm": est.algorithm, "protocol": est.protocol, "source": model.source,
            "nccl_algo": model.params.nccl_algo or None, "nccl_proto": model.params.nccl_proto or None}
