"""The kernel-time model's parameters of each GPU, fitted on published per-kernel measurements.

Reference tables (kernels/ of the reference folder, echo.fit.kernel_data), split into fit and
held-out rows by config/splits/kernel_tables.yaml (declared before any fit):

- HBM (``hbm_efficiency``): gpu-stream occupancy sweeps (A100 80GB, H200; A100 40GB and H100 PCIe
  inform the sweep model only) fitted by a saturating bytes-in-flight model,
  ``GBps = (BW^-p + (mlp_kernel * occupancy)^-p)^(-1/p)``: BW per GPU (the asymptote a kernel with
  enough bytes in flight reaches, what training's vectorised elementwise kernels approach), one
  memory-level parallelism per benchmark kernel and one knee exponent p shared by every sweep.
  B200: the cccl DeviceTransform sizes, ``time = t_fixed + bytes / BW``. H100 SXM: fast.cu's
  2^30-element reduction (BW = bytes / time).
- GEMM (``gemm``): least squares on log time of the fit shapes of OpenXLA's GEMM table (H100 bf16
  and tf32, B200 bf16, tf32 and fp8), one launch floor per GPU and a GemmRate per format. H100 FP8
  (whose XLA rows exceed the FP8 peak): TileLang's H800 K sweep, the launch floor and operand reuse
  kept from the bf16 fit. Hopper's blockwise-FP8 factor and fixed time: DeepGEMM's fit rows. A100
  (square peaks only): the bf16 peak_fraction solved so that the model's best square GEMM equals
  torch's measured maximum, its tile constants transferred from H100.
- Attention (``attention``): least squares on log time of the fit rows of the reference flash
  kernel (FlashAttention-3 on H100, FlashAttention-4 on B200).

Everything a GPU has no data of its own kind for is transferred (from the same silicon or the
nearest GPU) or assumed, and says so in its provenance. ``fit_kernels`` returns the values, the
provenance, every row reproduced (fit, held out, check) and the mean errors.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
from scipy.optimize import brentq, least_squares

from echo.config import Hardware
from echo.config.hardware import AttentionModel, GemmRate
from echo.fit import kernel_data as kd
from echo.profile.attention_model import AttentionCall, attention_time
from echo.profile.gemm_model import TILES, gemm_time

FITTED = (kd.A100, kd.H100, kd.H200, kd.B200)
# hardware files whose silicon is another's: every parameter transferred from it
SAME_SILICON = {"gb200": (kd.B200, "B200 silicon (GB200: the same Blackwell die at a higher power limit; its "
                          "datasheet's 11% higher peaks are not measured by any kernel table, so B200's measured "
                          "rates carry over as they are: see SAME_DIE)"),
                "gb300": (kd.B200, "B200 silicon (GB300 is Blackwell Ultra; no GB300 or B300 kernel data in the "
                          "reference folder, so the nearest fitted Blackwell part)"),
                "b300-sxm": (kd.B200, "B200 silicon (B300 is Blackwell Ultra; no B300 kernel data in the "
                             "reference folder, so the nearest fitted Blackwell part)")}
# Parts of the same die as their source: the GEMM main-loop rates transfer as achieved TFLOP/s (each
# peak_fraction rescaled to the part's own datasheet peak), not as fractions of a datasheet peak that
# no kernel on the part measured. GB200's datasheet (5 PF sparse BF16 per GPU) is 11% above HGX
# B200's (4.5 PF) for the same SMs; sources disagree on it (the hardware file's header), and the
# Megatron-Bridge rows that ran one layout on both (Qwen3-30B-A3B, EP8, three releases) measure GB200
# 1-4% slower per GPU, not faster (a check, not a fit). B300 / GB300 are other silicon (Blackwell
# Ultra): their datasheet peaks are the best evidence of their rates and carry them.
SAME_DIE = frozenset({"gb200"})
_RATE_PEAK = {"bf16": "bf16", "tf32": "tf32", "fp8": "fp8", "fp4": "fp4"}  # gemm rate key -> peak_tflops key
SPLIT = "config/splits/kernel_tables.yaml"
# assumed: the floor of a non-GEMM kernel (launch to completion of a tiny grid); no GPU's table
# times a tiny non-GEMM kernel as a profiler would (cccl's nvbench times include the launch)
KERNEL_LAUNCH_US = {kd.A100: 4.0, kd.H100: 3.0, kd.H200: 3.0, kd.B200: 3.0}
# FlashAttention-2 (Dao 2023) on A100: up to 73% of peak forward, 63% backward (hd 128, long
# sequences); not in the reference folder, so the A100 attention rates are assumed from them
FA2_A100 = {"fwd": 0.73, "bwd": 0.63, "headdim": 128, "seqlen": 16384, "batch": 2, "heads": 16}
# FA3 abstract (flash_attention.csv FA3-abstract): fp8 "close to 1.2 PFLOPs/s", fp16 740 TFLOP/s
FA3_FP8_SPEEDUP = round(1200 / 740, 3)
_RATE_KEYS = ("peak_fraction", "wave_overhead_us", "full_rate_reuse")
# full_rate_reuse is bounded by the largest tile's reuse (128x256: 85.3), so that peak_fraction keeps
# its meaning: the rate of a large-tile main loop
MAX_REUSE = max(tm * tn / (tm + tn) for tm, tn in TILES)
_FMT_PEAK = {"bf16": "bf16", "fp32": "tf32", "fp8": "fp8", "blockwise_fp8": "fp8"}
_FMT_RATE = {"bf16": "bf16", "fp32": "tf32", "fp8": "fp8", "blockwise_fp8": "fp8"}


def hardware_for_fit(name: str, config_root: Path | None = None) -> Hardware:
    """Hardware ``name`` as its file gives peaks, HBM and SM count (datasheet), with a nominal compute
    model in place of the one the fit gives: the fit reads nothing the fit writes."""
    from echo.config.loader import config_path, read_yaml

    data = read_yaml(config_path("hardware", name, config_root))
    sms = int(data["compute_model"]["sm_count"])
    return Hardware.model_validate({**data, "name": name, "compute_model": {
        "sm_count": sms, "kernel_launch_us": 0.0, "hbm_efficiency": 1.0, "matmul_efficiency": 1.0}})


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _mean_abs(errors) -> float | None:
    errors = [abs(e) for e in errors]
    return round(100 * sum(errors) / len(errors), 2) if errors else None


# --- HBM ---------------------------------------------------------------------------------------
def fit_stream_sweeps(rows: list[kd.StreamRow]) -> dict:
    """The sweep model on every gpu-stream sweep's fit rows: {sweep: BW GB/s}, p, per-kernel mlp."""
    sweeps = sorted({r.sweep for r in rows if r.sweep})
    kernels = sorted({(r.sweep, r.kernel) for r in rows if r.sweep})
    fit = [r for r in rows if r.sweep and r.split == "fit"]

    def unpack(v):
        return dict(zip(sweeps, v[:len(sweeps)], strict=True)), v[len(sweeps)], dict(zip(kernels, v[len(sweeps) + 1:], strict=True))

    def resid(v):
        bw, p, mlp = unpack(v)
        return np.log(np.array([sweep_GBps(bw[r.sweep], p, mlp[(r.sweep, r.kernel)], r.occupancy) for r in fit])
                      / np.array([r.GBps for r in fit]))

    start = [2000.0] * len(sweeps) + [2.0] + [5000.0] * len(kernels)
    lo = [100.0] * len(sweeps) + [1.0] + [10.0] * len(kernels)
    hi = [20000.0] * len(sweeps) + [20.0] + [1e6] * len(kernels)
    res = least_squares(resid, start, bounds=(lo, hi), x_scale="jac")
    bw, p, mlp = unpack(res.x)
    return {"bw_GBps": {s: float(v) for s, v in bw.items()}, "p": float(p),
            "mlp_GBps": {f"{s}:{k}": float(v) for (s, k), v in mlp.items()}}


def sweep_GBps(bw: float, p: float, mlp: float, occupancy: float) -> float:
    """Bandwidth of a benchmark kernel at an occupancy: the achievable BW, or the bytes its threads
    keep in flight (mlp x occupancy, Little's law), whichever limits, joined smoothly by p."""
    return (bw ** -p + (mlp * occupancy) ** -p) ** (-1 / p)


def fit_hbm(hw: Hardware, rows: list[kd.StreamRow]) -> tuple[float, dict]:
    """(hbm_efficiency, report) of ``hw`` from its stream rows."""
    name = hw.name
    mine = [r for r in rows if r.gpu == name and r.split != "excluded"]
    report: dict = {"rows": []}
    if any(r.sweep for r in mine):
        model = fit_stream_sweeps(rows)
        sweep = next(r.sweep for r in mine if r.sweep)
        bw = model["bw_GBps"][sweep]
        for r in mine:
            got = sweep_GBps(bw, model["p"], model["mlp_GBps"][f"{sweep}:{r.kernel}"], r.occupancy)
            report["rows"].append({"key": r.key, "split": r.split, "measured_GBps": r.GBps, "model_GBps": got})
        report.update(method=f"gpu-stream sweep '{sweep}', saturating model (p {model['p']:.2f} shared by "
                      f"{len(model['bw_GBps'])} sweeps)", nuisance=model, bw_GBps=bw)
    else:
        fixed = 0.0
        fit = [r for r in mine if r.split == "fit"]
        if len(fit) >= 2:  # sized rows: time = fixed + bytes / BW (the fixed part is the benchmark's own)
            t = np.array([r.nbytes / r.GBps / 1e3 for r in fit])  # us
            res = least_squares(lambda v: np.log((v[0] + np.array([r.nbytes for r in fit]) / (v[1] * 1e3)) / t),
                                [3.0, hw.hbm_GBps * 0.8], bounds=([0, 100], [50, hw.hbm_GBps]))
            fixed, bw = float(res.x[0]), float(res.x[1])
        else:
            bw = fit[0].GBps
        for r in mine:
            t_meas = r.nbytes / r.GBps / 1e3
            got = r.nbytes / ((fixed + r.nbytes / (bw * 1e3)) * 1e3)
            report["rows"].append({"key": r.key, "split": r.split, "measured_GBps": r.GBps, "model_GBps": got,
                                   "measured_us": t_meas})
        report.update(method=f"{fit[0].source}: time = {fixed:.2f} us + bytes / BW", bw_GBps=bw,
                      nuisance={"fixed_us": fixed})
    for split in ("fit", "held_out"):
        report[f"{split}_mean_abs_error_pct"] = _mean_abs(
            r["model_GBps"] / r["measured_GBps"] - 1 for r in report["rows"] if r["split"] == split)
    return min(1.0, bw / hw.hbm_GBps), report


# --- GEMM --------------------------------------------------------------------------------------
def _rate(v) -> GemmRate:
    return GemmRate(peak_fraction=float(v[0]), wave_overhead_us=float(v[1]), full_rate_reuse=float(v[2]))


def predict_gemm(hw: Hardware, rows: list[kd.GemmRow], launch: float, rates: dict[str, GemmRate],
                 bw_GBps: float, blockwise: float = 1.0, blockwise_launch: float | None = None) -> np.ndarray:
    """Model time (us) of each row (square-peak rows: at the best of their sizes, time at max size);
    blockwise-FP8 rows take ``blockwise_launch`` as their fixed time where given."""
    out = np.empty(len(rows))
    sms = hw.compute_model.sm_count
    by_fmt: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_fmt.setdefault(r.fmt, []).append(i)
    for fmt, idx in by_fmt.items():
        sub = [rows[i] for i in idx]
        peak = getattr(hw.peak_tflops, _FMT_PEAK[fmt])
        rate = rates[_FMT_RATE[fmt]]
        factor = blockwise if fmt == "blockwise_fp8" else 1.0
        fixed = blockwise_launch if fmt == "blockwise_fp8" and blockwise_launch is not None else launch
        t, _, _ = gemm_time(rate, fixed, peak, sms, bw_GBps, [r.batch for r in sub], [r.m for r in sub],
                            [r.n for r in sub], [r.k for r in sub], np.array([r.a_bytes for r in sub]),
                            np.array([r.b_bytes for r in sub]), np.array([r.out_bytes for r in sub]), factor)
        for j, (i, r) in enumerate(zip(idx, sub, strict=True)):
            if len(r.sizes) > 1:  # the measurement is the max over sizes: the model's max, as a time at size m
                best = max(2.0 * s**3 / float(gemm_time(rate, launch, peak, sms, bw_GBps, 1, s, s, s, r.a_bytes,
                                                        r.b_bytes, r.out_bytes)[0]) for s in r.sizes)
                out[i] = 2.0 * r.m * r.n * r.k / best
            else:
                out[i] = t[j]
    return out


def fit_gemm_table(hw: Hardware, rows: list[kd.GemmRow], fmts: tuple[str, ...], bw_GBps: float) -> tuple[float, dict]:
    """(launch_us, {rate key: GemmRate}) by least squares on log time of ``rows`` (fit rows)."""
    keys = [_FMT_RATE[f] for f in fmts]

    def unpack(v):
        return float(v[0]), {key: _rate(v[1 + 3 * i: 4 + 3 * i]) for i, key in enumerate(keys)}

    measured = np.array([r.us for r in rows])
    res = least_squares(lambda v: np.log(predict_gemm(hw, rows, *unpack(v), bw_GBps) / measured),
                        [4.0] + [0.8, 1.0, 64.0] * len(keys), bounds=([0.0] + [0.2, 0.0, 8.0] * len(keys),
                                                                      [20.0] + [1.0, 20.0, MAX_REUSE] * len(keys)),
                        diff_step=1e-3, x_scale="jac")
    launch, rates = unpack(res.x)
    return _sig(launch), {k: _rate([_sig(getattr(r, f)) for f in _RATE_KEYS]) for k, r in rates.items()}


def fit_fp8_tilelang(hw: Hardware, rows: list[kd.GemmRow], launch: float, reuse: float, bw: float) -> GemmRate:
    """H100 FP8 (peak_fraction, wave_overhead_us) on TileLang's fit rows, with bf16's operand reuse."""
    measured = np.array([r.us for r in rows])

    def rates(v):
        return {"fp8": GemmRate(peak_fraction=float(v[0]), wave_overhead_us=float(v[1]), full_rate_reuse=reuse)}

    res = least_squares(lambda v: np.log(predict_gemm(hw, rows, launch, rates(v), bw) / measured), [0.8, 1.0],
                        bounds=([0.2, 0.0], [1.0, 20.0]), diff_step=1e-3, x_scale="jac")
    return GemmRate(peak_fraction=_sig(res.x[0]), wave_overhead_us=_sig(res.x[1]), full_rate_reuse=reuse)


def fit_blockwise(hw: Hardware, rows: list[kd.GemmRow], fp8: GemmRate, bw: float) -> tuple[float, float]:
    """Hopper's blockwise-FP8 (main-loop factor, fixed time in us) on DeepGEMM's fit rows (least
    squares on log time). The fixed time is DeepGEMM's own: its persistent TMA kernels start their
    tiles sooner than the cuBLAS / XLA kernels gemm.launch_us is fitted on (its M = 64 / 128 rows,
    memory-bound, run within about 1 us of their bytes' time, which a 5 us floor cannot give)."""
    measured = np.array([r.us for r in rows])
    res = least_squares(lambda v: np.log(predict_gemm(hw, rows, 0.0, {"fp8": fp8}, bw, float(v[0]), float(v[1]))
                                         / measured),
                        [0.9, 3.0], bounds=([0.3, 0.0], [1.0, 20.0]), diff_step=1e-3)
    return _sig(res.x[0]), _sig(res.x[1])


def solve_square_peak(hw: Hardware, row: kd.GemmRow, launch: float, rate: GemmRate, bw: float) -> float:
    """The bf16 peak_fraction whose best modelled square GEMM over the row's sizes equals its TFLOP/s."""
    def gap(fraction: float) -> float:
        r = GemmRate(peak_fraction=fraction, wave_overhead_us=rate.wave_overhead_us, full_rate_reuse=rate.full_rate_reuse)
        return predict_gemm(hw, [row], launch, {"bf16": r}, bw)[0] / row.us - 1

    return _sig(brentq(gap, 0.2, 1.0, xtol=1e-6))


# --- attention ---------------------------------------------------------------------------------
def predict_attention(hw: Hardware, att: AttentionModel, gemm_fraction: float, launch: float,
                      calls: list[AttentionCall], bw: float) -> np.ndarray:
    return np.array([attention_time(att, gemm_fraction, hw.peak_tflops.bf16, hw.compute_model.sm_count, launch, c, bw)
                     for c in calls])


_ATT_FIELDS = ("fwd_vs_gemm", "bwd_vs_gemm", "fwd_cta_us", "bwd_cta_us", "softmax_headdim")
_ATT_BOUNDS = {"fwd_vs_gemm": (0.2, 1.0), "bwd_vs_gemm": (0.2, 1.0), "fwd_cta_us": (0.0, 100.0),
               "bwd_cta_us": (0.0, 100.0), "softmax_headdim": (0.0, 256.0)}


def fit_attention(hw: Hardware, rows: list[kd.AttentionRow], gemm_fraction: float, launch: float, bw: float,
                  free: tuple[str, ...], fixed: dict) -> AttentionModel:
    """The ``free`` attention parameters by least squares on log time of ``rows``, the rest ``fixed``."""
    measured = np.array([r.us for r in rows])
    calls = [r.call for r in rows]

    def model(v) -> AttentionModel:
        return AttentionModel(**{**fixed, **dict(zip(free, (float(x) for x in v), strict=True))})

    start = [{"fwd_vs_gemm": 0.8, "bwd_vs_gemm": 0.6, "fwd_cta_us": 2.0, "bwd_cta_us": 5.0,
              "softmax_headdim": 16.0}[f] for f in free]
    res = least_squares(lambda v: np.log(predict_attention(hw, model(v), gemm_fraction, launch, calls, bw) / measured),
                        start, bounds=([_ATT_BOUNDS[f][0] for f in free], [_ATT_BOUNDS[f][1] for f in free]),
                        diff_step=1e-3, x_scale="jac")
    return AttentionModel(**{**fixed, **{f: _sig(v) for f, v in zip(free, res.x, strict=True)}})


def solve_fa2_a100(hw: Hardware, att: dict, gemm_fraction: float, launch: float, bw: float) -> dict:
    """A100's fwd/bwd_vs_gemm such that the model at FA2's benchmark shape gives FA2's fractions."""
    out = dict(att)
    for direction in ("fwd", "bwd"):
        call = AttentionCall(FA2_A100["batch"], FA2_A100["heads"], FA2_A100["seqlen"], FA2_A100["seqlen"],
                             FA2_A100["headdim"], direction == "bwd", False, False)
        flops = 4.0 * call.batch * call.heads * call.s_q**2 * call.head_dim * (2.5 if call.backward else 1.0)

        def gap(x: float, call=call, flops=flops, direction=direction) -> float:
            a = AttentionModel(**{**out, f"{direction}_vs_gemm": x})
            t = attention_time(a, gemm_fraction, hw.peak_tflops.bf16, hw.compute_model.sm_count, launch, call, bw)
            return flops / (t * 1e6) / hw.peak_tflops.bf16 - FA2_A100[direction]

        out[f"{direction}_vs_gemm"] = _sig(brentq(gap, 0.2, 1.0, xtol=1e-6)) if gap(1.0) > 0 else 1.0
    return out


def _fa2_fraction(hw: Hardware, att: AttentionModel, fraction: float, launch: float, bw: float, direction: str) -> float:
    call = AttentionCall(FA2_A100["batch"], FA2_A100["heads"], FA2_A100["seqlen"], FA2_A100["seqlen"],
                         FA2_A100["headdim"], direction == "bwd", False, False)
    flops = 4.0 * call.batch * call.heads * call.s_q**2 * call.head_dim * (2.5 if call.backward else 1.0)
    t = attention_time(att, fraction, hw.peak_tflops.bf16, hw.compute_model.sm_count, launch, call, bw)
    return flops / (t * 1e6) / hw.peak_tflops.bf16


def attention_report(hw: Hardware, att: AttentionModel, gemm_fraction: float, launch: float, bw: float,
                     rows: list[kd.AttentionRow]) -> dict:
    got = predict_attention(hw, att, gemm_fraction, launch, [r.call for r in rows], bw)
    out = {"rows": [{"key": r.key, "split": r.split, "source": r.source, "implementation": r.implementation,
                     "measured_us": r.us, "model_us": float(g), "error_pct": 100 * (g / r.us - 1)}
                    for r, g in zip(rows, got, strict=True)]}
    for split in ("fit", "held_out"):
        out[f"{split}_mean_abs_error_pct"] = _mean_abs(r["error_pct"] / 100 for r in out["rows"] if r["split"] == split)
    return out


# --- reports -----------------------------------------------------------------------------------
def gemm_report(hw: Hardware, rows: list[kd.GemmRow], launch: float, rates: dict[str, GemmRate], bw: float,
                blockwise: float = 1.0, blockwise_launch: float | None = None) -> list[dict]:
    usable = [r for r in rows if _FMT_RATE[r.fmt] in rates]
    got = predict_gemm(hw, usable, launch, rates, bw, blockwise, blockwise_launch) if usable else []
    return [{"table": r.table, "key": r.key, "fmt": r.fmt, "split": r.split, "shape": [r.batch, r.m, r.n, r.k],
             "measured_tflops": r.tflops, "model_tflops": 2.0 * r.batch * r.m * r.n * r.k / float(g) / 1e6,
             "error_pct": 100 * (float(g) / r.us - 1), "note": r.note} for r, g in zip(usable, got, strict=True)]


def summarise(rows: list[dict], by: str) -> dict:
    """{label: {split: mean |error| %, n_split: count}} over rows grouped by ``by``."""
    out: dict = {}
    for r in rows:
        out.setdefault(r[by], {}).setdefault(r["split"], []).append(r["error_pct"] / 100)
    return {label: {**{s: _mean_abs(e) for s, e in splits.items()}, **{f"n_{s}": len(e) for s, e in splits.items()}}
            for label, splits in sorted(out.items())}


def best_search_gemm(hw: Hardware, launch: float, rate: GemmRate, bw: float) -> tuple[float, list[int]]:
    """The fastest bf16 GEMM over hardware.csv's kind of shape search (M, N multiples of 1024 up to
    16384, K 4096 / 8192 / 16384): TFLOP/s and its shape."""
    mn = np.arange(1024, 16385, 1024)
    m, n, k = (a.ravel() for a in np.meshgrid(mn, mn, np.array([4096, 8192, 16384]), indexing="ij"))
    t, _, _ = gemm_time(rate, launch, hw.peak_tflops.bf16, hw.compute_model.sm_count, bw, 1, m, n, k, 2, 2, 2)
    tflops = 2.0 * m * n * k / t / 1e6
    i = int(np.argmax(tflops))
    return float(tflops[i]), [int(m[i]), int(n[i]), int(k[i])]


def hardware_csv_best(root: Path | None, name: str) -> float | None:
    """hardware.csv's best_measured_bf16_matmul_tflops of this GPU (None when absent)."""
    import csv

    from echo.fit.compute import HARDWARE_CSV, HARDWARE_CSV_GPU
    from echo.reference import reference_file

    if name not in HARDWARE_CSV_GPU:
        return None
    try:
        rows = list(csv.DictReader(reference_file(HARDWARE_CSV, root).read_text().splitlines()))
    except FileNotFoundError:
        return None
    row = next((r for r in rows if r["gpu"] == HARDWARE_CSV_GPU[name]), None)
    return float(row["best_measured_bf16_matmul_tflops"]) if row else None


def k_sweep(hw: Hardware, launch: float, rates: dict[str, GemmRate], bw: float) -> dict:
    """Model throughput of M = N = 8192 against K, beyond the XLA table (how it extrapolates)."""
    ks = [256, 1024, 4096, 8192, 16384, 32768, 65536]
    out = {}
    for key, rate in rates.items():
        peak = getattr(hw.peak_tflops, key)
        if peak is None:
            continue
        size = {"bf16": 2, "tf32": 4, "fp8": 1, "fp4": 0.5}[key]
        t, _, _ = gemm_time(rate, launch, peak, hw.compute_model.sm_count, bw, 1, 8192, 8192, np.array(ks), size, size, 2)
        out[key] = {str(k): round(2.0 * 8192 * 8192 * k / float(x) / 1e6, 1) for k, x in zip(ks, t, strict=True)}
    return out


# --- one GPU -----------------------------------------------------------------------------------
def _p(status: str, basis: str) -> dict:
    return {"status": status, "basis": basis}


def _fmt_err(summary: dict, label: str) -> str:
    s = summary.get(label, {})
    return f"fit {s.get('fit')}% over {s.get('n_fit', 0)}, held-out {s.get('held_out')}% over {s.get('n_held_out', 0)}"


@functools.cache
def _h100_core(root: Path | None, config_root: Path | None = None) -> dict:
    """The H100 fits that other GPUs transfer: HBM, GEMM (bf16, tf32, fp8, blockwise), attention."""
    hw = hardware_for_fit(kd.H100, config_root)
    rows, att_rows, stream = kd.gemm_rows(root), kd.attention_rows(root), kd.stream_rows(root)
    eff, hbm = fit_hbm(hw, stream)
    bw = hw.hbm_GBps * eff
    xla = [r for r in rows if r.gpu == kd.H100 and r.table == "xla_matmul_table.csv"]
    launch, rates = fit_gemm_table(hw, [r for r in xla if r.split == "fit"], ("bf16", "fp32"), bw)
    tile = [r for r in rows if r.table == "tilelang_matmul_h800.csv" and r.fmt == "fp8"]
    rates["fp8"] = fit_fp8_tilelang(hw, [r for r in tile if r.split == "fit"], launch,
                                    rates["bf16"].full_rate_reuse, bw)
    deep = [r for r in rows if r.table == "deepgemm_fp8.csv" and r.split != "excluded"]
    blockwise, blockwise_launch = fit_blockwise(hw, [r for r in deep if r.split == "fit"], rates["fp8"], bw)
    mine = [r for r in att_rows if r.gpu == kd.H100]
    att = fit_attention(hw, [r for r in mine if r.split == "fit"], rates["bf16"].peak_fraction, launch, bw,
                        _ATT_FIELDS, {"fp8_speedup": FA3_FP8_SPEEDUP})
    return dict(hw=hw, eff=eff, hbm=hbm, bw=bw, launch=launch, rates=rates, blockwise=blockwise,
                blockwise_launch=blockwise_launch, att=att)


def fit_kernels(name: str, root: Path | None = None, config_root: Path | None = None) -> dict:
    """The kernel model of hardware ``name``: ``compute_model`` (values and provenance, as the hardware
    file holds them, fitted_by aside), ``fitted`` (the parameters fitted), ``errors`` (mean |error| %
    by kind and label, fit and held out), ``checks`` and ``rows`` (every row reproduced)."""
    if name in SAME_SILICON:
        return _same_silicon(name, root, config_root)
    if name not in FITTED:
        raise ValueError(f"no kernel fit for hardware '{name}'; fitted: {', '.join(FITTED)}, transferred: "
                         f"{', '.join(SAME_SILICON)}")
    hw = hardware_for_fit(name, config_root)
    rows, att_rows, stream = kd.gemm_rows(root), kd.attention_rows(root), kd.stream_rows(root)
    h100 = _h100_core(root, config_root)
    prov: dict[str, dict] = {"sm_count": _p("datasheet", f"{hw.compute_model.sm_count} SMs ({hw.description})")}
    launch_basis = ("the floor of a non-GEMM kernel as a profiler's kernel duration shows it; no table times a tiny "
                    "non-GEMM kernel that way (cccl's nvbench times on B200 include the launch: "
                    "see the HBM fit's fixed time), so the previous value is kept")
    prov["kernel_launch_us"] = _p("assumed", launch_basis)
    out: dict = {"hardware": name, "split": SPLIT, "checks": {}, "errors": {}}

    # HBM: the GPU's own rows everywhere here
    eff, hbm = fit_hbm(hw, stream)
    bw = hw.hbm_GBps * eff
    out["hbm"] = hbm
    out["errors"]["hbm"] = {"all": {"fit": hbm["fit_mean_abs_error_pct"], "held_out": hbm["held_out_mean_abs_error_pct"],
                                    "n_fit": sum(r["split"] == "fit" for r in hbm["rows"]),
                                    "n_held_out": sum(r["split"] == "held_out" for r in hbm["rows"])}}
    prov["hbm_efficiency"] = _p("fitted", f"{hbm['method']}: achievable {hbm['bw_GBps']:.0f} GB/s = {eff:.3f} of "
                                f"{hw.hbm_GBps:g} GB/s; mean |error| fit {hbm['fit_mean_abs_error_pct']}%, held-out "
                                f"{hbm['held_out_mean_abs_error_pct']}% (hbm_bandwidth.csv, split {SPLIT})"
                                + (_A100_STREAM_NOTE if name == kd.A100 else _H100_STREAM_NOTE if name == kd.H100
                                   else ""))

    gemm: dict = {}
    blockwise, blockwise_launch, mxfp8, fp4 = None, None, None, None
    if name in (kd.H100, kd.H200):  # H200: GH100 silicon, H100's GEMM fit
        launch, rates, blockwise = h100["launch"], dict(h100["rates"]), h100["blockwise"]
        blockwise_launch, mxfp8 = h100["blockwise_launch"], blockwise
    elif name == kd.B200:
        xla = [r for r in rows if r.gpu == kd.B200 and r.table == "xla_matmul_table.csv"]
        launch, rates = fit_gemm_table(hw, [r for r in xla if r.split == "fit"], ("bf16", "fp32", "fp8"), bw)
        blockwise, mxfp8, fp4 = 1.0, 1.0, rates["fp8"]
    else:  # A100: square peaks only
        launch = h100["launch"]
        base = h100["rates"]["bf16"]
        fit_row = next(r for r in rows if r.gpu == kd.A100 and r.split == "fit")
        fraction = solve_square_peak(hw, fit_row, launch, base, bw)
        rates = {"bf16": GemmRate(peak_fraction=fraction, wave_overhead_us=base.wave_overhead_us,
                                  full_rate_reuse=base.full_rate_reuse), "tf32": h100["rates"]["tf32"]}
    gemm = {"launch_us": launch, **{k: r.model_dump() for k, r in rates.items()}}
    if fp4 is not None:
        gemm["fp4"] = fp4.model_dump()
    if blockwise is not None:
        gemm["blockwise_fp8"] = blockwise
    if mxfp8 is not None:
        gemm["mxfp8"] = mxfp8
    if blockwise_launch is not None:
        gemm["blockwise_launch_us"] = blockwise_launch
    mine = [r for r in rows if r.gpu == name]
    report = gemm_report(hw, [r for r in mine if r.split != "excluded" or r.table == "xla_matmul_table.csv"],
                         launch, rates, bw, blockwise or 1.0, blockwise_launch)
    out["gemm_rows"] = report
    fitted_rows = [r for r in report if r["table"] != "deepgemm_fp8.csv" and r["split"] != "excluded"]
    out["errors"]["gemm"] = summarise([r for r in fitted_rows if r["split"] in ("fit", "held_out")], "fmt")
    out["errors"]["gemm_by_table"] = summarise([r for r in report if r["split"] in ("fit", "held_out")], "table")
    out["checks"]["gemm"] = [r for r in report if r["split"] in ("check", "excluded")]
    deep = [r for r in report if r["table"] == "deepgemm_fp8.csv"]
    if deep:
        out["errors"]["blockwise_fp8"] = summarise(deep, "fmt")["blockwise_fp8"]
        out["errors"]["blockwise_fp8_by_table"] = summarise([{**r, "label": r["note"]} for r in deep], "label")
    best = hardware_csv_best(root, name)
    model_best, shape = best_search_gemm(hw, launch, rates["bf16"], bw)
    out["checks"]["hardware_csv_best_bf16"] = {"measured_tflops": best, "model_tflops": model_best, "shape": shape,
                                               "error_pct": 100 * (model_best / best - 1) if best else None}
    out["checks"]["k_sweep_8192x8192"] = k_sweep(hw, launch, {**rates, **({"fp4": fp4} if fp4 else {})}, bw)
    prov.update(_gemm_provenance(name, out["errors"], launch, rates))

    # attention
    att_mine = [r for r in att_rows if r.gpu == name]
    if name == kd.H100:
        att = h100["att"]
    elif name == kd.B200:
        # FA4 overlaps the softmax with the asynchronous MMAs (and emulates part of exp2 on the FMA
        # units), so none of it shows: softmax_headdim 0; the per-CTA costs are H100's
        fixed = {"fwd_cta_us": h100["att"].fwd_cta_us, "bwd_cta_us": h100["att"].bwd_cta_us, "softmax_headdim": 0.0}
        att = fit_attention(hw, [r for r in att_mine if r.split == "fit"], rates["bf16"].peak_fraction, launch, bw,
                            ("fwd_vs_gemm", "bwd_vs_gemm"), {**fixed, "fp8_speedup": FA3_FP8_SPEEDUP})
    elif name == kd.H200:
        att = h100["att"]
    else:
        base = {f: getattr(h100["att"], f) for f in _ATT_FIELDS}
        att = AttentionModel(**solve_fa2_a100(hw, base, rates["bf16"].peak_fraction, launch, bw))
    if att_mine:
        out["attention"] = attention_report(hw, att, rates["bf16"].peak_fraction, launch, bw, att_mine)
        rows_ = out["attention"]["rows"]
        out["errors"]["attention"] = summarise([{**r, "label": r["key"].split(":")[1]} for r in rows_], "label")
    out["checks"]["attention"] = _attention_checks(hw, att, rates["bf16"].peak_fraction, launch, bw)
    prov.update(_attention_provenance(name, out["errors"].get("attention", {}), att))
    if name == kd.A100:  # say what the assumed rates give
        for f in ("fwd_vs_gemm", "bwd_vs_gemm"):
            prov[f"attention.{f}"]["basis"] += (f"; {getattr(att, f)} (1 = capped: the model then gives "
                                                f"{_fa2_fraction(hw, att, rates['bf16'].peak_fraction, launch, bw, f[:3]):.0%})")

    cm = {"sm_count": hw.compute_model.sm_count, "kernel_launch_us": KERNEL_LAUNCH_US[name],
          "hbm_efficiency": _sig(eff, 4), "gemm": gemm, "attention": att.model_dump(exclude_none=True)}
    if name == kd.A100:
        cm["attention"].pop("fp8_speedup", None)
    out["compute_model"] = {**cm, "provenance": compress(cm, prov)}
    out["fitted"] = sorted(k for k, v in out["compute_model"]["provenance"].items() if v["status"] == "fitted")
    return out


_A100_STREAM_NOTE = ("; the a100_80 file does not say SXM or PCIe (PCIe's spec is 1935 GB/s): read as SXM, the "
                     "asymptote is taken as this card's")
_H100_STREAM_NOTE = ("; the README names no GPU, but fast.cu's 3.2 TB/s exceeds H100 PCIe's 2 TB/s spec and its "
                     "GEMMs (808 TFLOP/s) H100 NVL's peak share: read as H100 SXM. No sweep: one fit row")


def _gemm_provenance(name: str, errors: dict, launch: float, rates: dict[str, GemmRate]) -> dict:
    e = errors["gemm"]
    xla = "xla_matmul_table.csv " + ("sm_90 (H100)" if name in (kd.H100, kd.H200) else "sm_100_B200 (B200)")
    joint = {kd.H100: "bf16 and f32", kd.B200: "bf16, f32 and the three fp8 combinations"}
    ls = f"least squares on log time of the fit shapes of {xla} ({joint.get(name, '')}; split {SPLIT})"
    h100_t = "transferred from h100-sxm-80gb's fit (its provenance names the tables)"
    p: dict[str, dict] = {}
    if name in (kd.H100, kd.B200):
        p["gemm.launch_us"] = _p("fitted", f"{ls}, one launch floor for every format of the GPU")
        p["gemm.bf16"] = _p("fitted", f"{ls}; bf16: {_fmt_err(e, 'bf16')} shapes")
        p["gemm.tf32"] = _p("fitted", f"{ls}; f32 (XLA runs f32 dots on tf32 tensor cores: up to "
                            f"{'82' if name == kd.H100 else '79'}% of the tf32 peak): {_fmt_err(e, 'fp32')} shapes")
    if name == kd.H100:
        p["gemm.fp8.peak_fraction"] = p["gemm.fp8.wave_overhead_us"] = _p(
            "fitted", "least squares on log time of tilelang_matmul_h800.csv's fp8 fit rows (H800 = H100 silicon; "
            f"M = N = 8192, K 256, 1024, 4096, 16384), launch floor fixed at the bf16 fit's: {_fmt_err(e, 'fp8')} "
            "rows. The XLA sm_90 fp8 rows are not used: some exceed the FP8 dense peak (split file)")
        p["gemm.fp8.full_rate_reuse"] = _p("transferred", "gemm.bf16's (same tensor cores; TileLang's shapes all "
                                           "run large tiles, so the fp8 rows do not identify it)")
        b = errors.get("blockwise_fp8", {})
        deep = (f"least squares on log time of deepgemm_fp8.csv's fit rows (README 989c9e3, H800 SXM5; dense and "
                "grouped, 1x128 / 128x128 scales) with gemm.fp8 fixed, jointly with gemm.{}: fit "
                f"{b.get('fit')}% over {b.get('n_fit')}, held-out {b.get('held_out')}% over {b.get('n_held_out')} rows")
        p["gemm.blockwise_fp8"] = _p("fitted", "the main-loop factor (block scales promoted on the CUDA cores): "
                                     + deep.format("blockwise_launch_us"))
        p["gemm.blockwise_launch_us"] = _p("fitted", "DeepGEMM's own fixed time per kernel (its M = 64 / 128 rows run "
                                           "within about 1 us of their bytes' time, under the XLA-fitted "
                                           "gemm.launch_us): " + deep.format("blockwise_fp8"))
        p["gemm.mxfp8"] = _p("assumed", "as gemm.blockwise_fp8: Hopper's tensor cores have no block-scaled MMA, so "
                             "1x32 E8M0 scales are applied in software as DeepGEMM applies its 1x128 ones "
                             "(Transformer Engine runs MXFP8 on Blackwell only); no MXFP8 Hopper measurement")
    if name == kd.B200:
        p["gemm.fp8"] = _p("fitted", f"{ls}; fp8 (per-tensor scaled XLA dots): {_fmt_err(e, 'fp8')} shapes")
        p["gemm.fp4"] = _p("assumed", "gemm.fp8's values (no FP4 GEMM table in the reference folder; the fp4 peak "
                           "carries the 2x rate): NVFP4's 1x16 block scales are applied by the tensor cores")
        p["gemm.blockwise_fp8"] = _p("assumed", "1: Blackwell's tensor cores apply block scales inside the MMA "
                                     "(tcgen05 block_scale), no CUDA-core promotion as on Hopper; DeepGEMM has no "
                                     "SM100 per-shape table")
        p["gemm.mxfp8"] = _p("assumed", "1: MXFP8 is Blackwell's native block-scaled MMA (same reasoning as "
                             "gemm.blockwise_fp8); no MXFP8 table")
    if name == kd.H200:
        for key in ("gemm.launch_us", "gemm.bf16", "gemm.tf32", "gemm.fp8", "gemm.blockwise_fp8",
                    "gemm.blockwise_launch_us"):
            p[key] = _p("transferred", f"{h100_t} (GH100 silicon: same SMs, clocks and tensor cores; only the HBM "
                        "differs, and the model takes HBM from the H200's own sweep)")
        p["gemm.mxfp8"] = _p("assumed", "as h100-sxm-80gb: gemm.blockwise_fp8's value (no block-scaled MMA on "
                             "Hopper)")
    if name == kd.A100:
        p["gemm.bf16.peak_fraction"] = _p(
            "fitted", f"closed form: the model's best square bf16 GEMM over n 1024..10240 equals torch_square_gemm.csv "
            f"'NVIDIA A100 SXM4 80GB' bf16 (264.53 TFLOP/s, the only A100 GEMM data); held out (fp16 column, A800 "
            f"SXM4 rows): {e.get('bf16', {}).get('held_out')}% over {e.get('bf16', {}).get('n_held_out')}")
        for key in ("gemm.bf16.wave_overhead_us", "gemm.bf16.full_rate_reuse", "gemm.launch_us"):
            p[key] = _p("transferred", f"{h100_t}: no A100 per-shape GEMM table; A100 CTAs also run one 128x256 "
                        "(or smaller) tile per SM, so the fixed costs per wave and kernel are taken as H100's")
        p["gemm.tf32"] = _p("transferred", f"{h100_t}: no A100 tf32 measurement (torch's fp32 column is FP32 SIMT)")
    return p


def _attention_provenance(name: str, errors: dict, att: AttentionModel) -> dict:
    fa3 = "FlashAttention-3 rows of flash_attention.csv (H100; tritonbench PR1254/PR1267, FA issue 1438)"
    fit_err = ", ".join(f"{lab} fit {v.get('fit')}% / held-out {v.get('held_out')}% over {v.get('n_fit', 0)}+"
                        f"{v.get('n_held_out', 0)}" for lab, v in errors.items())
    fp8 = _p("assumed", f"{FA3_FP8_SPEEDUP}: the FA3 abstract's FP8 and FP16 headline maxima (about 1200 and 740 "
             "TFLOP/s, flash_attention.csv FA3-abstract), a ratio of two maxima, not a fit; training runs attention in "
             "bf16 under FP8 recipes (Transformer Engine's default), so it is rarely used")
    p: dict[str, dict] = {}
    if name == kd.H100:
        for f in _ATT_FIELDS:
            p[f"attention.{f}"] = _p("fitted", f"least squares on log time of the fit rows of the {fa3} (split "
                                     f"{SPLIT}): {fit_err}")
        p["attention.fp8_speedup"] = fp8
    elif name == kd.B200:
        for f in ("fwd_vs_gemm", "bwd_vs_gemm"):
            p[f"attention.{f}"] = _p("fitted", "least squares on log time of the FlashAttention-4 fit rows of "
                                     "flash_attention.csv (SM100, flash-attention PR 2280; hd 128, s 8192; fwd and the "
                                     f"fastest non-deterministic bwd; split {SPLIT}): {fit_err}")
        for f in ("fwd_cta_us", "bwd_cta_us"):
            p[f"attention.{f}"] = _p("transferred", "from h100-sxm-80gb's FA3 fit: B200's rows are all one shape "
                                     "(hd 128, s 8192), which does not identify per-CTA costs")
        p["attention.softmax_headdim"] = _p("assumed", "0: FlashAttention-4 overlaps the softmax with Blackwell's "
                                            "asynchronous MMAs (and emulates part of exp2 on the FMA units); B200's "
                                            "rows are all hd 128, which does not identify it")
        p["attention.fp8_speedup"] = _p("assumed", "h100-sxm-80gb's FA3 headline ratio (no FP8 FA4 measurement)")
    elif name == kd.H200:
        for f in _ATT_FIELDS:
            p[f"attention.{f}"] = _p("transferred", f"from h100-sxm-80gb's fit on the {fa3}: GH100 silicon; the H200 "
                                     f"row (FA issue 1438) is held out: {fit_err}")
        p["attention.fp8_speedup"] = fp8
    else:
        for f in ("fwd_vs_gemm", "bwd_vs_gemm"):
            p[f"attention.{f}"] = _p("assumed", "solved so that the model gives FlashAttention-2's A100 maxima (Dao "
                                     "2023: 73% of peak forward, 63% backward, hd 128, long sequences) at hd 128, s "
                                     "16384; no A100 flash-attention measurement in the reference folder")
        for f in ("fwd_cta_us", "bwd_cta_us", "softmax_headdim"):
            p[f"attention.{f}"] = _p("transferred", "from h100-sxm-80gb's FA3 fit (no A100 attention data)")
    return p


def _attention_checks(hw: Hardware, att: AttentionModel, fraction: float, launch: float, bw: float) -> dict:
    """The model at FA3's headline benchmark (hd 64/128/256, 16k tokens per batch, hidden 2048)."""
    best = {}
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            call = AttentionCall(max(1, 16384 // s), 2048 // d, s, s, d, False, False, False)
            t = attention_time(att, fraction, hw.peak_tflops.bf16, hw.compute_model.sm_count, launch, call, bw)
            best[f"hd{d}"] = max(best.get(f"hd{d}", 0.0), 4.0 * call.batch * call.heads * s * s * d / t / 1e6)
    out = {"fa3_headline_fwd_bf16_model_max_tflops": best}
    if att.fp8_speedup:
        out["fa3_headline_fwd_fp8_model_max_tflops"] = {k: v * att.fp8_speedup for k, v in best.items()}
    return out


def compress(cm: dict, prov: dict[str, dict]) -> dict[str, dict]:
    """Provenance by leaf, written once for a group (gemm.<format>, attention) where two or more of its
    leaves share one, the other leaves named apart (a leaf's own entry wins, ComputeModel.provenance_of)."""
    leaves = _leaf_names(cm)
    by_leaf = {}
    for leaf in leaves:
        parts = leaf.split(".")
        entry = next((prov[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in prov), None)
        if entry is None:
            raise ValueError(f"no provenance for {leaf}")
        by_leaf[leaf] = entry
    out: dict[str, dict] = {}
    groups: dict[str, list[str]] = {}
    for leaf in leaves:
        parts = leaf.split(".")
        group = ".".join(parts[:2]) if parts[0] == "gemm" and len(parts) == 3 else parts[0] if len(parts) > 1 else leaf
        groups.setdefault(group, []).append(leaf)
    for group, members in groups.items():
        common = max((by_leaf[m] for m in members), key=lambda e: sum(by_leaf[m] == e for m in members))
        if len(members) > 1 and sum(by_leaf[m] == common for m in members) > 1:
            out[group] = dict(common)
            out.update({m: dict(by_leaf[m]) for m in members if by_leaf[m] != common})
        else:
            out.update({m: dict(by_leaf[m]) for m in members})
    return out


def _leaf_names(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        out.extend(_leaf_names(v, f"{name}.") if isinstance(v, dict) else [name])
    return out


def _same_silicon(name: str, root: Path | None, config_root: Path | None) -> dict:
    source, silicon = SAME_SILICON[name]
    src = fit_kernels(source, root, config_root)
    cm = {k: v for k, v in src["compute_model"].items() if k != "provenance"}
    prov = {leaf: _p("transferred", f"{silicon}: {source}'s value ({src_p['status']} there)")
            for leaf in _leaf_names(cm)
            for src_p in [_provenance_of(src["compute_model"]["provenance"], leaf)]}
    if name in SAME_DIE:  # the same achieved TFLOP/s: fractions of this part's own (higher) peaks
        mine = hardware_for_fit(name, config_root).peak_tflops
        theirs = hardware_for_fit(source, config_root).peak_tflops
        gemm = dict(cm["gemm"])
        for key, peak in _RATE_PEAK.items():
            if isinstance(gemm.get(key), dict):
                scale = getattr(theirs, peak) / getattr(mine, peak)
                theirs_fraction = gemm[key]["peak_fraction"]
                gemm[key] = {**gemm[key], "peak_fraction": _sig(theirs_fraction * scale)}
                prov[f"gemm.{key}.peak_fraction"] = _p(
                    "transferred", f"{silicon}: {source}'s achieved rate, its value {theirs_fraction:.4g} (fitted "
                    f"there) x its {peak} peak {getattr(theirs, peak):g} / this part's {getattr(mine, peak):g} TFLOP/s")
        cm = {**cm, "gemm": gemm}
    return {"hardware": name, "split": SPLIT, "compute_model": {**cm, "provenance": prov}, "fitted": [],
            "errors": {}, "checks": {}, "transferred_from": source}


def _provenance_of(prov: dict, leaf: str) -> dict:
    parts = leaf.split(".")
    return next(prov[".".join(parts[:i])] for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in prov)


def check_file(hw: Hardware, fit: dict, rel: float = 1e-3) -> list[str]:
    """'parameter: file x, fit y' for each compute-model value of ``hw`` that differs from ``fit``'s."""
    want = fit["compute_model"]
    out = []
    for leaf in _leaf_names({k: v for k, v in want.items() if k != "provenance"}):
        expected = _provenance_value(want, leaf)
        try:
            got = hw.compute_model.value(leaf)
        except AttributeError:
            got = None
        if got is None or not math.isclose(float(got), float(expected), rel_tol=rel, abs_tol=1e-9):
            out.append(f"{leaf}: file {got}, fit {expected}")
    extra = set(hw.compute_model.parameter_names()) - set(_leaf_names({k: v for k, v in want.items()
                                                                       if k != "provenance"}))
    out += [f"{p}: in the file, not given by the fit" for p in sorted(extra)]
    return out


def _provenance_value(cm: dict, leaf: str):
    out = cm
    for part in leaf.split("."):
        out = out[part]
    return out


# --- the hardware file's section -------------------------------------------------------------------
def compute_model_section(doc: dict, code: str | None) -> dict:
    """The compute_model mapping of a hardware file from a fit report (fitted_by when it fitted any)."""
    cm = dict(doc["compute_model"])
    prov = cm.pop("provenance")
    statuses = sorted({v["status"] for v in prov.values()})
    source = (f"kernel model fitted by echo.fit.kernels on the reference kernel tables (split {SPLIT}); "
              f"provenance per parameter: {', '.join(statuses)}" if doc["fitted"] else
              f"every parameter transferred from {doc.get('transferred_from')} ({SAME_SILICON.get(doc['hardware'], ('', ''))[1].split(' (')[0]})")
    out = {**cm, "source": source}
    if doc["fitted"]:
        out["fitted_by"] = {"fit": f"results/fit/{doc['hardware']}.json", "parameters": sorted(doc["fitted"]),
                            "code": code}
    out["provenance"] = prov
    return out


def write_compute_model(path: Path, doc: dict, code: str | None) -> None:
    """Replace the compute_model section (the file's last top-level key) of hardware file ``path``."""
    import yaml

    text = path.read_text()
    head = text[:text.index("\ncompute_model:") + 1] if "\ncompute_model:" in text else text
    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:  # write shared provenance out, no &anchors
            return True

    body = yaml.dump({"compute_model": compute_model_section(doc, code)}, Dumper=Dumper, sort_keys=False,
                     width=110, allow_unicode=True)
    note = "# compute_model: written by `python -m echo fit --write` from the fit (echo.fit.kernels); do not edit by hand\n"
    # the note is written once: a re-run finds it above the section and keeps the head as it is
    head = "".join(line for line in head.splitlines(keepends=True) if line != note)
    path.write_text(head + note + body)
