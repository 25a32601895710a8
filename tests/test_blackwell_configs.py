"""The Blackwell hardware and topology files load through the project's loader, and the NVL72
topologies price a collective inside the 72-GPU NVLink domain below the same one across racks."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo.config import load_hardware, load_topology
from echo.config.loader import check_placement, config_path, parse_workload
from echo.fit import stale_fits
from echo.network.model import NetworkModel

HARDWARE = ("gb200", "b300-sxm", "gb300")
TOPOLOGIES = ("dgx-b200", "dgx-b300", "gb200-nvl72", "gb300-nvl72")
NVL72 = ("gb200-nvl72", "gb300-nvl72")
GIB = 1 << 30


@pytest.mark.parametrize("name", HARDWARE)
def test_hardware_loads_with_dense_peaks_and_transferred_compute_model(name: str) -> None:
    hw = load_hardware(name)
    p = hw.peak_tflops
    assert hw.kind == "gpu" and p.bf16 == p.fp16
    assert p.fp4 > p.fp8 == 2 * p.bf16 > p.tf32 > p.fp32  # dense: FP8 twice BF16, as on every datasheet
    assert 2000 <= p.bf16 <= 2500  # dense, not the 2:4-sparse 4500-5000
    assert hw.memory_gib >= 180 and hw.hbm_GBps == 8000
    cm = hw.compute_model
    assert cm.fitted_by is None  # nothing fitted on these GPUs yet
    assert set(cm.provenance) == set(cm.parameter_names())
    assert {v.status for v in cm.provenance.values()} == {"transferred"}
    assert all("B200 silicon" in v.basis for v in cm.provenance.values())


def test_blackwell_ultra_has_more_fp4_than_blackwell() -> None:
    gb200, b300, gb300 = (load_hardware(n).peak_tflops for n in HARDWARE)
    b200 = load_hardware("b200-sxm").peak_tflops
    assert b300.fp4 / b200.fp4 == pytest.approx(105 / 72)  # HGX B300 vs HGX B200 dense FP4
    assert gb300.fp4 / gb200.fp4 == pytest.approx(1.5)     # NVL72 racks: 1,080 vs 720 PF dense


def test_no_fit_is_stale_for_the_new_hardware() -> None:
    assert not [s for s in stale_fits("0" * 12) if any(f"/{n}.yaml" in s for n in HARDWARE)]


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_topology_loads_nominal_with_nvlink_sharp(name: str) -> None:
    topo = load_topology(name)
    assert topo.calibration.source == "nominal"
    assert topo.intra_node.bandwidth_GBps == 900 and topo.intra_node.nvls
    assert topo.inter_node.nics_per_node == topo.gpus_per_node  # one NIC per GPU
    assert topo.inter_node.nic_Gbps == (800 if name in ("dgx-b300", "gb300-nvl72") else 400)
    assert topo.gpus_per_node == (72 if name in NVL72 else 8)


@pytest.mark.parametrize("name", NVL72)
def test_nvl72_collectives_are_cheaper_inside_the_nvlink_domain(name: str) -> None:
    model = NetworkModel(load_topology(name))
    # the domain is one "node" of 72 GPUs: 72 ranks share it, 144 span two
    assert (model.shape(gpus=72).nodes, model.shape(gpus=144).nodes) == (1, 2)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        # 8 GPUs of one rack against 8 GPUs in 8 racks (a data-parallel group under TP 72)
        inside = model.estimate(op, list(range(8)), nbytes=GIB)
        across = model.estimate(op, [72 * i for i in range(8)], nbytes=GIB)
        assert inside.time_us < across.time_us, op
        # a whole rack against 72 GPUs split 36 + 36 over two racks
        rack = model.estimate(op, list(range(72)), nbytes=GIB)
        split = model.estimate(op, list(range(36, 108)), nbytes=GIB)
        assert rack.time_us < split.time_us, op
    assert model.estimate("all_reduce", list(range(72)), nbytes=GIB).algorithm == "nvls"
    assert model.estimate("all_reduce", list(range(36, 108)), nbytes=GIB).algorithm != "nvls"


def test_nic_generation_shows_across_racks_and_nodes() -> None:
    def across(topo: str, stride: int) -> float:
        return NetworkModel(load_topology(topo)).estimate("all_reduce", [stride * i for i in range(8)],
                                                          nbytes=GIB).time_us

    assert across("gb300-nvl72", 72) < across("gb200-nvl72", 72)  # ConnectX-8 800 vs ConnectX-7 400 Gb/s
    assert across("dgx-b300", 8) < across("dgx-b200", 8)
    # inside a node B200's NVLink 5 beats H100's NVLink 4
    inside = {t: NetworkModel(load_topology(t)).estimate("all_reduce", gpus=8, nbytes=GIB).time_us
              for t in ("dgx-b200", "dgx-h100-ndr")}
    assert inside["dgx-b200"] < inside["dgx-h100-ndr"]


def test_a_job_of_whole_racks_is_placed_on_nvl72() -> None:
    workload = parse_workload({
        "model": {"arch": "gpt", "layers": 4, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 128},
        "parallel": {"tp": 8, "pp": 2, "dp": 9},
        "training": {"global_batch": 18, "micro_batch": 1}}, Path("inline-workload.yaml"))
    assert workload.world_size == 144
    check_placement(workload, load_topology("gb200-nvl72"), config_path("topology", "gb200-nvl72"))
