"""NVLink domains larger than a server (GB200 / GB300 NVL72): NVLink SHARP's latency does not
grow with the GPUs, rings inside the domain pay NVLink steps; the XLA collective table's rows
(GB200's validation rows and GB300's of the one declared fit, B200's and H100's compared only);
jobs that use 64 of a rack's 72 GPUs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from echo.config import load_topology
from echo.config.loader import CONFIG_ROOT
from echo.errors import ConfigError
from echo.network import NetworkModel, xla_table
from echo.network.costs import Shape, candidates

GIB, KIB = 1 << 30, 1 << 10


@pytest.fixture(scope="module")
def gb200() -> NetworkModel:
    return NetworkModel(load_topology("gb200-nvl72"))


def test_nvls_latency_is_the_switchs_whatever_the_gpus(gb200):
    nvls = {n: next(c for c in candidates(gb200.params, "all_reduce", Shape(n, 1, n)) if c.algorithm == "nvls")
            for n in (2, 4, 8, 16, 32, 64, 72)}
    # the same on 2 GPUs as on 72: the switch's (fitted, 54 us at writing)
    assert {c.latency_us for c in nvls.values()} == {gb200.params.nvls_latency_us}
    small = {n: gb200.estimate("all_reduce", gpus=n, nbytes=8 * KIB) for n in (32, 64, 72)}
    assert {e.algorithm for e in small.values()} == {"nvls"}
    assert 40 <= small[72].time_us <= 70   # XLA's GB200 table: 51-57 us; before this fix 426 us
    # a ring inside the domain pays 142 NVLink steps (0.37 us simple, 1.1 us LL), not network hops
    ring = gb200.forcing("Ring", None).estimate("all_reduce", gpus=72, nbytes=8 * KIB)
    assert ring.algorithm == "ring" and 90 <= ring.time_us <= 180
    assert ring.time_us < NetworkModel(load_topology("dgx-h100-ndr")).forcing("Ring", None).estimate(
        "all_reduce", gpus=72, nbytes=8 * KIB).time_us  # 9 H100 servers: 16 of its 142 steps cross nodes


def test_small_groups_of_the_rack_still_run_rings(gb200):
    """A ring's few steps beat NVLS's fixed cost on 4 GPUs, as NCCL's tuner has it."""
    est = gb200.estimate("all_reduce", gpus=4, nbytes=8 * KIB)
    assert est.algorithm == "ring" and est.time_us < 25


@pytest.fixture(scope="module")
def xla(reference) -> dict:
    """Summary rows of the comparison per (GPU key, op, GPUs)."""
    rows = [r for r in xla_table.read_table(reference / xla_table.TABLE) if r.gpus in (4, 8, 64, 72)]
    return {(s["key"], s["op"], s["gpus"]): s
            for s in xla_table.summarize(xla_table.compare(rows, xla_table._default_model))}


@pytest.mark.parametrize("key", ["sm_100_GB200", "sm_103"])
def test_nvl72_rows_against_xla(xla, key):
    """72- and 64-GPU rows (GB200's 72 and all of GB300 are validation rows of the declared fit;
    GB200's 64 a fit row). Before the fix all-reduce was +115..+137% slow from 1 MiB and +530..+630%
    below 64 KiB. At writing: all-reduce 13-16% from 1 MiB and 12-18% below 64 KiB,
    all-gather / reduce-scatter 5-9%, all-to-all 19-23%."""
    for gpus in (64, 72):
        ar = xla[(key, "all_reduce", gpus)]
        assert ar["algorithms"] == ["nvls/simple"]
        assert ar["large_mean_abs"] <= 0.20 and ar["small_mean_abs"] <= 0.25
        for op, bound in (("all_gather", 0.12), ("reduce_scatter", 0.12), ("all_to_all", 0.27)):
            assert xla[(key, op, gpus)]["large_mean_abs"] <= bound, (op, gpus)


@pytest.mark.slow
def test_the_nvl72_figures_are_the_declared_fits(reference):
    """The figures gb200-nvl72.yaml states are what `python -m echo.network.xla_table --fit`
    gives today (minutes: a refit), and its validation rows stay within their bounds."""
    params, summary = xla_table.fit_split(xla_table.read_table(reference / xla_table.TABLE))
    shipped = NetworkModel(load_topology("gb200-nvl72")).params
    assert params.nvls_latency_us == pytest.approx(shipped.nvls_latency_us, rel=0.01)
    assert params.intra_bw_GBps == pytest.approx(shipped.intra_bw_GBps, rel=0.01)
    for name, proto in params.protocols.items():
        for k in ("base_us", "intra_hop_us", "bw_fraction"):
            assert proto[k] == pytest.approx(shipped.protocols[name][k], rel=0.01), (name, k)
    val = {(a["key"], a["op"], a["gpus"]): a["mean_abs_err"] for a in summary["validation"]}
    assert max(v for (k, op, n), v in val.items() if op != "all_to_all") <= 0.20
    assert max(v for (k, op, n), v in val.items() if op == "all_to_all") <= 0.30


@pytest.mark.parametrize("key", ["sm_90", "sm_100_B200"])
def test_eight_gpu_nodes_against_xla(xla, key):
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert xla[(key, op, 8)]["large_mean_abs"] <= 0.40, op


# --- placement: jobs that use part of each rack ---------------------------------------------

def test_whole_racks_or_a_partial_fill():
    full, part = load_topology("gb200-nvl72"), load_topology("gb200-nvl72-64")
    assert (full.node_ranks, part.node_ranks) == (72, 64)
    for n in (8, 64, 72, 144, 216):
        assert full.placement_problem(n) is None
    key, reason = full.placement_problem(128)
    assert key == "gpus_per_node" and "128 is above 72 and not a multiple" in reason and "ranks_per_node" in reason
    for n in (8, 32, 64, 128, 256, 512):  # the Megatron-Bridge GB200/GB300 rows: 8 .. 256 GPUs
        assert part.placement_problem(n) is None
    key, reason = part.placement_problem(72)
    assert key == "ranks_per_node" and "64 of each node's 72 GPUs" in reason


def test_partial_racks_in_the_network_model():
    model = NetworkModel(load_topology("gb200-nvl72-64"))
    assert model.shape(gpus=128) == model.shape(group=range(128)) and model.shape(gpus=128).nodes == 2
    assert model.shape(group=range(64, 128)).nodes == 1   # an EP-64 group stays in one rack
    assert model.shape(group=range(60, 68)).nodes == 2
    assert model.params.nic_bw_GBps == pytest.approx(50.0)  # one 400 Gb/s NIC per GPU; idle GPUs' NICs idle
    inside = model.estimate("all_to_all", list(range(64, 128)), nbytes=GIB)
    across = model.estimate("all_to_all", list(range(32, 96)), nbytes=GIB)
    assert inside.time_us < across.time_us


@pytest.mark.parametrize("name", ["gb200-nvl72", "gb300-nvl72"])
def test_partial_rack_files_match_their_racks(name):
    base = yaml.safe_load((CONFIG_ROOT / "topologies" / f"{name}.yaml").read_text())
    part = yaml.safe_load((CONFIG_ROOT / "topologies" / f"{name}-64.yaml").read_text())
    assert part.pop("ranks_per_node") == 64
    for d in (base, part):
        d.pop("description")
    assert part == base


def test_more_ranks_per_node_than_gpus_is_refused(config_root: Path):
    path = config_root / "topologies" / "gb200-nvl72-64.yaml"
    path.write_text(path.read_text().replace("ranks_per_node: 64", "ranks_per_node: 80"))
    with pytest.raises(ConfigError, match="gb200-nvl72-64.yaml: .*ranks_per_node 80 is more than the node's "
                                          "gpus_per_node 72"):
        load_topology("gb200-nvl72-64", root=config_root)


def test_all_to_all_latency_is_rounds_of_concurrent_peers(reference, gb200):
    """An all-to-all serves its peers at once, up to P2P_PEERS_AT_ONCE, then in rounds: its
    small-message floor in XLA's GB200 table is about flat to 18 GPUs and steps up at 32-36 and
    64-72 (11-12, 20-21, 54-64 us). n-1 NVLink steps in a row had 20 / 31 / 49 / 86 us for 8 / 18 / 36
    / 72 GPUs, above the measured 12 / 12 / 20 / 66. Held-out group sizes of the declared fit (18,
    36, 72) and every GB300 size: at writing the median floor error is 2-45% (GB300 at 4 GPUs the worst, -45%) and
    the old model's was 26-157%."""
    rows = [r for r in xla_table.read_table(reference / xla_table.TABLE)
            if r.op == "all_to_all" and r.bytes <= 64 * KIB and r.key in ("sm_100_GB200", "sm_103")]
    worst = {}
    for r in rows:
        if r.key == "sm_100_GB200" and r.gpus not in (18, 36, 72):
            continue  # fit rows
        est = gb200.estimate("all_to_all", gpus=r.gpus, nbytes=r.bytes).time_us
        worst.setdefault((r.key, r.gpus), []).append(est / r.time_us - 1)
    medians = {k: float(np.median(v)) for k, v in worst.items()}
    assert max(abs(v) for v in medians.values()) <= 0.5, medians
    # rounds: one up to 17 peers, then (n-1)/16
    lat = {n: gb200.estimate("all_to_all", gpus=n, nbytes=8).time_us for n in (8, 16, 17, 33, 72)}
    assert lat[8] == pytest.approx(lat[16]) == pytest.approx(lat[17])
    assert lat[33] == pytest.approx(2 * lat[8], rel=0.02) and lat[72] == pytest.approx(71 / 16 * lat[8], rel=0.02)
