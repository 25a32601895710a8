"""Published layer and job measurements against the kernel model, and the fit's machinery (echo.fit).

- the GEMM model's drop for badly shaped GEMMs (its calibration: tests/test_kernel_model.py);
- Korthikanti et al. 2022 Table 4 (one 22B GPT layer, TP8, DGX A100): each row traced by Echo and
  costed with the A100 file's kernel model, fitted on per-kernel tables only: within 10%;
- the fit report, and the fit each hardware file names (none stale).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import edit_yaml

from echo import fit
from echo.config import load_hardware, load_topology
from echo.errors import ConfigError
from echo.fit import compute as cal
from echo.network import NetworkModel
from echo.profile import roofline
from echo.profile.kernel import Kernel
from echo.workflow import paths
from echo.workflow.versions import code_version

GPUS = sorted(fit.FITTED_PARAMETERS)


# --- reference figures -----------------------------------------------------------------------
def test_copied_figures_match_the_reference_files(reference):
    assert cal.check_reference(reference) == []


# --- GEMM shape sweep ---------------------------------------------------------------------------
def gemm_tflops(hw, m: int, n: int, k: int, batch: int = 1) -> float:
    """Modelled throughput of one (batched) bf16 GEMM, TFLOP/s."""
    a, b = ([m, k], [k, n]) if batch == 1 else ([batch, m, k], [batch, k, n])
    name = "aten.mm.default" if batch == 1 else "aten.bmm.default"
    args = json.dumps({"args": [{"T": a, "dt": "bfloat16"}, {"T": b, "dt": "bfloat16"}], "kwargs": {}})
    kern = Kernel(f"{name}|{args}", name, "gemm", "compute", json.dumps([a, b]), "bfloat16",
                  2.0 * m * n * k * batch, 2.0 * (m * k + k * n + m * n) * batch, args)
    return kern.flops / roofline.estimate(hw, kern).duration_us / 1e6


# --- GEMM shape sweep (modelled) ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a100-sxm-80gb", "h100-sxm-80gb", "b200-sxm"])
def test_gemm_shape_sweep_shows_the_expected_drop(name):
    """Throughput against shape: small M or K starve the GPU, odd sizes waste tiles and waves."""
    hw = load_hardware(name)
    best = gemm_tflops(hw, 16384, 16384, 16384)
    m_sweep = [gemm_tflops(hw, m, 8192, 8192) for m in (16, 64, 256, 1024, 4096, 16384)]
    k_sweep = [gemm_tflops(hw, 8192, 8192, k) for k in (32, 128, 512, 4096, 16384)]
    assert m_sweep == sorted(m_sweep) and k_sweep == sorted(k_sweep)  # more work per launch never hurts
    assert m_sweep[0] < 0.1 * best            # M=16: a GEMV-like shape is bandwidth-bound
    assert m_sweep[-1] > 0.95 * best          # a large square-ish GEMM is near the ceiling
    assert k_sweep[0] < 0.3 * best            # K=32: tile pipeline fill is not amortised
    aligned, odd = gemm_tflops(hw, 4096, 4096, 4096), gemm_tflops(hw, 4097, 4097, 4096)
    assert odd < 0.93 * aligned               # one row/column more: a whole extra row of tiles
    assert all(t <= best * 1.02 for t in m_sweep + k_sweep + [aligned, odd])


def test_batched_attention_sized_gemms_lose_to_large_ones():
    """The unfused attention GEMMs of Table 4's layer (32 heads x 2048 x 2048 x 96): short K."""
    hw = load_hardware("a100-sxm-80gb")
    scores = gemm_tflops(hw, 2048, 2048, 96, batch=32)
    assert scores < 0.75 * gemm_tflops(hw, 8192, 2304, 6144)


# --- Korthikanti Table 4 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def layer_traces():
    """Every Table 4 row traced (1 and 2 layers, rank 0), or skipped when the tracer refuses."""
    rows = [r for r in cal.KORTHIKANTI_TABLE4 if cal.traceable(r) is None]
    if len(rows) < len(cal.KORTHIKANTI_TABLE4):
        missing = {r.experiment: cal.traceable(r) for r in cal.KORTHIKANTI_TABLE4 if r not in rows}
        print(f"not traceable yet: {missing}")
    return cal.trace_layers(rows)


@pytest.fixture(scope="module")
def network():
    return NetworkModel(load_topology(cal.KORTHIKANTI_TOPOLOGY))


def test_every_table4_row_is_traceable():
    assert {r.experiment: cal.traceable(r) for r in cal.KORTHIKANTI_TABLE4} == \
        {r.experiment: None for r in cal.KORTHIKANTI_TABLE4}


def test_each_table4_row_is_reproduced_within_10pct(layer_traces, network):
    """A validation: no parameter of the A100 file was fitted on Table 4 (all come from per-kernel
    tables, or are transferred or assumed), and every row's forward and backward land within 10%."""
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    rows = cal.evaluate(hw, layer_traces, network)
    assert {r.experiment for r in rows} == {r.experiment for r in cal.KORTHIKANTI_TABLE4}
    table = "\n".join(cal.layer_lines(rows))
    print(table)
    for r in rows:
        fwd, bwd = r.errors_pct
        assert abs(fwd) < 10 and abs(bwd) < 10, table


def test_layer_structure_matches_the_paper(layer_traces, network):
    """What the rows differ by: full recompute replays the forward (TP all-reduces included) inside
    backward; selective recompute replays only the attention core; sequence parallelism swaps each
    all-reduce for an all-gather + reduce-scatter of the same bytes."""
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    t = {lt.row.experiment: cal.layer_time(hw, lt, network) for lt in layer_traces}
    base, full = t["baseline no recompute"], t["baseline with full recompute"]
    sel, sp = t["selective recompute"], t["sequence parallelism"]
    assert full.backward_ms == pytest.approx(base.backward_ms + base.forward_ms, rel=0.02)
    assert full.backward_parts["comm:all_reduce"] == pytest.approx(2 * base.backward_parts["comm:all_reduce"])
    extra = sel.backward_ms - base.backward_ms
    assert 0.05 * base.forward_ms < extra < 0.4 * base.forward_ms
    assert sel.forward_ms == pytest.approx(base.forward_ms)
    assert "comm:all_reduce" not in sp.forward_parts
    assert sp.forward_parts["comm:all_gather"] + sp.forward_parts["comm:reduce_scatter"] == \
        pytest.approx(base.forward_parts["comm:all_reduce"], rel=0.05)


def test_layer_sum_equals_the_simulators_op_level_replay(layer_traces, network):
    """The per-layer figures are what the simulator would compute: its replay of the traced chunk
    (blocking TP collectives) gives the same forward and backward times."""
    from echo.profile.stage import distinct_kernels
    from echo.simulate.costing import CommTimer, OpContext, reduce_rank

    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    lt = next(t for t in layer_traces if t.row.experiment == "selective recompute")
    sims = {}
    for layers in (1, 2):
        ops, comms = lt.ops[layers], lt.comms[layers]
        kernels = {k.kernel_key: roofline.estimate(hw, k).duration_us for k in distinct_kernels(ops)}
        rc = reduce_rank(ops.to_pylist(), {r["comm_id"]: r for r in comms.to_pylist()},
                         OpContext(kernels, CommTimer(network)))
        sims[layers] = (rc.forward[0].cost.duration_us, rc.backward[0].cost.duration_us)
    ours = cal.layer_time(hw, lt, network)
    assert ours.forward_ms == pytest.approx((sims[2][0] - sims[1][0]) / 1e3, rel=1e-6)
    assert ours.backward_ms == pytest.approx((sims[2][1] - sims[1][1]) / 1e3, rel=1e-6)


def test_hbm_efficiency_moves_the_prediction(layer_traces, network):
    """The rows depend on hbm_efficiency (fitted on HBM tables): a lower value makes every row slower."""
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    slow = cal.evaluate(hw.model_copy(update={"compute_model": hw.compute_model.model_copy(update={"hbm_efficiency": 0.5})}),
                        layer_traces, network)
    fast = cal.evaluate(hw, layer_traces, network)
    for s, f in zip(slow, fast, strict=True):
        assert s.predicted_forward_ms > 1.05 * f.predicted_forward_ms


# --- the fit's report and the files ---------------------------------------------------------------
def test_fit_report_holds_values_errors_inputs_and_code(reference):
    doc = json.loads(json.dumps(fit.fit_hardware("b200-sxm", "0123456789ab")))  # as the rule writes it
    assert doc["code"] == "0123456789ab" and doc["hardware"] == "b200-sxm"
    assert set(doc["fitted"]) == set(fit.fitted_parameters("b200-sxm"))
    cm = load_hardware("b200-sxm").compute_model
    assert doc["params"]["gemm.bf16.peak_fraction"] == pytest.approx(cm.gemm.bf16.peak_fraction, rel=1e-3)
    assert doc["errors"]["gemm"]["bf16"]["n_held_out"] > 0 and doc["errors"]["hbm"]["all"]["n_fit"] > 0
    # what it read: the hardware file's datasheet figures only (writing the values back does not re-run
    # it), the split, and the reference tables it reproduced
    config = doc["inputs"]["config"]
    assert "compute_model" not in config["hardware"] and config["sm_count"] == 148 and config["split"]
    assert set(doc["inputs"]["reference"]) == set(fit.reference_tables("b200-sxm"))


@pytest.mark.parametrize("name", GPUS)
def test_every_gpu_file_says_what_is_fitted_and_what_is_assumed(name):
    cm = load_hardware(name).compute_model
    assert "sustained_compute" not in type(cm).model_fields  # nothing fitted on step times stays in
    assert cm.provenance_of("sm_count").status == "datasheet"
    assert cm.provenance_of("kernel_launch_us").status == "assumed"
    assert cm.provenance_of("hbm_efficiency").status == "fitted"  # every one of these has HBM rows
    assert "hbm_bandwidth.csv" in cm.provenance_of("hbm_efficiency").basis
    assert tuple(sorted(cm.fitted_by.parameters)) == tuple(sorted(fit.fitted_parameters(name)))
    assert cm.fitted_by.fit == paths.fit(name)


def test_no_shipped_fit_is_stale():
    """Each hardware file's fitted values came from today's fit code. When this fails, the fit's
    code (or what it imports: profile, config, and through echo.fit.compute/step the tracer and the
    simulator) changed: run `python -m echo fit --write` (or `make fit` and copy each
    results/fit/<hardware>.json). tests/test_kernel_model.py re-fits every GPU from the tables."""
    assert fit.stale_fits(code_version("fit")) == []


def test_a_stale_or_mismatched_fit_is_reported(config_root: Path):
    path = config_root / "hardware" / "b200-sxm.yaml"

    def stale_b200() -> list[str]:
        return [line for line in fit.stale_fits(code_version("fit"), config_root) if line.startswith(str(path))]

    edit_yaml(path, **{"compute_model.fitted_by.code": "0" * 12})
    assert "fitted by fit code 000000000000" in stale_b200()[0]
    assert [line.split(":")[0] for line in fit.stale_fits("1" * 12, config_root)] == \
        [str(config_root / "hardware" / f"{g}.yaml") for g in GPUS]  # every fitted file, against other code
    edit_yaml(path, **{"compute_model.fitted_by": None})
    with pytest.raises(ConfigError, match="provenance says fitted for .*, fitted_by names ..") as err:
        load_hardware("b200-sxm", root=config_root)
    assert "compute_model" in str(err.value)
    data = yaml.safe_load(path.read_text())  # provenance keys hold dots: edit the mapping itself
    for entry in data["compute_model"]["provenance"].values():
        entry["status"] = "assumed" if entry["status"] == "fitted" else entry["status"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert "fitted_by names None" in stale_b200()[0]


def test_provenance_of_an_unknown_parameter_is_refused(config_root: Path):
    path = config_root / "hardware" / "a100-sxm-80gb.yaml"
    edit_yaml(path, **{"compute_model.provenance.matmul_eficiency": {"status": "assumed", "basis": "x"}})
    with pytest.raises(ConfigError) as err:
        load_hardware("a100-sxm-80gb", root=config_root)
    assert "matmul_eficiency" in str(err.value) and "compute_model" in str(err.value)
    edit_yaml(path, **{"compute_model.provenance.matmul_eficiency": None,
                       "compute_model.provenance.sm_count.status": "guessed"})
    with pytest.raises(ConfigError) as err:
        load_hardware("a100-sxm-80gb", root=config_root)
    assert "status" in str(err.value)
