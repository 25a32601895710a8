"""Fit the model's intra-node latency (alpha) and bandwidth (beta) to measured collective times.

Each measurement (op, gpus, bytes, time_us) of a group inside one node is explained as
``steps(op, n) * alpha + traffic(op, n) * bytes / beta``, the same ring/chain schedule the
model uses (``echo.network.costs``), so the fitted figures predict other sizes and group sizes.
The fit is least squares on log time (relative error: times span orders of magnitude) with a
soft-L1 loss, so that a few samples spoiled by scheduler stalls do not drag the line.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
from scipy.optimize import least_squares

from echo.network.costs import NetworkParams, ring_steps, ring_traffic

_GBPS_TO_BYTES_PER_US = 1e3
_LOSS_SCALE = 0.1  # residuals (log time) beyond ~10% count linearly, not quadratically
# recv is the other end of the transfer a send measures
_MIRRORS = {"send": "recv", "recv": "send"}


def _design(ops: list[str], gpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per measurement: algorithm steps (multiplies alpha) and traffic factor (multiplies bytes)."""
    steps = np.array([ring_steps(op, int(n))[0] for op, n in zip(ops, gpus, strict=True)], dtype=float)
    traffic = np.array([ring_traffic(op, int(n)) for op, n in zip(ops, gpus, strict=True)])
    return steps, traffic


def fit_alpha_beta(ops: list[str], gpus, nbytes, time_us, guess: tuple[float, float]) -> dict:
    """Least-squares (alpha us per step, beta GB/s) for measurements of one or more ops."""
    gpus, nbytes, time_us = (np.asarray(a, dtype=float) for a in (gpus, nbytes, time_us))
    steps, traffic = _design(ops, gpus)
    work = traffic * nbytes / _GBPS_TO_BYTES_PER_US  # us at 1 GB/s

    def model(x: np.ndarray) -> np.ndarray:
        return steps * np.exp(x[0]) + work / np.exp(x[1])

    start = np.log(np.maximum(np.asarray(guess, dtype=float), 1e-9))
    res = least_squares(lambda x: np.log(model(x)) - np.log(time_us), start,
                        loss="soft_l1", f_scale=_LOSS_SCALE)
    rel = np.abs(model(res.x) - time_us) / time_us
    return {"latency_us": float(np.exp(res.x[0])), "bandwidth_GBps": float(np.exp(res.x[1])),
            "points": int(time_us.size), "median_rel_err": float(np.median(rel)),
            "max_rel_err": float(rel.max())}


def fit_params(base: NetworkParams, measured: pa.Table) -> tuple[NetworkParams, dict]:
    """Fitted parameters from single-node measurements (op, gpus, bytes, time_us), and a summary.

    All measurements together set the intra-node alpha/beta every op falls back to; each
    measured op also gets its own pair. The benchmark has one protocol, so the fitted model
    has one too (no LL alternative, one hop per step: alpha already is the whole step)."""
    cols = measured.to_pydict()
    ops = cols["op"]
    guess = (base.intra_lat_us, base.intra_bw_GBps)
    joint = fit_alpha_beta(ops, cols["gpus"], cols["bytes"], cols["time_us"], guess)
    per_op: dict[str, dict] = {}
    for op in sorted(set(ops)):
        idx = [i for i, o in enumerate(ops) if o == op]
        per_op[op] = fit_alpha_beta([op] * len(idx), *([cols[c][i] for i in idx]
                                                      for c in ("gpus", "bytes", "time_us")), guess)
    links = {op: {"latency_us": f["latency_us"], "bandwidth_GBps": f["bandwidth_GBps"]} for op, f in per_op.items()}
    for op, twin in _MIRRORS.items():
        if op in links and twin not in links:
            links[twin] = links[op]
    params = replace(base, intra_lat_us=joint["latency_us"], intra_bw_GBps=joint["bandwidth_GBps"],
                     ll_bw_fraction=0.0, simple_step_hops=1.0, op_links=links)
    return params, {"joint": joint, "per_op": per_op}
