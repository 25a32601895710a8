"""The GPU kernel model (echo.profile.gemm_model, attention_model, roofline) and its calibration
(echo.fit.kernels) on the per-kernel reference tables:

- every compute-model parameter of every hardware file has a provenance, and none is fitted on
  step times;
- the shipped values are what today's fit gives, on the split declared in config/splits/;
- the fitted parameters reproduce the held-out rows within the bound (10% mean |error| per GPU and
  format, with the documented exceptions below), computed from the reference CSVs via echo.reference;
- beyond the tables (large K, DeepGEMM's shapes, square-GEMM peaks) the model extrapolates sanely;
- FP8 recipes are read from the operands of _scaled_mm / _scaled_grouped_mm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from echo import fit
from echo.config import CONFIG_ROOT, load_hardware
from echo.config.hardware import ComputeModel
from echo.fit import kernel_data, kernels
from echo.profile.gemm_model import gemm_call
from echo.profile.kernel import Kernel
from echo.profile.roofline import estimate, executed_flops

HARDWARE_FILES = sorted(p.stem for p in (CONFIG_ROOT / "hardware").glob("*.yaml"))
KERNEL_TABLES = ("xla_matmul_table.csv", "tilelang_matmul_h800.csv", "deepgemm_fp8.csv", "torch_square_gemm.csv",
                 "flash_attention.csv", "hbm_bandwidth.csv")
BOUND = 10.0  # held-out mean |error| %, per GPU and format (the target; goal 5%)
# Held-out sets that miss the bound, with the bound they are held to instead and why (the report,
# /tmp/helperA_report.md, gives the figures):
EXCEPTIONS = {
    ("h100-sxm-80gb", "gemm", "fp32"): (16.0, "XLA's sm_90 f32 rows jump with the library's algorithm choice "
                                        "(the same shape at batch 2 and 4 differs 2x); fit error is the same"),
    ("h100-sxm-80gb", "attention", "fwd"): (14.0, "the FA3 sources disagree: the same (4, 48, 1024, 128) forward "
                                            "is 190 us in one tritonbench PR and 284 us in another"),
    ("h200-sxm-141gb", "attention", "fwd"): (14.0, "one row, H100's parameters transferred: H200 measured 5.6% "
                                             "slower than H100 in the same issue"),
    ("b200-sxm", "attention", "bwd"): (18.0, "one causal row; the per-CTA backward cost is H100's, transferred"),
}
HELD_OUT = [
    ("a100-sxm-80gb", "hbm", "all"), ("a100-sxm-80gb", "gemm", "bf16"),
    ("h100-sxm-80gb", "hbm", "all"), ("h100-sxm-80gb", "gemm", "bf16"), ("h100-sxm-80gb", "gemm", "fp32"),
    ("h100-sxm-80gb", "gemm", "fp8"), ("h100-sxm-80gb", "blockwise_fp8", "all"),
    ("h100-sxm-80gb", "attention", "fwd"), ("h100-sxm-80gb", "attention", "bwd"),
    ("h200-sxm-141gb", "hbm", "all"), ("h200-sxm-141gb", "attention", "fwd"),
    ("b200-sxm", "hbm", "all"), ("b200-sxm", "gemm", "bf16"), ("b200-sxm", "gemm", "fp32"), ("b200-sxm", "gemm", "fp8"),
    ("b200-sxm", "attention", "fwd"), ("b200-sxm", "attention", "bwd"),
]


@pytest.fixture(scope="module")
def fits(reference) -> dict:
    """Today's kernel fit of every fitted and transferred GPU, from the reference CSVs."""
    return {name: kernels.fit_kernels(name, reference) for name in (*kernels.FITTED, *kernels.SAME_SILICON)}


# --- provenance ----------------------------------------------------------------------------------
def unexplained(cm: ComputeModel) -> list[str]:
    """The compute-model parameters without a provenance (their own entry or their group's)."""
    return [p for p in cm.parameter_names() if cm.provenance_of(p) is None]


@pytest.mark.parametrize("name", HARDWARE_FILES)
def test_every_compute_model_parameter_has_a_provenance(name):
    hw = load_hardware(name)
    cm = hw.compute_model
    assert unexplained(cm) == [], f"config/hardware/{name}.yaml: parameters without provenance"
    if hw.kind == "gpu":  # a GPU file carries the full kernel model, not the nominal knob
        assert cm.gemm is not None and cm.attention is not None and cm.matmul_efficiency is None
        for p in cm.parameter_names():
            assert cm.provenance_of(p).basis.strip(), (name, p)


def test_a_missing_provenance_is_caught():
    cm = load_hardware("h100-sxm-80gb").compute_model
    prov = {k: v for k, v in cm.provenance.items() if k != "gemm.bf16"}
    stripped = ComputeModel.model_validate({**cm.model_dump(), "provenance": prov, "fitted_by": {
        **cm.fitted_by.model_dump(), "parameters": [p for p in cm.fitted_by.parameters if p != "gemm.bf16"]}})
    assert unexplained(stripped) == ["gemm.bf16.peak_fraction", "gemm.bf16.wave_overhead_us", "gemm.bf16.full_rate_reuse"]


@pytest.mark.parametrize("name", HARDWARE_FILES)
def test_nothing_is_fitted_on_step_or_layer_times(name):
    cm = load_hardware(name).compute_model
    assert "sustained_compute" not in ComputeModel.model_fields
    for p in cm.parameter_names():
        prov = cm.provenance_of(p)
        if prov.status == "fitted":  # fitted on a kernel table of the reference folder's kernels/
            assert any(t in prov.basis for t in KERNEL_TABLES), (name, p, prov.basis)
    assert tuple(sorted(cm.fitted_by.parameters if cm.fitted_by else ())) == tuple(sorted(fit.fitted_parameters(name)))


# --- the split and the shipped values -------------------------------------------------------------
def test_the_split_is_the_declared_one(reference):
    """config/splits/kernel_tables.csv lists what the rules of kernel_tables.yaml give (the split was
    written down before the fit; a change to either shows here)."""
    listed = kernel_data.read_split_csv()
    assert listed == [r for r in kernel_data.split_rows(reference) if r[3] in ("held_out", "check")]
    assert sum(r[3] == "held_out" for r in listed) > 800


@pytest.mark.parametrize("name", [*kernels.FITTED, *kernels.SAME_SILICON])
def test_the_shipped_values_are_todays_fit(fits, name):
    """The hardware file holds what the fit gives (values and provenance status); when this fails,
    run `python -m echo fit --write` (or `make fit` and copy results/fit/<hardware>.json)."""
    hw, doc = load_hardware(name), fits[name]
    assert kernels.check_file(hw, doc) == []
    for leaf in hw.compute_model.parameter_names():
        assert hw.compute_model.provenance_of(leaf).status == kernels._provenance_of(
            doc["compute_model"]["provenance"], leaf)["status"], leaf
    assert tuple(doc["fitted"]) == tuple(sorted(fit.fitted_parameters(name)))


# --- held-out error -----------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "kind", "label"), HELD_OUT)
def test_held_out_rows_are_reproduced_within_the_bound(fits, name, kind, label):
    errors = fits[name]["errors"][kind]
    got = (errors if label == "all" and "held_out" in errors else errors[label])
    bound, why = EXCEPTIONS.get((name, kind, label), (BOUND, ""))
    assert got["n_held_out"] > 0
    assert got["held_out"] <= bound, f"{name} {kind} {label}: held-out mean |error| {got['held_out']}% {why}"
    if why:  # an exception must still be one
        assert got["held_out"] > BOUND, f"{name} {kind} {label} now meets the bound: drop its exception"


def test_every_fitted_table_has_held_out_rows(fits):
    for name in kernels.FITTED:
        for kind, by_label in fits[name]["errors"].items():
            if kind in ("gemm", "attention"):
                for label, e in by_label.items():
                    assert e.get("n_held_out", 0) > 0, (name, kind, label)


# --- extrapolation beyond the tables -----------------------------------------------------------------
def _checks(fits, name, table):
    return {r["key"]: r for r in fits[name]["checks"]["gemm"] if r["table"] == table}


def test_square_gemm_peaks_beyond_the_table(fits):
    """torch.matmul's best square bf16 GEMM (n up to 10240, beyond the XLA table's 4096) within 5%."""
    for name, key in (("h100-sxm-80gb", "7:NVIDIA H100 80GB HBM3:max:bf16_tflops"),
                      ("h200-sxm-141gb", "9:NVIDIA H200:max:bf16_tflops"),
                      ("b200-sxm", "2:NVIDIA B200 180GB:max:bf16_tflops")):
        row = _checks(fits, name, "torch_square_gemm.csv")[key]
        assert abs(row["model_tflops"] / row["measured_tflops"] - 1) < 0.05, (name, row)
    for name in ("h100-sxm-80gb", "b200-sxm", "a100-sxm-80gb"):
        c = fits[name]["checks"]["hardware_csv_best_bf16"]
        assert abs(c["error_pct"]) < 5, (name, c)


def test_large_k_extrapolation_saturates_below_the_main_loop_rate(fits):
    """Past the table's K = 4096 the tile overhead amortises: throughput rises with K and levels off
    at the format's main-loop rate (DeepGEMM K = 16384 and TileLang's K sweep to 16384 check it)."""
    for name in ("h100-sxm-80gb", "b200-sxm"):
        hw = load_hardware(name)
        for fmt, sweep in fits[name]["checks"]["k_sweep_8192x8192"].items():
            values = list(sweep.values())
            assert values == sorted(values), (name, fmt)
            assert values[-1] / values[-2] < 1.02, (name, fmt)  # 32768 -> 65536: levelled off
            rate = getattr(hw.compute_model.gemm, fmt)
            assert values[-1] < getattr(hw.peak_tflops, fmt) * rate.peak_fraction, (name, fmt)
    tile = _checks(fits, "h100-sxm-80gb", "tilelang_matmul_h800.csv")
    for k in (4096, 8192, 16384):  # TileLang fp16, K beyond the table: within 10%
        assert abs(tile[f"fp16:{k}"]["error_pct"]) < 10, tile[f"fp16:{k}"]
    cublas = _checks(fits, "h100-sxm-80gb", "fastcu_bf16_gemm.csv")["cuBLAS:8192"]
    assert abs(cublas["error_pct"]) < 5
    deep = [r for r in fits["h100-sxm-80gb"]["gemm_rows"] if r["table"] == "deepgemm_fp8.csv" and r["shape"][1] >= 1024]
    assert deep and all(abs(r["error_pct"]) < 15 for r in deep)  # training-sized blockwise-FP8 GEMMs


# --- FP8 recipes from the operands ------------------------------------------------------------------
def T(shape, dt):
    return {"T": list(shape), "dt": dt}


def scaled_mm(m, n, k, in_dt="float8_e4m3fn", scale_a=None, scale_b=None, out="torch.bfloat16",
              name="aten._scaled_mm.default"):
    """A _scaled_mm call as the tracer records it (K of the shapes, i.e. packed for FP4)."""
    scale_a = scale_a or T([], "float32")
    scale_b = scale_b or T([], "float32")
    args = [T([m, k], in_dt), T([k, n], in_dt), scale_a, scale_b]
    args_json = json.dumps({"args": args, "kwargs": {"out_dtype": {"S": out}}})
    return Kernel(f"{name}|{args_json}", name, "gemm", "compute", json.dumps([a["T"] for a in args]), "bfloat16",
                  2.0 * m * n * k, float(m * k + k * n + 2 * m * n), args_json)


def bf16_mm(m, n, k):
    args_json = json.dumps({"args": [T([m, k], "bfloat16"), T([k, n], "bfloat16")], "kwargs": {}})
    return Kernel(f"mm|{args_json}", "aten.mm.default", "gemm", "compute", json.dumps([[m, k], [k, n]]), "bfloat16",
                  2.0 * m * n * k, 2.0 * (m * k + k * n + m * n), args_json)


def us(hw_name, k):
    return estimate(load_hardware(hw_name), k).duration_us


def test_recipes_are_read_from_the_operands():
    m, n, k = 4096, 8192, 8192
    assert gemm_call("_scaled_mm", scaled_mm(m, n, k).args).fmt == "fp8"
    rowwise = scaled_mm(m, n, k, scale_a=T([m, 1], "float32"), scale_b=T([1, n], "float32"))
    assert gemm_call("_scaled_mm", rowwise.args).fmt == "fp8"
    mx = scaled_mm(m, n, k, scale_a=T([m, k // 32], "float8_e8m0fnu"), scale_b=T([k // 32, n], "float8_e8m0fnu"))
    assert gemm_call("_scaled_mm", mx.args).fmt == "mxfp8"
    block = scaled_mm(m, n, k, scale_a=T([m, k // 128], "float32"), scale_b=T([k // 128, n // 128], "float32"))
    assert gemm_call("_scaled_mm", block.args).fmt == "blockwise_fp8"
    fp4 = gemm_call("_scaled_mm", scaled_mm(m, n, k // 2, "float4_e2m1fn_x2", T([m, k // 16], "float8_e4m3fn"),
                                            T([k // 16, n], "float8_e4m3fn")).args)
    assert (fp4.fmt, fp4.k, fp4.a_bytes) == ("nvfp4", k, 0.5)  # logical K: two values per byte
    assert gemm_call("_scaled_mm", scaled_mm(m, n, k, out="torch.float32").args).out_bytes == 4


def test_fp8_gemms_run_at_the_fp8_rate_and_block_scaling_costs_on_hopper():
    m, n, k = 8192, 8192, 8192
    h100 = load_hardware("h100-sxm-80gb").compute_model.gemm
    per_tensor, bf16 = us("h100-sxm-80gb", scaled_mm(m, n, k)), us("h100-sxm-80gb", bf16_mm(m, n, k))
    assert 1.7 < bf16 / per_tensor < 2.05  # twice the peak, at its own fitted fraction
    block = us("h100-sxm-80gb", scaled_mm(m, n, k, scale_a=T([m, k // 128], "float32"),
                                          scale_b=T([k // 128, n // 128], "float32")))
    assert block / per_tensor == pytest.approx(1 / h100.blockwise_fp8, rel=0.05)
    # Blackwell applies block scales in the MMA: MXFP8 costs what per-tensor FP8 costs
    mx = scaled_mm(m, n, k, scale_a=T([m, k // 32], "float8_e8m0fnu"), scale_b=T([k // 32, n], "float8_e8m0fnu"))
    assert us("b200-sxm", mx) == pytest.approx(us("b200-sxm", scaled_mm(m, n, k)), rel=1e-6)


def test_blockwise_fp8_gemms_take_deepgemms_fixed_time_on_hopper():
    """A blockwise-FP8 GEMM's fixed time is fitted on DeepGEMM's rows, not the XLA-fitted floor of
    every other format: a skinny one costs its bytes plus that time (M = 64, N 7168, K 2048: 14.7 MB
    of FP8 weights), H200 takes H100's, and Blackwell (no fit of its own) the GPU's floor."""
    gemm = load_hardware("h100-sxm-80gb").compute_model.gemm
    assert gemm.blockwise_launch_us is not None and gemm.blockwise_launch_us < gemm.launch_us
    assert load_hardware("h200-sxm-141gb").compute_model.gemm.blockwise_launch_us == gemm.blockwise_launch_us
    assert load_hardware("b200-sxm").compute_model.gemm.blockwise_launch_us is None
    m, n, k = 64, 7168, 2048
    block = scaled_mm(m, n, k, scale_a=T([m, k // 128], "float32"), scale_b=T([k // 128, n // 128], "float32"))
    hw = load_hardware("h100-sxm-80gb")
    bytes_us = (m * k + k * n + 2 * m * n) / (hw.hbm_GBps * 1e3 * hw.compute_model.hbm_efficiency)
    got = us("h100-sxm-80gb", block)
    assert gemm.blockwise_launch_us + bytes_us <= got < gemm.launch_us + bytes_us


def test_gb200_runs_b200s_measured_rates_and_b300_its_own_peaks():
    """GB200 is B200's die (kernels.SAME_DIE): its GEMMs and attention take B200's modelled times,
    whatever its datasheet's higher peaks; Blackwell Ultra (B300), other silicon, scales with its own."""
    m, n, k = 8192, 8192, 8192
    for kern in (bf16_mm(m, n, k), scaled_mm(m, n, k)):
        assert us("gb200", kern) == pytest.approx(us("b200-sxm", kern), rel=2e-3)
    b200, gb200 = load_hardware("b200-sxm"), load_hardware("gb200")
    assert gb200.peak_tflops.bf16 > b200.peak_tflops.bf16  # the datasheets do differ
    assert gb200.compute_model.provenance_of("gemm.bf16.peak_fraction").status == "transferred"
    assert "gb300" not in kernels.SAME_DIE and "b300-sxm" not in kernels.SAME_DIE


def test_nvfp4_uses_the_logical_k_and_the_fp4_peak():
    m, n, k = 8192, 8192, 8192
    kern = scaled_mm(m, n, k // 2, "float4_e2m1fn_x2", T([m, k // 16], "float8_e4m3fn"), T([k // 16, n], "float8_e4m3fn"))
    assert executed_flops(kern) == 2.0 * m * n * k  # not the packed shapes' K
    fp4, fp8 = us("b200-sxm", kern), us("b200-sxm", scaled_mm(m, n, k))
    assert 1.6 < fp8 / fp4 < 2.05
    est = estimate(load_hardware("b200-sxm"), kern)
    assert est.efficiency < load_hardware("b200-sxm").compute_model.gemm.fp4.peak_fraction


@pytest.mark.parametrize(("hw_name", "kern", "dtype"), [
    ("a100-sxm-80gb", scaled_mm(4096, 4096, 4096), "FP8"),
    ("h100-sxm-80gb", scaled_mm(4096, 4096, 2048, "float4_e2m1fn_x2"), "FP4"),
])
def test_a_gpu_without_those_tensor_cores_refuses_clearly(hw_name, kern, dtype):
    with pytest.raises(ValueError, match=f"{hw_name}.*{dtype}"):
        estimate(load_hardware(hw_name), kern)


def test_scaled_grouped_mm_is_a_batch_of_expert_gemms():
    groups, m, n, k = 8, 1024, 2048, 4096
    # as echo.training.fp8 traces the routed experts' forward: offs and out_dtype by keyword
    args = [T([groups * m, k], "float8_e4m3fn"), T([groups, k, n], "float8_e4m3fn"), T([groups * m], "float32"),
            T([groups * n], "float32")]
    args_json = json.dumps({"args": args, "kwargs": {"offs": T([groups], "int32"), "out_dtype": {"S": "torch.bfloat16"}}})
    call = gemm_call("_scaled_grouped_mm", args_json)
    assert (call.batch, call.m, call.n, call.k, call.fmt) == (groups, m, n, k, "fp8")
    name = "aten._scaled_grouped_mm.default"
    # the tracer may class it "other" (its FLOPs 0): the model still reads it as a GEMM
    kern = Kernel(f"{name}|{args_json}", name, "other", "compute", "[]", "bfloat16", 0.0, 0.0, args_json)
    assert executed_flops(kern) == 2.0 * groups * m * n * k
    one = us("h100-sxm-80gb", scaled_mm(m, n, k))
    assert groups * 0.5 * one < us("h100-sxm-80gb", kern) < groups * one  # one launch, experts share waves
    # the weight gradient: 2-D x 2-D, K split over the experts by offs
    dw = {"args": [T([n, groups * m], "float8_e4m3fn"), T([groups * m, k], "float8_e4m3fn"), T([n * groups], "float32"),
                   T([k * groups], "float32")], "kwargs": {"offs": T([groups], "int32")}}
    call = gemm_call("_scaled_grouped_mm", json.dumps(dw))
    assert (call.batch, call.m, call.n, call.k) == (groups, n, k, m)


def test_fp8_attention_is_faster_where_the_gpu_has_fp8():
    q8, q16 = T([2, 16, 4096, 128], "float8_e4m3fn"), T([2, 16, 4096, 128], "bfloat16")

    def attn(q):
        args_json = json.dumps({"args": [q, q, q, 0.0, False], "kwargs": {}})
        name = "aten._scaled_dot_product_flash_attention_for_cpu.default"
        return Kernel(f"{name}|{args_json}", name, "attention", "compute", "[]", q["dt"],
                      4.0 * 2 * 16 * 4096**2 * 128, 4 * 2 * 16 * 4096 * 128 * 2.0, args_json)

    h100 = load_hardware("h100-sxm-80gb")
    ratio = estimate(h100, attn(q16)).duration_us / estimate(h100, attn(q8)).duration_us
    assert 1.2 < ratio <= h100.compute_model.attention.fp8_speedup
    with pytest.raises(ValueError, match="a100-sxm-80gb.*FP8"):
        estimate(load_hardware("a100-sxm-80gb"), attn(q8))


def test_the_fit_is_reproducible_from_the_reference_folder_alone(reference, tmp_path: Path):
    """`make fit`'s report for one GPU, from the CSVs via echo.reference (nothing read elsewhere)."""
    doc = json.loads(json.dumps(fit.fit_hardware("h200-sxm-141gb", "0" * 12, reference_dir=reference)))
    assert doc["fitted"] == {"hbm_efficiency": load_hardware("h200-sxm-141gb").compute_model.hbm_efficiency}
    assert all(t.startswith("kernels/") or t == "hardware.csv" for t in doc["inputs"]["reference"])


def test_the_experts_weight_gradient_counts_its_flops_at_trace_time():
    """The tracer's FLOPs of a grouped GEMM: the weight gradient (2-D x 2-D, rows split by offs) does
    as much work as the forward over the same rows (it was counted 0, so MoE jobs' MFU came out low)."""
    import torch

    from echo.trace import opinfo

    groups, rows, k, n = 4, 64, 32, 48
    meta = {"device": "meta", "dtype": torch.bfloat16}
    fwd = opinfo.matmul_flops(torch.ops.aten._grouped_mm.default,
                              (torch.empty(rows, k, **meta), torch.empty(groups, k, n, **meta)))
    dw = opinfo.matmul_flops(torch.ops.aten._grouped_mm.default,
                             (torch.empty(n, rows, **meta), torch.empty(rows, k, **meta)))
    assert fwd == dw == 2.0 * rows * k * n
