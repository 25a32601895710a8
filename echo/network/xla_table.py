"""Echo's collective model against OpenXLA's measured collective table (reference
``kernels/xla_collective_table.csv``, see its README): single NCCL collectives timed by XLA on an
8-GPU H100 node (``sm_90``), an 8-GPU B200 node (``sm_100_B200``) and inside GB200 / GB300 NVL72
racks (``sm_100_GB200``, ``sm_103``: groups of 4-72 GPUs of one 72-GPU NVLink domain).

These rows are a *comparison*, not a fit: no parameter of Echo is fitted on them. XLA's times
include its own launch work around the NCCL kernel (a few microseconds), and its ``bytes`` are the
generator's ``tensor_size_bytes`` (all-reduce: the buffer; all-gather, all-to-all: the output;
reduce-scatter: the input), which are nccl-tests' sizes too, so a row prices as
``model.estimate(op, ranks 0..n-1 of one node, nbytes=bytes)``. Several replica groups of a row
run at once on disjoint GPUs (9 groups of 8 in a rack); each group's own NVLink ports are not
shared, so the comparison prices one group.

``python -m echo.network.xla_table`` prints the error summary per GPU key, op and group size.

``--fit``: the one declared fit on these rows (``fit_split``), for the NVL72 racks, where no
nccl-tests log exists. Fit rows: GB200's (``sm_100_GB200``) groups of 4, 8, 16, 32 and 64 GPUs;
validation rows, never seen by the fit: GB200's groups of 18, 36 and 72 and every GB300 row
(``sm_103``, the same NVLink 5 switch trays). It fits the intra-node tier as the nccl-tests fit
does (``echo.network.fit``: NVLink bandwidth, pipeline fill, each protocol's base latency,
NVLink step and bandwidth share, NVLink SHARP's latency, here also its efficiency, which the
many group sizes tell apart from a ring's), with the same priors (the topology's figures), and
prints the figures as the topology file's YAML and the fit and validation errors. XLA's own launch
work is in these times, so the fitted base latencies include it.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from echo.config import load_topology
from echo.network.costs import NetworkParams, Shape
from echo.network.fit import Run, _fit_tier, _Free, _intra_free, _nvls_free, run_accuracy
from echo.network.model import NetworkModel
from echo.reference import reference_file

TABLE = "kernels/xla_collective_table.csv"
# XLA opcode -> Echo op
OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
       "all-to-all": "all_to_all"}
# XLA GPU key -> the Echo topology it is compared against
TOPOLOGIES = {"sm_90": "dgx-h100-ndr", "sm_100_B200": "dgx-b200", "sm_100_GB200": "gb200-nvl72",
              "sm_103": "gb300-nvl72"}
# the declared split of fit_split: (key, group sizes) fitted, and validated
FIT_ROWS = (("sm_100_GB200", (4, 8, 16, 32, 64)),)
VALIDATION_ROWS = (("sm_100_GB200", (18, 36, 72)), ("sm_103", (4, 8, 16, 18, 32, 36, 64, 72)))
LARGE_BYTES = 1 << 20   # bandwidth regime: messages from 1 MiB
SMALL_BYTES = 64 << 10  # latency regime: messages up to 64 KiB


@dataclass(frozen=True)
class Row:
    key: str
    op: str
    gpus: int
    groups: int
    bytes: int
    time_us: float


def read_table(path: str | Path | None = None) -> list[Row]:
    """The table's collective rows (not collective-permute; rows without a throughput dropped)."""
    path = Path(path) if path is not None else reference_file(TABLE)
    out = []
    with path.open() as f:
        for r in csv.DictReader(f):
            if r["opcode"] not in OPS or not r["time_us_derived"] or r["gpu_key"] not in TOPOLOGIES:
                continue
            out.append(Row(r["gpu_key"], OPS[r["opcode"]], int(r["num_devices_per_group"]),
                           int(r["num_replica_groups"]), int(r["transfer_bytes_derived"]),
                           float(r["time_us_derived"])))
    return out


def compare(rows: Iterable[Row], model_of: Callable[[str], NetworkModel]) -> list[dict]:
    """Per row: measured and predicted time, relative error, the chosen algorithm/protocol."""
    out = []
    models: dict[str, NetworkModel] = {}
    for row in rows:
        model = models.setdefault(row.key, model_of(row.key))
        est = model.estimate(row.op, list(range(row.gpus)), nbytes=row.bytes)
        out.append({"key": row.key, "topology": model.topology.name, "op": row.op, "gpus": row.gpus,
                    "groups": row.groups, "bytes": row.bytes, "measured_us": row.time_us,
                    "predicted_us": est.time_us, "err": (est.time_us - row.time_us) / row.time_us,
                    "algorithm": est.algorithm, "protocol": est.protocol})
    return out


def summarize(compared: list[dict]) -> list[dict]:
    """Mean |error| and mean signed error per (key, op, gpus), large and small messages apart,
    and the 8 KiB time (measured, predicted) as the latency floor."""
    groups: dict[tuple, list[dict]] = {}
    for c in compared:
        groups.setdefault((c["key"], c["op"], c["gpus"]), []).append(c)
    out = []
    for (key, op, gpus), cs in sorted(groups.items()):
        large = [c for c in cs if c["bytes"] >= LARGE_BYTES]
        small = [c for c in cs if c["bytes"] <= SMALL_BYTES]
        floor = min(small, key=lambda c: abs(np.log2(c["bytes"] / 8192))) if small else None
        out.append({
            "key": key, "op": op, "gpus": gpus,
            "large_mean_abs": float(np.mean([abs(c["err"]) for c in large])) if large else None,
            "large_mean": float(np.mean([c["err"] for c in large])) if large else None,
            "small_mean_abs": float(np.mean([abs(c["err"]) for c in small])) if small else None,
            "small_median_measured_us": float(np.median([c["measured_us"] for c in small])) if small else None,
            "small_median_predicted_us": float(np.median([c["predicted_us"] for c in small])) if small else None,
            "floor_bytes": floor["bytes"] if floor else None,
            "algorithms": sorted({f"{c['algorithm']}/{c['protocol']}" for c in cs}),
        })
    return out


def runs_of(rows: Iterable[Row], selection: Iterable[tuple[str, Iterable[int]]]) -> list[Run]:
    """The rows of ``selection`` ((key, group sizes) pairs) as fit runs, one per (key, op, GPUs)."""
    chosen = {(k, int(n)) for k, sizes in selection for n in sizes}
    points: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        if (r.key, r.gpus) in chosen:
            points.setdefault((r.key, r.op, r.gpus), []).append((r.bytes, r.time_us))
    runs = []
    for (key, op, n), pts in sorted(points.items()):
        pts.sort()
        runs.append(Run(f"xla:{key}", op, Shape(n, 1, n), np.array([b for b, _ in pts], dtype=np.float64),
                        np.array([t for _, t in pts])))
    return runs


# The fit's starting point and priors, fixed here (not read from the topology file the fit's
# figures are written into): NVLink 5 at 0.8 of 900 GB/s, and NCCL's own tuner defaults for
# Blackwell (NVIDIA/nccl src/graph/tuning.cc at 5067397): per protocol the ring's base latency, the
# NVLink ring step, the network tree step and the bandwidth share; NVLS 25 us at 0.74 of the links;
# the pipeline fill of dgx-h100-ndr (fitted on A100).
PRIORS = {
    "intra_bw_GBps": 720.0, "nvls_latency_us": 25.0, "nvls_efficiency": 0.74, "fill_bytes": 1e6, "fill_slowdown": 6.0,
    "protocols": {
        "LL": {"base_us": 6.6, "intra_hop_us": 0.6, "inter_hop_us": 5.0, "bw_fraction": 0.39, "tree_efficiency": 0.9},
        "LL128": {"base_us": 14.0, "intra_hop_us": 1.9, "inter_hop_us": 8.5, "bw_fraction": 0.92, "tree_efficiency": 0.9},
        "simple": {"base_us": 8.4, "intra_hop_us": 3.4, "inter_hop_us": 14.0, "bw_fraction": 1.0,
                   "tree_efficiency": 0.9},
    },
}


def fit_split(rows: list[Row], topology: str = "gb200-nvl72") -> tuple[NetworkParams, dict]:
    """The declared fit (module docstring): the intra-node tier of ``topology`` (its NICs and
    placement; every NVLink figure from PRIORS) fitted on FIT_ROWS; its accuracy
    (``fit.run_accuracy``) on those and on VALIDATION_ROWS."""
    base = replace(NetworkParams.from_topology(load_topology(topology)), **PRIORS)
    fit_runs = runs_of(rows, FIT_ROWS)
    free = _intra_free(base, launch=False) + _nvls_free(base) + [
        _Free("nvls_efficiency", ("nvls_efficiency",), base.nvls_efficiency, 0.2, 1.0)]
    params = _fit_tier(base, free, fit_runs)
    summary = {"fit": [run_accuracy(params, r) | {"key": r.source} for r in fit_runs],
               "validation": [run_accuracy(params, r) | {"key": r.source} for r in runs_of(rows, VALIDATION_ROWS)],
               "fitted": [f.name for f in free]}
    return params, summary


def yaml_figures(params: NetworkParams, topology: str = "gb200-nvl72") -> str:
    """The fitted figures as the topology file states them: NVLink SHARP's in ``intra_node``,
    the fitted NVLink bandwidth as ``bus_efficiency`` of the file's link rate, the protocols
    (network steps as the file has them: not fitted here) and the pipeline."""
    p, topo = params, load_topology(topology)
    protos = "\n".join(f"  {n}: {{base_us: {q['base_us']:.2f}, intra_hop_us: {q['intra_hop_us']:.3f}, "
                       f"inter_hop_us: {q['inter_hop_us']:.1f}, bw_fraction: {q['bw_fraction']:.3f}}}"
                       for n, q in p.protocols.items())
    return (f"nvls_latency_us: {p.nvls_latency_us:.1f}, nvls_efficiency: {p.nvls_efficiency:.3f}  (intra_node)\n"
            f"bus_efficiency: {p.intra_bw_GBps / topo.intra_node.bandwidth_GBps:.3f}\n"
            f"protocols:\n{protos}\npipeline: {{fill_MB: {p.fill_bytes / 1e6:.2f}, fill_slowdown: {p.fill_slowdown:.2f}}}")


def _default_model(key: str) -> NetworkModel:
    return NetworkModel(load_topology(TOPOLOGIES[key]))


def _fmt(v: float | None, pct: bool = True) -> str:
    if v is None:
        return "-"
    return f"{v * 100:+.0f}%" if pct else f"{v:.1f}"


def markdown(summary: list[dict]) -> str:
    lines = ["| key | op | GPUs | mean abs err >=1 MiB | mean err >=1 MiB | mean abs err <=64 KiB | "
             "median small measured / predicted (us) | chosen |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['key']} | {s['op']} | {s['gpus']} | {_fmt(s['large_mean_abs'])} | {_fmt(s['large_mean'])} | "
                     f"{_fmt(s['small_mean_abs'])} | {_fmt(s['small_median_measured_us'], False)} / "
                     f"{_fmt(s['small_median_predicted_us'], False)} | {', '.join(s['algorithms'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=None, help=f"default: the reference folder's {TABLE}")
    parser.add_argument("--keys", nargs="*", default=list(TOPOLOGIES), help="GPU keys to compare")
    parser.add_argument("--gpus", nargs="*", type=int, default=None, help="group sizes (default all)")
    parser.add_argument("--csv", type=Path, default=None, help="write every compared row here")
    parser.add_argument("--fit", action="store_true", help="run the declared fit (fit_split) and print its "
                        "figures and its fit and validation errors")
    args = parser.parse_args(argv)
    if args.fit:
        params, summary = fit_split(read_table(args.table))
        print(yaml_figures(params))
        for part in ("fit", "validation"):
            for a in summary[part]:
                print(f"{part:10s} {a['key']:16s} {a['op']:15s} {a['gpus']:3d} GPUs: mean |err| from 1 MiB "
                      f"{100 * a['mean_abs_err']:5.1f}%, max {100 * a['max_abs_err']:5.1f}%; 8 B-64 KiB floor "
                      f"{a['floor_measured_us']:.1f} us measured, {a['floor_predicted_us']:.1f} predicted")
        return 0
    rows = [r for r in read_table(args.table) if r.key in args.keys and (args.gpus is None or r.gpus in args.gpus)]
    compared = compare(rows, _default_model)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(compared[0]))
            w.writeheader()
            w.writerows(compared)
    print(markdown(summarize(compared)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
