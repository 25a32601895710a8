"""Fit the network model's parameters to measured collective times.

Two kinds of measurements:

- ``fit_params``: a local gloo benchmark (op, gpus, bytes, time_us) of groups inside one node.
  Each time is ``steps(op, n) * alpha + traffic(op, n) * bytes / beta``, the ring/chain schedule
  of ``echo.network.costs``; one (alpha, beta) for all ops plus one per measured op.
- ``fit_nccl_tests``: nccl-tests logs (``echo.network.nccl_tests``), fitted per tier, as NCCL's
  own tuning model is built: first the *intra-server* tier from the runs on one server (NVLink
  bandwidth, each protocol's base latency, NVLink hop latency and share of the bandwidth, the
  chunk pipeline's fill), then, with those fixed, the *inter-server* tier from the multi-server
  runs (each GPU's NIC bandwidth, each protocol's network hop latency). Other node counts are then
  predicted by the model's formulas (ring steps grow with the GPUs, tree depth with log2 of the
  servers), never by interpolating between logs.

  The measuring harness is modelled too: nccl-tests queues its timed iterations back to back, so
  a run where one thread drives N GPUs (``nGpus N`` in the header: the usual single-server
  ``-g 8``) is never faster than N kernel launches (``launch_us`` each). Its small messages show
  that launch rate, not NVLink hops, so the two are told apart only by multi-process runs: the
  inter-server stage refits the launch cost and the NVLink hop latencies with all runs. Jobs with
  one process per GPU (what is simulated) never see this floor, and predictions leave it out.

Both fits are least squares on log time (relative error: times span five orders of magnitude)
with a soft-L1 loss, so that a few samples spoiled by stalls do not drag the fit. The nccl-tests
fit adds a weak prior that pulls each parameter towards its nominal value (the topology's figures
and NCCL's protocol constants): a parameter the logs barely constrain (a protocol the tuner hardly
picks on this machine) stays plausible instead of wandering off, while one they constrain moves
freely (the prior costs about as much as a 10% miss on a few sizes when a parameter moves
tenfold). Each of a few starting points is fitted with the minimum over candidates softened (a
smooth objective with wide basins), then sharpened to the exact minimum; the best fit is kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
from scipy.optimize import least_squares

from echo.network.costs import (
    OPS,
    NetworkParams,
    Shape,
    candidate_times,
    candidates,
    predict,
    ring_steps,
    ring_traffic,
)

_GBPS_TO_BYTES_PER_US = 1e3
_LOSS_SCALE = 0.1  # gloo: residuals (log time) beyond ~10% count linearly, not quadratically
# recv is the other end of the transfer a send measures
_MIRRORS = {"send": "recv", "recv": "send"}


# --- gloo benchmark ------------------------------------------------------------------------

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
    """Fitted parameters from single-node gloo measurements (op, gpus, bytes, time_us), and a summary.

    All measurements together set the intra-node alpha/beta every op falls back to; each
    measured op also gets its own pair. The benchmark has one protocol, so the fitted model
    has one too (no LL alternative, no base latency: alpha already is the whole step)."""
    cols = measured.to_pydict()
    ops = cols["op"]
    simple = base.protocols.get("simple") or next(iter(base.protocols.values()))
    guess = (simple["intra_hop_us"] or 1.0, base.intra_bw_GBps)
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
    protocols = {"simple": {"base_us": 0.0, "intra_hop_us": joint["latency_us"],
                            "inter_hop_us": simple["inter_hop_us"], "bw_fraction": 1.0,
                            "tree_efficiency": simple["tree_efficiency"]}}
    params = replace(base, intra_bw_GBps=joint["bandwidth_GBps"], protocols=protocols, op_links=links,
                     fill_bytes=0.0, fill_slowdown=1.0, nvls=False)
    return params, {"joint": joint, "per_op": per_op}


def fit_api_overheads(measured: pa.Table, prefix: str = "functional:") -> tuple[dict, dict]:
    """What ops called through an API cost on top of plain ones: from a gloo benchmark holding
    both (``prefix + op`` rows next to ``op`` rows of the same sizes), per op a least-squares line
    extra(bytes) = latency + bytes / bandwidth through (time through the API - plain time).
    Returns ({api: {op: {"latency_us", "bandwidth_GBps"}}}, per-op summary)."""
    rows = measured.to_pylist()
    plain = {(r["op"], r["bytes"]): r["time_us"] for r in rows if not r["op"].startswith(prefix)}
    api = prefix.rstrip(":")
    out: dict[str, dict[str, dict[str, float]]] = {}
    summary: dict[str, dict] = {}
    for op in sorted({r["op"].removeprefix(prefix) for r in rows if r["op"].startswith(prefix)}):
        pairs = [(r["bytes"], r["time_us"] - plain[(op, r["bytes"])]) for r in rows
                 if r["op"] == prefix + op and (op, r["bytes"]) in plain]
        if len(pairs) < 2:
            continue
        x, extra = (np.array(v, dtype=float) for v in zip(*pairs, strict=True))
        (latency, per_byte), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), extra, rcond=None)
        latency, per_byte = max(float(latency), 0.0), max(float(per_byte), 1e-12)  # never faster than plain
        out.setdefault(api, {})[op] = {"latency_us": latency, "bandwidth_GBps": 1.0 / (per_byte * _GBPS_TO_BYTES_PER_US)}
        summary[prefix + op] = {**out[api][op], "points": len(pairs), "median_extra_us": float(np.median(extra))}
    return out, summary


# --- nccl-tests logs -----------------------------------------------------------------------

NCCL_LOSS_SCALE = 0.05   # residuals (log time) beyond ~5% count linearly
PRIOR_WEIGHT = 0.1       # weight of log(parameter / nominal) against the data residuals
_STARTS = 8              # multi-start: the nominal point and perturbed ones (6 left cluster-a's fit machine-dependent)
_TAUS = (0.1, 0.03, 0.0)  # soft-minimum temperatures (log time) of the successive fits of one start
# nominal base latency of each protocol (launch and setup; NCCL's tuner has 4-10 us)
_BASE_PRIOR_US = {"LL": 5.0, "LL128": 10.0, "simple": 10.0}
_FILL_PRIOR = (4e6, 2.0)  # a few MB of pipeline fill at half speed
_LAUNCH_PRIOR_US = 4.0    # CPU time to launch one GPU's kernel of a collective (NCCL enqueue + CUDA launch)
# the most of a link a protocol can carry: LL sends 4 data bytes in every 8-byte line (the rest
# is its flag), LL128 120 in every 128
_BW_FRACTION_MAX = {"LL": 0.5, "LL128": 120 / 128}
_INTRA_BW_MAX = 1.25      # NVLS nodes: fitted NVLink bandwidth at most 1 / bus_efficiency (0.8) of the nominal


@dataclass(frozen=True)
class Run:
    """One measured curve: an op on a placement shape, times by size (in-place/out-of-place averaged)."""

    source: str
    op: str
    shape: Shape
    bytes: np.ndarray
    time_us: np.ndarray
    gpus_per_thread: int = 1   # serial launches in the measuring harness (see NetworkParams.launch_us)
    nccl_algo: str = ""        # NCCL_ALGO / NCCL_PROTO the run forced ("": NCCL's own choice)
    nccl_proto: str = ""

    @property
    def label(self) -> str:
        forced = "".join(f", {k}={v}" for k, v in (("NCCL_ALGO", self.nccl_algo), ("NCCL_PROTO", self.nccl_proto)) if v)
        return f"{self.op} {self.shape.gpus} GPUs ({self.shape.nodes} node{'s' if self.shape.nodes > 1 else ''}{forced})"

    def params(self, params: NetworkParams) -> NetworkParams:
        """``params`` as this run's NCCL ran: with its forced algorithm/protocol, or NCCL's own choice."""
        if (params.nccl_algo, params.nccl_proto) == (self.nccl_algo, self.nccl_proto):
            return params
        return params.forcing(self.nccl_algo, self.nccl_proto)


# nccl-tests collectives the model has, as (echo op, shape) of the measured transfer
def _model_op(op: str) -> str | None:
    if op in OPS:
        return op
    return "send" if op == "sendrecv" else None


def runs_from_measurements(table: pa.Table) -> list[Run]:
    """Group MEASUREMENTS rows into runs the model can predict (unsupported collectives dropped)."""
    rows: dict[tuple, dict[int, list[float]]] = {}
    cols = table.select(["source", "op", "gpus", "nodes", "gpus_per_node", "gpus_per_thread", "bytes",
                         "time_us"]).to_pydict()
    n = table.num_rows
    forced = [table[c].to_pylist() if c in table.column_names else [None] * n for c in ("nccl_algo", "nccl_proto")]
    for src, op, gpus, nodes, per_node, per_thread, nbytes, t, algo, proto in zip(*cols.values(), *forced, strict=True):
        model_op = _model_op(op)
        if model_op is None or gpus < 2:
            continue
        if model_op == "send":  # a ring shift: the slowest pair crosses nodes when there are several
            shape = Shape(2, 2 if nodes > 1 else 1, 1 if nodes > 1 else 2)
        else:
            shape = Shape(gpus, nodes, per_node)
        key = (src, model_op, shape, per_thread or 1, algo or "", proto or "")
        rows.setdefault(key, {}).setdefault(nbytes, []).append(t)
    runs = []
    for (src, op, shape, per_thread, algo, proto), by_size in rows.items():
        sizes = np.array(sorted(by_size), dtype=np.float64)
        times = np.array([float(np.mean(by_size[int(b)])) for b in sizes])
        runs.append(Run(src, op, shape, sizes, times, per_thread, algo, proto))
    return sorted(runs, key=lambda r: (r.shape.nodes, r.shape.gpus, r.op, r.source))


@dataclass(frozen=True)
class _Free:
    """One fitted parameter: where it lives in NetworkParams, its prior (nominal) value and bounds."""

    name: str
    path: tuple[str, ...]  # ("intra_bw_GBps",) or ("protocols", "LL", "base_us")
    prior: float
    lo: float
    hi: float

    def get(self, params: NetworkParams) -> float:
        if self.path[0] == "protocols":
            return params.protocols[self.path[1]][self.path[2]]
        return getattr(params, self.path[0])


def _intra_free(base: NetworkParams, launch: bool) -> list[_Free]:
    """The intra-server tier: NVLink bandwidth, the pipeline fill, and per protocol its base
    latency, NVLink hop latency and (LL, LL128) share of the bandwidth; with ``launch``, the
    harness's serial launch cost (logs where one thread drove several GPUs)."""
    bw = base.intra_bw_GBps
    # where NVLS runs, at most the links' wire rate (nominal figures derate it by bus_efficiency,
    # 0.8): a fit that needs more is explaining an NVLS curve with a ring
    free = [_Free("intra_bw_GBps", ("intra_bw_GBps",), bw, bw / 10, bw * (_INTRA_BW_MAX if base.nvls else 10.0)),
            _Free("fill_bytes", ("fill_bytes",), _FILL_PRIOR[0], 1e4, 1e9),
            _Free("fill_slowdown", ("fill_slowdown",), _FILL_PRIOR[1], 1.0, 50.0)]
    if launch:
        free.append(_Free("launch_us", ("launch_us",), _LAUNCH_PRIOR_US, 0.01, 50.0))
    for name, proto in base.protocols.items():
        free.append(_Free(f"{name}.base_us", ("protocols", name, "base_us"), _BASE_PRIOR_US[name], 0.05, 500.0))
        free.append(_Free(f"{name}.intra_hop_us", ("protocols", name, "intra_hop_us"),
                          max(proto["intra_hop_us"], 0.1), 0.01, 100.0))
        if name != "simple":
            free.append(_Free(f"{name}.bw_fraction", ("protocols", name, "bw_fraction"), proto["bw_fraction"], 0.01,
                              _BW_FRACTION_MAX[name]))
    return free


def _nvls_free(base: NetworkParams) -> list[_Free]:
    """NVLink SHARP's fixed latency. (Its share of the links stays NCCL's figure for the switch
    generation: one GPU count cannot tell an NVLS curve from a ring's at another NVLink rate.)"""
    return [_Free("nvls_latency_us", ("nvls_latency_us",), base.nvls_latency_us, 1.0, 200.0)]


def _latency_free(base: NetworkParams) -> list[_Free]:
    """Per protocol its base latency and NVLink hop latency (the intra tier's latencies)."""
    free = []
    for name, proto in base.protocols.items():
        free.append(_Free(f"{name}.base_us", ("protocols", name, "base_us"), _BASE_PRIOR_US[name], 0.05, 500.0))
        free.append(_Free(f"{name}.intra_hop_us", ("protocols", name, "intra_hop_us"),
                          max(proto["intra_hop_us"], 0.1), 0.01, 100.0))
    return free


def _inter_free(base: NetworkParams) -> list[_Free]:
    """The inter-server tier: each GPU's share of the NICs, and per protocol its network hop
    latency. (The tree's efficiency stays NCCL's: logs of a few node counts cannot tell a tree's
    bandwidth from a ring's, since NCCL runs large messages as rings.)"""
    nic = base.nic_bw_GBps
    free = [_Free("nic_bw_GBps", ("nic_bw_GBps",), nic, nic / 20, nic * 5)]
    for name, proto in base.protocols.items():
        free.append(_Free(f"{name}.inter_hop_us", ("protocols", name, "inter_hop_us"),
                          max(proto["inter_hop_us"], 0.1), 0.01, 200.0))
    return free


def _apply(base: NetworkParams, free: list[_Free], x: np.ndarray) -> NetworkParams:
    """``base`` with the free parameters at exp(``x``), made in one copy (the fits call this for every
    residual evaluation, so not one copy per parameter)."""
    top: dict[str, float] = {}
    protocols: dict[str, dict[str, float]] = {}
    for f, v in zip(free, np.exp(x), strict=True):
        if f.path[0] == "protocols":
            protocols.setdefault(f.path[1], {})[f.path[2]] = float(v)
        else:
            top[f.path[0]] = float(v)
    if protocols:
        top["protocols"] = {name: {**p, **protocols.get(name, {})} for name, p in base.protocols.items()}
    return replace(base, **top) if top else base


def launch_floor_us(params: NetworkParams, run: Run) -> float:
    """The measuring harness's floor: nccl-tests queues its timed iterations back to back, so an
    iteration takes at least the CPU time one thread needs to launch it on all its GPUs."""
    return run.gpus_per_thread * params.launch_us


def run_prediction(params: NetworkParams, run: Run) -> tuple[np.ndarray, list]:
    """The model's times for ``run``'s sizes as its harness measured them, and the chosen candidates."""
    predicted, chosen = predict(run.params(params), run.op, run.shape, run.bytes)
    return np.maximum(predicted, launch_floor_us(params, run)), chosen


def _smooth_log_times(params: NetworkParams, run: Run, tau: float) -> np.ndarray:
    """log time of ``run``'s sizes, the minimum over candidates (and the maximum with the launch
    floor) softened to a log-sum-exp of temperature ``tau`` (in log time; 0 = exact, as predicted)."""
    if tau <= 0:
        return np.log(run_prediction(params, run)[0])
    logt = np.log(candidate_times(candidates(run.params(params), run.op, run.shape), run.bytes))
    low = logt.min(axis=0)
    soft = low - tau * np.log(np.exp(-(logt - low) / tau).sum(axis=0))
    floor = launch_floor_us(params, run)
    if floor <= 0:
        return soft
    return tau * np.logaddexp(soft / tau, np.log(floor) / tau)


def _log_residuals(params: NetworkParams, runs: Iterable[Run], tau: float) -> np.ndarray:
    out = []
    for run in runs:
        res = _smooth_log_times(params, run, tau) - np.log(run.time_us)
        out.append(res)
    return np.concatenate(out)


def _fit_tier(base: NetworkParams, free: list[_Free], runs: list[Run]) -> NetworkParams:
    """Best MAP fit of the ``free`` parameters of ``base`` to ``runs`` over a few starting points.

    Each start is fitted with the minimum over candidates softened (a smooth objective whose
    basins are wide), then sharpened to the exact minimum the model uses."""
    lo = np.log([f.lo for f in free])
    hi = np.log([f.hi for f in free])
    prior = np.log([f.prior for f in free])
    # start from the nominal values (base latencies: nominal topologies have none, so their prior)
    start = np.clip(np.log([f.prior if f.name.endswith("base_us") else max(f.get(base), f.lo) for f in free]),
                    lo + 1e-9, hi - 1e-9)

    def residuals(x: np.ndarray, tau: float) -> np.ndarray:
        return np.concatenate([_log_residuals(_apply(base, free, x), runs, tau), PRIOR_WEIGHT * (x - prior)])

    rng = np.random.default_rng(0)  # deterministic: the same logs give the same fit
    best = None
    for attempt in range(_STARTS):
        x = start if attempt == 0 else np.clip(start + rng.normal(0.0, 0.7, start.size), lo + 1e-9, hi - 1e-9)
        for tau in _TAUS:
            res = least_squares(residuals, x, bounds=(lo, hi), loss="soft_l1", f_scale=NCCL_LOSS_SCALE, args=(tau,))
            x = np.clip(res.x, lo + 1e-9, hi - 1e-9)
        if best is None or res.cost < best.cost:
            best = res
    return _apply(base, free, best.x)


def run_accuracy(params: NetworkParams, run: Run, from_bytes: int = 1 << 20, small_bytes: int = 64 << 10) -> dict:
    """How well ``params`` reproduce one run: mean/max absolute relative time error over sizes from
    ``from_bytes`` (and the worst size), and the small-message latency floor (the fastest measured
    time up to ``small_bytes``, where launch and hops dominate) against the prediction there."""
    predicted, chosen = run_prediction(params, run)
    rel = (predicted - run.time_us) / run.time_us
    keep = run.bytes >= from_bytes
    small = np.flatnonzero(run.bytes <= small_bytes)
    out = {"source": run.source, "op": run.op, "gpus": run.shape.gpus, "nodes": run.shape.nodes,
           "nccl_algo": run.nccl_algo, "nccl_proto": run.nccl_proto, "points": int(keep.sum())}
    if keep.any():
        worst = int(np.argmax(np.where(keep, np.abs(rel), -1.0)))
        out.update(mean_abs_err=float(np.abs(rel[keep]).mean()), max_abs_err=float(abs(rel[worst])),
                   worst_bytes=int(run.bytes[worst]))
    if small.size:
        i = small[np.argmin(run.time_us[small])]
        out.update(floor_bytes=int(run.bytes[i]), floor_measured_us=float(run.time_us[i]),
                   floor_predicted_us=float(predicted[i]),
                   floor_err=float((predicted[i] - run.time_us[i]) / run.time_us[i]))
    out["chosen"] = sorted({f"{c.algorithm}/{c.protocol}" for c in chosen})
    return out


def fit_nccl_tests(base: NetworkParams, runs: list[Run]) -> tuple[NetworkParams, dict]:
    """Per-tier fit of ``base`` (nominal parameters) to nccl-tests ``runs``; and a summary of it."""
    if not runs:
        raise ValueError("nccl-tests fit: no measurements of a collective the model has")
    intra = [r for r in runs if r.shape.nodes == 1]
    inter = [r for r in runs if r.shape.nodes > 1]
    params = base
    tiers = {}
    nvls = base.nvls and any(r.op == "all_reduce" and r.shape.per_node >= 2 for r in runs)
    if intra:
        free = _intra_free(params, launch=any(r.gpus_per_thread > 1 for r in intra))
        if nvls and any(r.op == "all_reduce" for r in intra):
            free += _nvls_free(params)
        params = _fit_tier(params, free, intra)
        tiers["intra"] = {"runs": [r.label for r in intra], "fitted": [f.name for f in free]}
    if inter:
        free = _inter_free(params)
        stage_runs = inter
        if intra and params.launch_us > 0:
            # one thread drove all GPUs of the single-server logs: their small messages show
            # the launch rate, not the NVLink hops, which only multi-process runs reveal.
            # Refit both with all runs.
            free += [_Free("launch_us", ("launch_us",), params.launch_us, 0.01, 50.0)]
            free += [_Free(f"{n}.intra_hop_us", ("protocols", n, "intra_hop_us"), p["intra_hop_us"], 0.01, 100.0)
                     for n, p in params.protocols.items()]
            stage_runs = runs
        if not intra:
            # no single-server log: the multi-server logs are all there is to tell each protocol's
            # fixed and per-step costs, and (where NVLS runs inside the servers) the NVLink rate
            free += _latency_free(params) + (_nvls_free(params) if nvls else [])
            if nvls:
                bw = params.intra_bw_GBps
                free.append(_Free("intra_bw_GBps", ("intra_bw_GBps",), bw, bw / 10, bw * _INTRA_BW_MAX))
        params = _fit_tier(params, free, stage_runs)
        tiers["inter"] = {"runs": [r.label for r in inter], "fitted": [f.name for f in free]}
    summary = {"tiers": tiers, "accuracy": [run_accuracy(params, r) for r in runs]}
    return params, summary


def leave_one_out(base: NetworkParams, runs: list[Run], held: Run) -> dict:
    """Refit without ``held`` and predict it: the accuracy of an extrapolation to its node count."""
    rest = [r for r in runs if r is not held]
    params, _ = fit_nccl_tests(base, rest)
    return run_accuracy(params, held)


def leave_node_count_out(base: NetworkParams, runs: list[Run]) -> list[dict]:
    """For each node count of the multi-node runs (when there are two or more): refit without
    every run of that node count and predict them, an extrapolation to a node count the fit never
    saw (2 servers from 4 and 4 from 2). Each entry is ``run_accuracy`` plus ``fit_nodes``."""
    counts = sorted({r.shape.nodes for r in runs if r.shape.nodes > 1})
    if len(counts) < 2:
        return []
    out = []
    for nodes in counts:
        rest = [r for r in runs if r.shape.nodes != nodes]
        params, _ = fit_nccl_tests(base, rest)
        fit_nodes = sorted({r.shape.nodes for r in rest})
        out += [{**run_accuracy(params, held), "held_nodes": nodes, "fit_nodes": fit_nodes}
                for held in runs if held.shape.nodes == nodes]
    return out
