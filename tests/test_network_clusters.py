"""Topologies fitted to the reference folder's H100 and A100 clusters (nccl-tests/ logs of
NVIDIA/nccl-tests issue 309, DGX Cloud, OCI): the reader takes the logs as shared (shortened
device listings, NCCL's version line, a forced NCCL_ALGO), each cluster's fit reproduces its
logs, the leave-one-node-count-out check, and forced algorithms in the model and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from echo.config import load_topology
from echo.errors import ConfigError
from echo.network import NetworkModel, collective_main
from echo.network.calibrate import calibrated_model, read_topology_logs
from echo.network.costs import NetworkParams, Shape, candidates
from echo.network.fit import runs_from_measurements
from echo.network.nccl_tests import LogFormatError, read_runs

GIB, MIB = 1 << 30, 1 << 20
CLUSTERS = ("h100-ndr-cluster-a", "h100-dell-xe9680", "h100-vm-cluster", "dgx-h100-1node", "oci-a100")

_HEADER = "# nThread 1 nGpus 1 minBytes 1048576 maxBytes 2097152 step: 2(factor) warmup iters: 5 iters: 20 validation: 1\n"
_TABLE = """#
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
     1048576        262144     float     sum      -1    93.25   11.24   21.08      0    82.98   12.64   23.69      0
     2097152        524288     float     sum      -1    94.22   22.26   41.73      0    93.52   22.42   42.05      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 32.0
"""


def _log(tmp_path, devices: str, banner: str = "", name: str = "all_reduce_perf_16gpus.log"):
    path = tmp_path / name
    path.write_text(banner + _HEADER + "#\n# Using devices\n" + devices + "NCCL version 2.26.2+cuda12.8\n" + _TABLE)
    return path


def _dev(rank: int, host: str, device: int) -> str:
    return f"#  Rank {rank:2d} Group  0 Pid  100 on {host} device  {device} [0000:1b:00] NVIDIA H100 80GB HBM3\n"


# --- the reader ---------------------------------------------------------------------------

def test_shortened_device_listing_is_filled_in_blocks(tmp_path):
    devices = _dev(0, "a", 0) + "#  [... ranks 1-14 abbreviated ...]\n" + _dev(15, "b", 7)
    (run,) = read_runs(_log(tmp_path, devices))
    assert run.ranks == 16 and run.hosts == ["a", "b"] and run.gpus_per_node == 8
    assert [d.rank for d in run.devices] == list(range(16))
    named = "#  [... ranks 1-14 abbreviated: 4 per host on a, b, c, d ...]\n"
    (run,) = read_runs(_log(tmp_path, _dev(0, "a", 0) + named + _dev(15, "d", 3)))
    assert run.hosts == ["a", "b", "c", "d"] and run.per_host == {h: 4 for h in "abcd"}
    (run,) = read_runs(_log(tmp_path, _dev(0, "a", 0) + "#  [... ranks 1-14 abbreviated ...]\n" + _dev(15, "d", 3)))
    assert run.hosts == ["a", "<abbreviated host 1>", "<abbreviated host 2>", "d"]


@pytest.mark.parametrize("devices, reason", [
    (_dev(0, "a", 0) + "#  [... ranks 1-13 abbreviated ...]\n" + _dev(15, "b", 7), "do not make 0..14"),
    (_dev(0, "a", 0) + "#  [... ranks 1-14 abbreviated ...]\n" + _dev(15, "a", 7), "one host holds ranks of two blocks"),
    (_dev(0, "a", 0) + "#  [... ranks 1-14 abbreviated ...]\n" + _dev(15, "b", 4), "do not fill hosts of 5 GPUs"),
    (_dev(0, "a", 0) + "#  [... ranks 1-14 abbreviated: 8 per host on a, b, c ...]\n" + _dev(15, "b", 7),
     "names 3 hosts for 16 ranks"),
])
def test_a_shortened_listing_that_contradicts_itself_is_refused(tmp_path, devices, reason):
    with pytest.raises(LogFormatError, match=reason):
        read_runs(_log(tmp_path, devices))


def test_forced_algorithm_is_read_from_the_command_or_ncclinfo(tmp_path):
    devices = _dev(0, "a", 0) + "#  [... ranks 1-14 abbreviated ...]\n" + _dev(15, "b", 7)
    banner = "# COMMAND: mpirun -np 16 -x NCCL_ALGO=Ring -x NCCL_PROTO=Simple ./build/all_reduce_perf -b 1M\n"
    (run,) = read_runs(_log(tmp_path, devices, banner))
    assert run.env == {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
    rows = run.table().to_pylist()
    assert {(r["nccl_algo"], r["nccl_proto"]) for r in rows} == {("Ring", "Simple")}
    info = "host:1:1 [0] NCCL INFO NCCL_ALGO set by environment to Tree\n"
    path = tmp_path / "all_reduce_perf_x.log"
    text = _log(tmp_path, devices).read_text().replace("NCCL version", info + "NCCL version")
    path.write_text(text)
    (run,) = read_runs(path)
    assert run.env == {"NCCL_ALGO": "Tree"}
    (run,) = read_runs(_log(tmp_path, devices))  # NCCL's own choice
    assert run.env == {} and {r["nccl_algo"] for r in run.table().to_pylist()} == {None}


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_cluster_log_reads(name, reference):
    topo = load_topology(name)
    measured = read_topology_logs(topo, root=reference)
    assert set(measured["source"].to_pylist()) == set(topo.calibration.logs)
    assert set(measured["gpus_per_node"].to_pylist()) == {8}


# --- the fits -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster_a(reference) -> NetworkModel:
    """The 2- and 4-node H100 cluster with its Ring-forced log, fitted with every holdout check."""
    return calibrated_model(load_topology("h100-ndr-cluster-a"), root=reference)[0]


def _errors(model: NetworkModel, key: str = "accuracy") -> dict[tuple[int, str], dict]:
    return {(a["gpus"], a["nccl_algo"]): a for a in model.fit.get(key, [])}


@pytest.mark.parametrize("name, bound, nic", [
    ("h100-dell-xe9680", 0.04, (42, 51)),   # 2.1% at writing; NIC at its 50 GB/s prior (see the report)
    ("h100-vm-cluster", 0.08, (42, 51)),    # 5.9% at writing, NIC 46.6 GB/s
    ("dgx-h100-1node", 0.06, None),         # 4.5% at writing (NVLink tier only)
    ("oci-a100", 0.02, (20, 25)),           # 0.1% at writing: 3 sizes, NIC 23.9 GB/s (200 Gb/s line rate)
])
def test_single_log_clusters_reproduce_their_logs(name, bound, nic, reference):
    model, _ = calibrated_model(load_topology(name), root=reference)
    for a in model.fit["accuracy"]:
        assert a["mean_abs_err"] <= bound, a
    if nic is not None:
        assert nic[0] <= model.params.nic_bw_GBps <= nic[1]  # an NDR 400 Gb/s NIC: 46-49 GB/s (NCCL's maintainers)
    assert model.fit["leave_one_out"] == [] and model.fit["leave_node_count_out"] == []


def test_dgx_h100_node_runs_nvls_for_large_messages(reference):
    model, _ = calibrated_model(load_topology("dgx-h100-1node"), root=reference)
    est = model.estimate("all_reduce", gpus=8, nbytes=8 * GIB)
    assert est.algorithm == "nvls" and 440 <= est.busbw_GBps <= 500  # the log: 480 GB/s
    assert model.params.intra_bw_GBps <= 450 * 1.0001  # never above the NVLink4 wire rate


def test_cluster_a_fits_its_logs_and_the_forced_ring(cluster_a):
    own = _errors(cluster_a)
    assert set(own) == {(16, ""), (16, "Ring"), (32, "")}
    for a in own.values():
        assert a["mean_abs_err"] <= 0.15, a  # 11.4 / 13.9 / 4.1% (8 starts; the logs disagree, see the report)
    assert own[(16, "Ring")]["chosen"] == ["ring/simple"]  # the forced run is priced with rings only
    assert "nvls_tree/simple" in own[(16, "")]["chosen"]   # NCCL's default on 2 H100 nodes: NVLS-tree
    assert 40 <= cluster_a.params.nic_bw_GBps <= 50


def test_cluster_a_leave_one_node_count_out(cluster_a):
    """Fit on 2 nodes and predict 4, and the other way round (errors reported, not targets met:
    about 12% predicting 2 nodes from 4, 26% predicting 4 from 2 at writing)."""
    held = cluster_a.fit["leave_node_count_out"]
    assert {(a["held_nodes"], tuple(a["fit_nodes"])) for a in held} == {(2, (4,)), (4, (2,))}
    assert all(a["points"] >= 14 and a["mean_abs_err"] < 0.5 for a in held)
    default_2 = next(a for a in held if a["nodes"] == 2 and not a["nccl_algo"])
    assert default_2["mean_abs_err"] <= 0.20


def test_nvls_tree_doubles_the_network_share_on_two_nodes():
    params = NetworkParams.from_topology(load_topology("dgx-h100-ndr"))
    two, four = (next(c for c in candidates(params, "all_reduce", Shape(8 * m, m, 8)) if c.algorithm == "nvls_tree")
                 for m in (2, 4))
    assert two.nic_traffic == pytest.approx(1 / 8) and four.nic_traffic == pytest.approx(2 / 8)
    assert not [c for c in candidates(params, "all_reduce", Shape(4, 4, 1)) if c.algorithm.startswith("nvls")]


# --- forced algorithms ----------------------------------------------------------------------

def test_forcing_keeps_only_the_named_candidates():
    params = NetworkParams.from_topology(load_topology("dgx-h100-ndr"))
    shape = Shape(16, 2, 8)
    algos = lambda p: {c.algorithm for c in candidates(p, "all_reduce", shape)}  # noqa: E731
    assert algos(params) == {"ring", "tree", "nvls_tree"}
    assert algos(params.forcing("Ring", None)) == {"ring"}
    assert algos(params.forcing("^NVLSTree,tree", None)) == {"ring"}
    assert {c.protocol for c in candidates(params.forcing(None, "Simple"), "all_reduce", shape)} == {"simple"}
    # all-to-all and send/recv are NCCL's peer-to-peer transfers: NCCL_ALGO leaves them be
    assert candidates(params.forcing("Tree", None), "all_to_all", shape)
    with pytest.raises(ValueError, match="NCCL_ALGO=Tree excludes all of ring/LL"):
        candidates(params.forcing("Tree", None), "all_gather", shape)
    with pytest.raises(ValueError, match="unknown name"):
        params.forcing("Rings", None)


def test_topology_nccl_section_and_cli(tmp_path, config_root):
    path = config_root / "topologies" / "dgx-h100-ndr.yaml"
    path.write_text(path.read_text() + "nccl: {algo: Ring, proto: Simple}\n")
    topo = load_topology("dgx-h100-ndr", root=config_root)
    est = NetworkModel(topo).estimate("all_reduce", gpus=16, nbytes=GIB)
    assert (est.algorithm, est.protocol) == ("ring", "simple")
    path.write_text(path.read_text().replace("algo: Ring", "algo: Rung"))
    with pytest.raises(ConfigError, match=r"dgx-h100-ndr.yaml: nccl.algo: .*unknown name\(s\) rung"):
        load_topology("dgx-h100-ndr", root=config_root)
    default = collective_main("dgx-h100-ndr", "all_reduce", 16, GIB)
    ring = collective_main("dgx-h100-ndr", "all_reduce", 16, GIB, nccl_algo="Ring")
    assert default["algorithm"] == "nvls_tree" and ring["algorithm"] == "ring" and ring["nccl_algo"] == "Ring"
    proc = subprocess.run([sys.executable, "-m", "echo", "collective", "--topology", "dgx-h100-ndr", "--op", "all_reduce",
                           "--gpus", "16", "--bytes", "1GiB", "--nccl-algo", "Ring", "--nccl-proto", "Simple",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["algorithm"], out["protocol"], out["nccl_algo"], out["nccl_proto"]) == ("ring", "simple", "Ring", "Simple")


def test_forced_ring_predictions_follow_the_forced_log(cluster_a, reference):
    """The forced-Ring log against the model priced as NCCL_ALGO=Ring (what `echo collective
    --nccl-algo Ring` answers): large messages within 21% (+17..+20% since the fit's 8 starts find
    the lower-cost minimum, +11..+18% with 6: the run reaches 392 GB/s bus bandwidth,
    NCCL_MIN_CTAS=24 and 2 QPs per connection lifting its NICs to 49 GB/s, above the NVLink rate
    the default runs' NVLS-tree fits, which caps a ring in the model)."""
    runs = runs_from_measurements(read_topology_logs(load_topology("h100-ndr-cluster-a"), root=reference))
    ring = next(r for r in runs if r.nccl_algo == "Ring")
    forced = cluster_a.forcing("Ring", None)
    predicted = forced.time_us("all_reduce", gpus=16, nbytes=ring.bytes)
    big = ring.bytes >= 256 * MIB
    assert np.all(np.abs(predicted[big] / ring.time_us[big] - 1) < 0.21)
    assert forced.estimate("all_reduce", gpus=16, nbytes=GIB).algorithm == "ring"
