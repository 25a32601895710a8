"""``python -m echo.network.summary TOPOLOGY...``: what the nccl-tests fit of each topology says.

Per topology (``calibration.source: nccl_tests``): the fitted figures that matter (each GPU's NIC
bandwidth against the NICs' line rate, NVLink bandwidth, NVLink SHARP's latency, each protocol's
base, NVLink-step and network-step latency), then per log the mean / max absolute time error from
1 MiB (``fit.run_accuracy``) on the fit itself, on the leave-one-out refits and on the
leave-one-node-count-out refits (fit on 2 nodes, predict 4, and the other way round). ``--cross
A B``: fit A alone and predict B's logs (two clusters of one kind at other node counts), both ways.
``--markdown`` prints the tables as Markdown.
"""

from __future__ import annotations

import argparse
import sys

from echo.config import config_path, load_topology
from echo.network.calibrate import calibrated_model, read_topology_logs
from echo.network.costs import NetworkParams
from echo.network.fit import fit_nccl_tests, run_accuracy, runs_from_measurements

_CHECKS = (("fit", "accuracy"), ("leave-one-out", "leave_one_out"), ("leave-node-count-out", "leave_node_count_out"))


def figures(topology_name: str, params: NetworkParams) -> dict:
    """The fitted figures of one topology, with the NIC line rate per GPU to compare against."""
    topo = load_topology(topology_name)
    line = topo.inter_node.nic_Gbps * topo.inter_node.nics_per_node / 8 / topo.gpus_per_node
    return {"topology": topology_name, "nic_GBps": params.nic_bw_GBps, "nic_line_GBps": line,
            "intra_GBps": params.intra_bw_GBps, "nvls_latency_us": params.nvls_latency_us if params.nvls else None,
            "launch_us": params.launch_us, "fill_MB": params.fill_bytes / 1e6, "fill_slowdown": params.fill_slowdown,
            "protocols": {n: {k: p[k] for k in ("base_us", "intra_hop_us", "inter_hop_us", "bw_fraction")}
                          for n, p in params.protocols.items()}}


def topology_summary(topology_name: str) -> dict:
    """Figures and per-log errors (fit, leave-one-out, leave-one-node-count-out) of one topology."""
    topo = load_topology(topology_name)
    model, _ = calibrated_model(topo, config_file=config_path("topology", topology_name))
    rows = []
    for check, key in _CHECKS:
        for a in model.fit.get(key, []):
            rows.append({"check": check, **a})
    return {**figures(topology_name, model.params), "rows": rows}


def cross(fit_name: str, predict_name: str) -> list[dict]:
    """Fit ``fit_name``'s logs alone and predict ``predict_name``'s (a cross-cluster extrapolation)."""
    fit_topo, other = load_topology(fit_name), load_topology(predict_name)
    base = NetworkParams.from_topology(fit_topo)
    params, _ = fit_nccl_tests(base, runs_from_measurements(
        read_topology_logs(fit_topo, config_file=config_path("topology", fit_name))))
    held = runs_from_measurements(read_topology_logs(other, config_file=config_path("topology", predict_name)))
    return [{"check": f"fit {fit_name}, predict", **run_accuracy(params, r)} for r in held]


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown(summary: dict) -> str:
    f = summary
    protos = "; ".join(f"{n}: base {p['base_us']:.1f}, NVLink step {p['intra_hop_us']:.2f}, network step "
                       f"{p['inter_hop_us']:.1f} us, bw x{p['bw_fraction']:.2f}" for n, p in f["protocols"].items())
    nvls = f", NVLS latency {f['nvls_latency_us']:.1f} us" if f["nvls_latency_us"] is not None else ""
    lines = [f"**{f['topology']}**: NIC {f['nic_GBps']:.1f} GB/s per GPU (line rate {f['nic_line_GBps']:.0f}), "
             f"NVLink {f['intra_GBps']:.0f} GB/s{nvls}, pipeline fill {f['fill_MB']:.2f} MB at 1/{f['fill_slowdown']:.2f}; "
             f"{protos}", "",
             "| check | log | GPUs | nodes | forced | points | mean abs err >= 1 MiB | max (size) | chosen |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in f["rows"]:
        lines.append(_row(r))
    return "\n".join(lines)


def _row(r: dict) -> str:
    forced = ", ".join(v for v in (r.get("nccl_algo"), r.get("nccl_proto")) if v) or "-"
    worst = f"{_pct(r.get('max_abs_err'))} ({r.get('worst_bytes', 0) >> 20} MiB)" if "max_abs_err" in r else "-"
    return (f"| {r['check']} | {r['source'].split('/')[-1]} | {r['gpus']} | {r['nodes']} | {forced} | {r['points']} | "
            f"{_pct(r.get('mean_abs_err'))} | {worst} | {', '.join(r['chosen'])} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("topologies", nargs="*")
    parser.add_argument("--cross", nargs=2, metavar=("A", "B"), action="append", default=[],
                        help="fit A's logs alone and predict B's, and B's to predict A's")
    args = parser.parse_args(argv)
    for name in args.topologies:
        print(markdown(topology_summary(name)))
        print()
    for a, b in args.cross:
        print("| check | log | GPUs | nodes | forced | points | mean abs err >= 1 MiB | max (size) | chosen |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in cross(a, b) + cross(b, a):
            print(_row(r))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
