"""Network model and calibrate stage: sanity targets, reference data, a real gloo fit, round trips."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from echo.artifacts import COLLECTIVES
from echo.config import load_topology
from echo.network import NetworkModel, collective_main, run_calibrate
from echo.network import calibrate as calibrate_mod
from echo.network.costs import OPS, NetworkParams, Shape, candidates
from echo.network.fit import fit_api_overheads, fit_params
from echo.network.gloo_bench import BENCH_SCHEMA, run_gloo_benchmark, sweep_sizes

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


@pytest.fixture(scope="module")
def a100() -> NetworkModel:
    return NetworkModel(load_topology("dgx-a100-hdr"))


@pytest.fixture(scope="module")
def h100() -> NetworkModel:
    return NetworkModel(load_topology("dgx-h100-ndr"))


@pytest.fixture(scope="module")
def gloo_bench() -> pa.Table:
    """One real benchmark run (a few seconds), shared by the tests that need measurements."""
    return run_gloo_benchmark(load_topology("local-gloo").calibration)


def _reference(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(size_bytes, time_us) of a reference all-reduce CSV; time from algbw where not given."""
    rows = list(csv.DictReader(path.open()))
    sizes = np.array([float(r["size_bytes"]) for r in rows])
    if "time_us" in rows[0]:
        return sizes, np.array([float(r["time_us"]) for r in rows])
    return sizes, sizes / (np.array([float(r["algbw_GBps"]) for r in rows]) * 1e3)


# --- sanity targets -----------------------------------------------------------------------

def test_a100_node_allreduce_large_busbw(a100):
    est = a100.estimate("all_reduce", gpus=8, nbytes=GIB)
    assert 200 <= est.busbw_GBps <= 240  # nccl_allreduce_a100_8gpu.csv: 229 GB/s
    assert est.algorithm == "ring" and est.protocol == "simple"


def test_small_message_latency_floor(a100, h100):
    for model in (a100, h100):
        est = model.estimate("all_reduce", gpus=8, nbytes=KIB)
        assert 10 <= est.time_us <= 100  # tens of microseconds, as measured (31-44 us)
    assert a100.estimate("all_reduce", gpus=8, nbytes=KIB).protocol == "LL"


def test_multi_node_allreduce_busbw(a100):
    est = a100.estimate("all_reduce", gpus=32, nbytes=GIB)
    assert 170 <= est.busbw_GBps <= 215  # NCCL maintainers: ~192 GB/s on DGX A100 + 8x HDR


def test_h100_nvls_large_allreduce(h100):
    for size in (GIB, 16 * GIB):
        est = h100.estimate("all_reduce", gpus=8, nbytes=size)
        assert est.algorithm == "nvls"
        assert 450 <= est.busbw_GBps <= 480  # nccl_allreduce_h200_8gpu.csv: 464-482 GB/s
    ring = [c for c in candidates(h100.params, "all_reduce", Shape(8, 1, 8)) if c.algorithm == "ring"]
    assert ring, "ring stays a candidate where NVLS exists"


@pytest.mark.parametrize("name, topology, bound, floor", [
    ("nccl_allreduce_a100_8gpu.csv", "dgx-a100-hdr", 0.12, 0.45),
    ("nccl_allreduce_h200_8gpu.csv", "dgx-h100-ndr", 0.10, 0.65),
])
def test_reference_allreduce_error(name, topology, bound, floor, reference, tmp_path):
    """The published rows' fitted networks against 8-GPU all-reduce tables they were not fitted on:
    mean absolute relative time error over 1 MiB..16 GiB (issue: at most 15%; A100 9.9%, H200
    8.6% at writing). The smallest size is the fitted cluster's latency floor, not this node's:
    dgx-a100-hdr's intra tier is fitted on Azure's 8-GPU server, dgx-h100-ndr's on the DGX Cloud
    node, and both tables' nodes are slower to start (at writing 43.8 vs 27.6 us and 40.0 vs
    17.1 us: 37% and 57% over the model), a property of the measured systems."""
    sizes, measured = _reference(reference / name)
    keep = sizes >= MIB
    assert sizes[keep].max() == 16 * GIB
    run_calibrate(load_topology(topology), tmp_path)
    model = NetworkModel.load(tmp_path / "network.json")
    assert model.source == "fitted"
    predicted = model.time_us("all_reduce", gpus=8, nbytes=sizes)
    rel = np.abs(predicted - measured) / measured
    assert rel[keep].mean() < bound
    assert predicted[0] < measured[0] and rel[0] < floor


def test_dgx_a100_four_nodes_allreduce_1gib(a100):
    est = a100.estimate("all_reduce", gpus=32, nbytes=GIB)
    assert est.algorithm == "ring" and est.protocol == "simple"
    assert 170 <= est.busbw_GBps <= 215  # NCCL's maintainers measure about 192


def test_all_to_all_across_nodes_gets_about_one_nic_per_peer(a100):
    """Each GPU's remote share of an all-to-all goes through its own NIC (HDR: 25 GB/s)."""
    nic = a100.params.nic_bw_GBps
    assert nic == pytest.approx(25.0)
    for group in (list(range(16)), list(range(64)), [0, 8, 16, 24], list(range(0, 128, 8))):
        n, per_node = len(group), a100.shape(group).per_node
        est = a100.estimate("all_to_all", group, nbytes=GIB)
        remote_GBps = (n - per_node) / n * GIB / (est.time_us * 1e3)
        assert 0.85 * nic <= remote_GBps <= nic, group
    # inside one node all-to-all is far faster than through the NICs
    assert a100.estimate("all_to_all", gpus=8, nbytes=GIB).time_us < 0.2 * a100.estimate(
        "all_to_all", list(range(16)), nbytes=GIB).time_us


def test_protocols_follow_message_size(a100):
    """LL for tiny messages, LL128 in between, simple for the largest (A100 NVLink has LL128)."""
    protocols = [a100.estimate("all_reduce", gpus=8, nbytes=s).protocol for s in (KIB, 4 * MIB, 4 * GIB)]
    assert protocols == ["LL", "LL128", "simple"]
    no_ll128 = NetworkModel(load_topology("dgx-a100-hdr").model_copy(
        update={"intra_node": load_topology("dgx-a100-hdr").intra_node.model_copy(update={"ll128": False})}))
    assert "LL128" not in {c.protocol for c in candidates(no_ll128.params, "all_reduce", Shape(8, 1, 8))}


def test_tree_latency_grows_with_log_of_nodes(a100):
    """Small multi-node all-reduces run as trees: 16x the nodes costs far less than 16x the time."""
    t = {m: a100.estimate("all_reduce", gpus=8 * m, nbytes=8 * KIB) for m in (2, 32)}
    assert t[2].algorithm == t[32].algorithm == "tree"
    assert t[32].time_us < 3 * t[2].time_us


# --- conventions and structure ------------------------------------------------------------

def test_bandwidth_conventions(a100):
    n, size = 8, 256 * MIB
    for op, factor in [("all_reduce", 2 * (n - 1) / n), ("all_gather", (n - 1) / n),
                       ("reduce_scatter", (n - 1) / n), ("all_to_all", (n - 1) / n),
                       ("broadcast", 1.0), ("reduce", 1.0)]:
        est = a100.estimate(op, gpus=n, nbytes=size)
        assert est.algbw_GBps == pytest.approx(size / est.time_us / 1e3)
        assert est.busbw_GBps == pytest.approx(est.algbw_GBps * factor)
    send = a100.estimate("send", [0, 1], nbytes=size)
    assert send.algorithm == "p2p" and send.busbw_GBps == pytest.approx(send.algbw_GBps)


def test_trivial_groups_cost_nothing(a100):
    assert a100.estimate("all_reduce", [5], nbytes=GIB).time_us == 0.0
    assert a100.estimate("all_reduce", gpus=8, nbytes=0).time_us == 0.0


def test_placement_shapes(a100):
    assert a100.shape([8, 9, 10, 11]) == Shape(4, 1, 4)
    assert a100.shape([0, 8, 16, 24]) == Shape(4, 4, 1)
    assert a100.shape(gpus=20) == Shape(20, 3, 4)
    assert a100.estimate("all_reduce", list(range(8, 16)), nbytes=MIB) == a100.estimate(
        "all_reduce", gpus=8, nbytes=MIB)
    # the same four ranks spread over four nodes share NICs, not NVLink: slower
    inside = a100.estimate("all_reduce", [0, 1, 2, 3], nbytes=GIB)
    across = a100.estimate("all_reduce", [0, 8, 16, 24], nbytes=GIB)
    assert across.time_us > 2 * inside.time_us
    assert a100.estimate("send", [0, 8], nbytes=GIB).time_us > a100.estimate("send", [0, 1], nbytes=GIB).time_us


def test_tuner_picks_the_fastest_candidate(a100):
    shape = Shape(128, 16, 8)
    for size in (64 * KIB, 16 * GIB):
        est = a100.estimate("all_reduce", gpus=128, nbytes=size)
        times = {(c.algorithm, c.protocol): c.time_us(size) for c in candidates(a100.params, "all_reduce", shape)}
        assert est.time_us == pytest.approx(min(times.values()))
        assert times[(est.algorithm, est.protocol)] == pytest.approx(est.time_us)
    assert a100.estimate("all_reduce", gpus=128, nbytes=64 * KIB).algorithm == "tree"  # log(nodes) latency
    assert a100.estimate("all_reduce", gpus=128, nbytes=16 * GIB).algorithm == "ring"  # less traffic


def test_time_grows_with_size_and_vectorises(a100):
    sizes = np.array([KIB << i for i in range(25)])
    for op in OPS:
        times = a100.time_us(op, gpus=2 if op in ("send", "recv") else 16, nbytes=sizes)
        assert np.all(np.diff(times) >= 0), op
        assert times[-1] == pytest.approx(
            a100.estimate(op, gpus=2 if op in ("send", "recv") else 16, nbytes=int(sizes[-1])).time_us)


def test_estimates_are_cached(a100):
    before = a100._cached.cache_info().hits
    first = a100.estimate("reduce_scatter", gpus=64, nbytes=3 * MIB)
    assert a100.estimate("reduce_scatter", list(range(64)), nbytes=3 * MIB) is first
    assert a100._cached.cache_info().hits == before + 1


def test_bad_queries_are_refused(a100):
    with pytest.raises(ValueError, match="unknown collective"):
        a100.estimate("allreduce", gpus=8, nbytes=1)
    with pytest.raises(ValueError, match="exactly one"):
        a100.estimate("all_reduce", [0, 1], gpus=2, nbytes=1)


# --- persistence and the stage ------------------------------------------------------------

def test_save_load_round_trip(tmp_path, a100):
    topo = load_topology("local-gloo")
    fitted = replace(NetworkParams.from_topology(topo).with_protocols(simple={"intra_hop_us": 123.0}),
                     launch_us=4.0, op_links={"send": {"latency_us": 90.0, "bandwidth_GBps": 3.5}})
    for model in (a100, NetworkModel(topo, fitted, "fitted", {"note": [1, 2]})):
        model.save(tmp_path / "network.json")
        loaded = NetworkModel.load(tmp_path / "network.json")
        assert loaded.topology == model.topology and loaded.params == model.params
        assert loaded.source == model.source and loaded.fit == model.fit
        for op in ("all_reduce", "send"):
            assert loaded.estimate(op, gpus=2, nbytes=MIB) == model.estimate(op, gpus=2, nbytes=MIB)
    assert json.loads((tmp_path / "network.json").read_text())["source"] == "fitted"


def test_calibrate_nominal(tmp_path):
    run_calibrate(load_topology("dgx-b200"), tmp_path)  # no log of a DGX B200: nominal figures
    table = pq.read_table(tmp_path / "collectives.parquet")
    assert set(COLLECTIVES.names) <= set(table.column_names)
    rows = table.to_pylist()
    assert {r["op"] for r in rows} == set(OPS)
    assert {r["source"] for r in rows} == {"model"} and all(r["measured_time_us"] is None for r in rows)
    assert {(r["gpus"], r["nodes"]) for r in rows if r["op"] == "all_gather"} >= {(2, 1), (8, 1), (128, 16), (16, 16)}
    assert min(r["bytes"] for r in rows) == KIB and max(r["bytes"] for r in rows) == 16 * GIB
    nvls = [r for r in rows if r["op"] == "all_reduce" and r["gpus"] == 8 and r["nodes"] == 1 and r["bytes"] == GIB]
    assert nvls[0]["algorithm"] == "nvls"
    assert NetworkModel.load(tmp_path / "network.json").source == "nominal"


def test_collective_main(tmp_path):
    path = tmp_path / "network.json"
    out = collective_main("dgx-b200", "all_reduce", 16, GIB, network_json=path)  # not calibrated: nominal
    assert out["source"] == "nominal" and out["nodes"] == 2 and out["bytes"] == GIB
    assert json.loads(json.dumps(out)) == out
    topo = load_topology("local-gloo")
    params = NetworkParams.from_topology(topo)
    NetworkModel(topo, params.with_protocols(simple={"intra_hop_us": 1.0}), "fitted").save(path)
    assert collective_main("local-gloo", "all_reduce", 2, KIB, network_json=path)["source"] == "fitted"
    stale = topo.model_copy(update={"gpus_per_node": 32})
    NetworkModel(stale, params, "fitted").save(path)
    assert collective_main("local-gloo", "all_reduce", 2, KIB, network_json=path)["source"] == "nominal"


# --- the real gloo benchmark and the fit --------------------------------------------------

@pytest.mark.slow
def test_gloo_benchmark_table(gloo_bench):
    cal = load_topology("local-gloo").calibration
    assert gloo_bench.schema == BENCH_SCHEMA
    rows = gloo_bench.to_pylist()
    sizes = sweep_sizes(cal.min_bytes, cal.max_bytes, cal.ranks)
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "send",
                                       "functional:all_reduce", "functional:all_gather"}
    assert sorted({r["bytes"] for r in rows}) == sizes
    assert all(r["time_us"] > 0 for r in rows)
    big = {r["op"]: r["time_us"] for r in rows if r["bytes"] == sizes[-1]}
    small = {r["op"]: r["time_us"] for r in rows if r["bytes"] == sizes[0]}
    assert all(big[op] > small[op] for op in big)  # 4096x the bytes is not free, even on loopback


def _held_out_errors(bench: pa.Table) -> np.ndarray:
    """Fit on the even-indexed sizes of ``bench``'s plain ops; relative errors on the odd-indexed ones."""
    topo = load_topology("local-gloo")
    bench = bench.filter(pc.invert(pc.starts_with(bench["op"], "functional:")))
    sizes = sorted(set(bench["bytes"].to_pylist()))
    is_train = pc.is_in(bench["bytes"], value_set=pa.array(sizes[::2], pa.int64()))
    params, summary = fit_params(NetworkParams.from_topology(topo), bench.filter(is_train))
    model = NetworkModel(topo, params, "fitted", summary)
    errors = []
    for row in bench.filter(pc.invert(is_train)).to_pylist():
        predicted = model.estimate(row["op"], gpus=row["gpus"], nbytes=row["bytes"]).time_us
        errors.append(abs(predicted - row["time_us"]) / row["time_us"])
    assert len(errors) == 4 * (len(sizes) // 2)
    return np.array(errors)


def test_api_overheads_fit_the_extra_over_plain_calls():
    sizes = [4096 * 2**i for i in range(8)]
    plain = [50.0 + n / 2e3 for n in sizes]                  # 2 GB/s
    functional = [t + 80.0 + n / 8e3 for t, n in zip(plain, sizes, strict=True)]  # + 80 us + a copy at 8 GB/s
    bench = pa.table({"op": ["all_reduce"] * 8 + ["functional:all_reduce"] * 8, "gpus": [2] * 16,
                      "bytes": sizes * 2, "time_us": plain + functional}, schema=BENCH_SCHEMA)
    overheads, summary = fit_api_overheads(bench)
    got = overheads["functional"]["all_reduce"]
    assert got["latency_us"] == pytest.approx(80.0) and got["bandwidth_GBps"] == pytest.approx(8.0)
    assert summary["functional:all_reduce"]["points"] == 8
    params = replace(NetworkParams.from_topology(load_topology("local-gloo")), api_overheads=overheads)
    assert params.api_overhead_us("functional", "all_reduce", 8000) == pytest.approx(81.0)
    assert params.api_overhead_us("functional", "all_gather", 8000) == 0.0  # not measured: no extra
    assert NetworkParams.from_dict(params.to_dict()) == params  # kept in network.json


def _close(errors: np.ndarray) -> bool:
    # issue 5: predict the held-out half within 15% (mean absolute error), no point wildly off
    return errors.mean() < 0.15 and errors.max() < 0.6


@pytest.mark.slow
def test_gloo_fit_predicts_held_out_sizes(gloo_bench):
    """Fit on even-indexed sizes, predict the odd ones (typically 5-10% mean error here).

    These are real measurements on a machine other jobs may share: a process saturating a
    core for the few seconds of the run inflates many samples at once, so one re-measurement
    is allowed before judging; the bound itself is not loosened."""
    errors = _held_out_errors(gloo_bench)
    if not _close(errors):
        errors = _held_out_errors(run_gloo_benchmark(load_topology("local-gloo").calibration))
    assert _close(errors), f"held-out relative errors {np.round(errors, 2)}"


def test_calibrate_gloo_fits_and_records_measurements(tmp_path, monkeypatch, gloo_bench):
    monkeypatch.setattr(calibrate_mod, "run_gloo_benchmark", lambda cal, priority="none": gloo_bench)
    run_calibrate(load_topology("local-gloo"), tmp_path)
    model = NetworkModel.load(tmp_path / "network.json")
    assert model.source == "fitted" and model.params.op_links["all_reduce"]["bandwidth_GBps"] > 0
    # DTensor's functional all-reduce copies its input and runs Python on the calling thread: it
    # costs tens of microseconds more than a plain one here (70-170 us on the development machine).
    # The measured extra is the claim; how the fit splits it into latency and per-byte time moves
    # with the machine's load (a busy neighbour once gave latency 0 and all of it per byte)
    extra = model.params.api_overheads["functional"]["all_reduce"]
    assert model.fit["api_overheads"]["functional:all_reduce"]["median_extra_us"] > 10.0, model.fit["api_overheads"]
    assert model.params.api_overhead_us("functional", "all_reduce", 1 << 20) > max(10.0, extra["latency_us"])
    assert model.params.api_overhead_us("c10d", "all_reduce", 1 << 20) == 0.0
    table = pq.read_table(tmp_path / "collectives.parquet").to_pylist()
    assert {r["source"] for r in table} == {"fitted"}
    measured = [r for r in table if r["measured_time_us"] is not None]
    assert {r["op"] for r in measured} == {"all_reduce", "all_gather", "reduce_scatter", "send", "recv"}
    assert all(r["gpus"] == 2 and r["nodes"] == 1 for r in measured)
    rel = [abs(r["time_us"] - r["measured_time_us"]) / r["measured_time_us"] for r in measured]
    assert np.median(rel) < 0.25
