"""Modelled duration of one kernel on a GPU, from the hardware file's figures alone.

- GEMMs (mm, addmm, bmm, baddbmm, _scaled_mm, _scaled_grouped_mm): echo.profile.gemm_model - a
  launch floor plus waves of CTA tiles at the input format's fitted main-loop rate, or the operands'
  bytes at the achievable HBM bandwidth when that is longer.
- Flash attention (forward and backward): echo.profile.attention_model - CTAs of 128-query
  (128-key) blocks looping over the other side, causal masks skipping the blocks above the diagonal.
- Every other kernel (elementwise, norm, softmax, embedding, copies, optimizer updates, ...) streams
  its bytes: ``kernel_launch_us + bytes / (hbm_GBps * hbm_efficiency)``.

The parameters are Hardware.compute_model's (GPU files: ``gemm`` and ``attention``, fitted on
per-kernel measurements by echo.fit.kernels, each with its provenance). A nominal device (the local
CPU, test hardware) gives ``matmul_efficiency`` instead; its GEMMs use the NOMINAL_* tile constants.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from echo.config import Hardware
from echo.config.hardware import AttentionModel, GemmRate
from echo.profile.attention_model import AttentionCall, attention_call, attention_time
from echo.profile.gemm_model import GEMM_OPS, GemmCall, gemm_call, gemm_time
from echo.profile.kernel import Kernel

# A nominal device's GEMM tiles (no per-GPU fit): a wave costs 1 us of fill and epilogue, 128x128
# tiles (reuse 64) run at full rate. Assumed; GPU files carry fitted values instead.
NOMINAL_WAVE_OVERHEAD_US = 1.0
NOMINAL_FULL_RATE_REUSE = 64.0
# ... and its flash attention runs at its GEMM rate with no per-CTA or softmax cost.
NOMINAL_ATTENTION = AttentionModel(fwd_vs_gemm=1.0, bwd_vs_gemm=1.0, fwd_cta_us=0.0, bwd_cta_us=0.0,
                                   softmax_headdim=0.0, fp8_speedup=2.0)
# A causal flash kernel skips the blocks above the diagonal: it executes about half the model FLOPs
# (which, following the MFU convention, do not halve for causal masking).
CAUSAL_FRACTION = 0.5

# torch dtype name -> peak_tflops key; fp32 matmuls run on tf32 tensor cores where the GPU has them
_PEAK_KEY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp32"}
# GEMM format -> (peak_tflops key, gemm rate key, block-scaling factor key)
_FORMAT = {"bf16": ("bf16", "bf16", None), "fp8": ("fp8", "fp8", None), "mxfp8": ("fp8", "fp8", "mxfp8"),
           "blockwise_fp8": ("fp8", "fp8", "blockwise_fp8"), "nvfp4": ("fp4", "fp4", None)}


@dataclass(frozen=True)
class Estimate:
    """A modelled duration and what bounds it."""

    duration_us: float
    bound: str          # compute | memory | launch
    efficiency: float   # executed FLOPs / (peak x duration): the fraction of peak achieved (0: no FLOPs)


def estimate(hw: Hardware, k: Kernel) -> Estimate:
    """Duration of kernel ``k`` on ``hw`` (see the module docstring)."""
    # a GEMM op the tracer does not class as one yet (_scaled_grouped_mm) is still a GEMM here
    if k.op_class == "gemm" or k.base in GEMM_OPS:
        call = gemm_call(k.base, k.args) or _call_from_shapes(k)
        if call is not None:
            return gemm_estimate(hw, call)
    if k.op_class == "attention":
        call = attention_call(k.name, k.args, _flag(k, "is_causal"))
        if call is not None:
            return _attention_estimate(hw, k, call)
    return _stream_estimate(hw, k)


def peak_tflops(hw: Hardware, dtype: str) -> float:
    """Dense tensor-core peak for a matmul with ``dtype`` inputs (a torch dtype name, or a GEMM
    format of gemm_model: fp8, mxfp8, blockwise_fp8, nvfp4); fp32 runs on tf32 tensor cores when
    present. ValueError when the GPU has no tensor cores for it (FP8 on A100, FP4 before Blackwell)."""
    peaks = hw.peak_tflops
    if dtype == "float32" and peaks.tf32 is not None:
        return peaks.tf32
    if dtype.startswith("float8") or dtype in _FORMAT:
        key = _FORMAT.get(dtype, ("fp8",))[0]
    elif dtype.startswith("float4"):
        key = "fp4"
    else:
        key = _PEAK_KEY.get(dtype, "fp32")
    peak = getattr(peaks, key)
    if peak is None:
        raise ValueError(f"hardware '{hw.name}' has no {key.upper()} tensor cores (peak_tflops.{key} is not set): "
                         f"it cannot run a {dtype} matmul")
    return peak


def executed_flops(k: Kernel) -> float:
    """FLOPs the kernel actually executes: a GEMM's 2*M*N*K over its logical K (NVFP4 packs two
    values per byte); causal flash attention skips half the model FLOPs."""
    if k.op_class == "gemm" or k.base in GEMM_OPS:
        call = gemm_call(k.base, k.args)
        return call.flops if call is not None else k.flops
    if k.op_class == "attention" and _flag(k, "is_causal"):
        return k.flops * CAUSAL_FRACTION
    return k.flops


def gemm_dims(base: str, shapes: list[list[int]]) -> tuple[int, int, int, int] | None:
    """(batch, M, N, K) of a GEMM from its input shapes, or None when the op is not recognised."""
    first = {"mm": 0, "_scaled_mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}.get(base)
    if first is None or len(shapes) < first + 2:
        return None
    a, b = shapes[first], shapes[first + 1]
    if len(a) == 2 and len(b) == 2:
        return 1, a[0], b[1], a[1]
    if len(a) == 3 and len(b) == 3:
        return a[0], a[1], b[2], a[2]
    return None


def wave_efficiency(ctas: int, sms: int) -> float:
    """Busy fraction of SM-time when ``ctas`` equal CTAs run in waves of ``sms``: the last wave
    of a grid of sms+1 CTAs runs one CTA while the other SMs idle."""
    return ctas / (math.ceil(ctas / sms) * sms)


def gemm_rate(hw: Hardware, fmt: str) -> tuple[float, GemmRate, float]:
    """(peak TFLOP/s, GemmRate, block-scaling factor) of GEMM format ``fmt`` on ``hw``; ValueError
    when the GPU has no tensor cores or no fitted rate for it."""
    cm = hw.compute_model
    if cm.gemm is None:  # nominal device
        peak = peak_tflops(hw, {"bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}.get(fmt, fmt))
        return peak, GemmRate(peak_fraction=cm.matmul_efficiency, wave_overhead_us=NOMINAL_WAVE_OVERHEAD_US,
                              full_rate_reuse=NOMINAL_FULL_RATE_REUSE), 1.0
    if fmt in ("fp32", "fp64", "fp32_simt"):
        # fp32_simt: an fp32 GEMM on the CUDA cores (cuBLAS sgemm, PyTorch's default while
        # allow_tf32 is off), at the fp32 peak with the bf16 tile costs, as fp64 is
        tf32 = fmt == "fp32" and hw.peak_tflops.tf32 is not None and cm.gemm.tf32 is not None
        return (hw.peak_tflops.tf32, cm.gemm.tf32, 1.0) if tf32 else (hw.peak_tflops.fp32, cm.gemm.bf16, 1.0)
    peak_key, rate_key, factor_key = _FORMAT[fmt]
    peak = peak_tflops(hw, fmt)
    rate = getattr(cm.gemm, rate_key)
    factor = getattr(cm.gemm, factor_key) if factor_key else 1.0
    if rate is None or factor is None:
        missing = f"gemm.{rate_key}" if rate is None else f"gemm.{factor_key}"
        raise ValueError(f"hardware '{hw.name}' has no {missing} in its compute_model: no {fmt} GEMM rate")
    return peak, rate, factor


def gemm_launch_us(hw: Hardware, fmt: str) -> float:
    """Fixed time of a GEMM kernel of format ``fmt`` on ``hw``: blockwise FP8 has its own where fitted
    (its kernels are another library's), every other format the GPU's gemm.launch_us."""
    cm = hw.compute_model
    if cm.gemm is None:
        return cm.kernel_launch_us
    if fmt == "blockwise_fp8" and cm.gemm.blockwise_launch_us is not None:
        return cm.gemm.blockwise_launch_us
    return cm.gemm.launch_us


# --- the three kinds of kernel ----------------------------------------------------------------
def gemm_estimate(hw: Hardware, call: GemmCall) -> Estimate:
    """Duration of one GEMM call on ``hw`` (echo.profile.gemm_model)."""
    cm = hw.compute_model
    peak, rate, factor = gemm_rate(hw, call.fmt)
    launch = gemm_launch_us(hw, call.fmt)
    t, compute, memory = gemm_time(rate, launch, peak, cm.sm_count, hw.hbm_GBps * cm.hbm_efficiency,
                                   call.batch, call.m, call.n, call.k, call.a_bytes, call.b_bytes,
                                   call.out_bytes, factor)
    t, compute, memory = float(t), float(compute), float(memory)
    bound = "launch" if max(compute, memory) < launch else "compute" if compute >= memory else "memory"
    return Estimate(t, bound, call.flops / (peak * 1e6 * t) if t > 0 else 0.0)


def _attention_estimate(hw: Hardware, k: Kernel, call: AttentionCall) -> Estimate:
    cm = hw.compute_model
    att = cm.attention or NOMINAL_ATTENTION
    fraction = cm.gemm.bf16.peak_fraction if cm.gemm is not None else cm.matmul_efficiency
    dtype = "float8_e4m3fn" if call.fp8 else k.dtype
    peak = peak_tflops(hw, "bfloat16" if call.fp8 else dtype)  # fp8: the bf16 model times fp8_speedup
    if call.fp8:
        peak_tflops(hw, dtype)  # raises where the GPU has no FP8 tensor cores
        if att.fp8_speedup is None:
            raise ValueError(f"hardware '{hw.name}' has no attention.fp8_speedup: no FP8 attention rate")
    launch = gemm_launch_us(hw, "bf16")
    compute = attention_time(att, fraction, peak, cm.sm_count, launch, call, hw.hbm_GBps * cm.hbm_efficiency)
    memory = k.bytes / (hw.hbm_GBps * 1e3 * cm.hbm_efficiency)
    t = max(compute, launch + memory)
    bound = "compute" if compute >= launch + memory else "memory"
    return Estimate(t, bound, executed_flops(k) / (peak * 1e6 * t) if t > 0 else 0.0)


def _stream_estimate(hw: Hardware, k: Kernel) -> Estimate:
    """A kernel that streams its bytes (FLOPs of another class, which the trace does not count,
    at the bf16 GEMM main-loop rate, to be safe)."""
    cm = hw.compute_model
    memory_us = k.bytes / (hw.hbm_GBps * 1e3 * cm.hbm_efficiency)
    compute_us, eff = 0.0, 0.0
    if k.flops > 0:
        eff = cm.gemm.bf16.peak_fraction if cm.gemm is not None else cm.matmul_efficiency
        compute_us = k.flops / (peak_tflops(hw, k.dtype) * 1e6 * eff)
    body = max(compute_us, memory_us)
    bound = "launch" if body < cm.kernel_launch_us else "compute" if compute_us >= memory_us else "memory"
    t = body + cm.kernel_launch_us
    return Estimate(t, bound, k.flops / (peak_tflops(hw, k.dtype) * 1e6 * t) if k.flops > 0 else 0.0)


# --- reading the call -----------------------------------------------------------------------
def _call_from_shapes(k: Kernel) -> GemmCall | None:
    """A GEMM whose args the model cannot read: its dims from the shapes column and its dtype."""
    try:
        shapes = json.loads(k.shapes)
    except (TypeError, ValueError):
        return None
    dims = gemm_dims(k.base, shapes) if isinstance(shapes, list) else None
    if dims is None:
        return None
    size = {"float32": 4.0, "float64": 8.0}.get(k.dtype, 2.0)
    fmt = {"float32": "fp32", "float64": "fp64"}.get(k.dtype, "fp8" if k.dtype.startswith("float8") else "bf16")
    size = 1.0 if fmt == "fp8" else size
    return GemmCall(*dims, fmt, size, size, 2.0 if fmt == "fp8" else size)


def _flag(k: Kernel, arg_name: str) -> bool:
    """A bool argument of the call by schema name (False when absent or unreadable)."""
    from echo.profile.rebuild import bind_raw  # torch import kept out of the pure-model path

    try:
        return bool(bind_raw(k.name, k.args).get(arg_name, False))
    except Exception:  # an op torch does not know: assume the flag is off
        return False
