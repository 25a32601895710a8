"""Roofline model of one kernel's duration on a GPU, from the hardware file's figures alone.

    time = max(flops_executed / (peak[dtype] * efficiency(shape)), bytes / (hbm_GBps * hbm_efficiency))
           + kernel_launch_us

``matmul_efficiency`` in the hardware file is the best fraction of peak a large GEMM reaches
(hardware.csv), ``sustained_compute`` the part of it a training job sustains; ``efficiency(shape)`` scales it down for shapes a GPU cannot fill: partially filled
output tiles, a last wave of tiles that leaves SMs idle, and a K too short to amortise the tile's
pipeline fill and epilogue. Attention is a GEMM-like flash kernel at a lower efficiency (unfused
attention, ``model.attention: math`` in the workload, is traced as its own GEMMs, softmax and
dropout kernels and costed as such). Every other class (elementwise, norm, softmax, embedding,
copies, optimizer updates, ...) streams its bytes.
Tile sizes and factors below are properties of GEMM kernels, not of one GPU, so they live here as
named constants; everything per-GPU comes from ``Hardware``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from echo.config import Hardware
from echo.profile.kernel import Kernel

# CTA output tiles (M x N) a cuBLAS/CUTLASS-style heuristic chooses among for a given shape. One
# CTA per SM per wave: the large tiles that reach peak fill most of an SM's shared memory.
GEMM_TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
# Operand reuse (tm*tn/(tm+tn): FLOPs per element loaded into shared memory) at which a tile keeps
# the tensor cores busy. 128x128 (reuse 64) is the smallest tile peak-class GEMMs use on A100/H100;
# smaller tiles run at reuse/64 of the rate (128x64 at 0.67, 64x64 at 0.5).
FULL_RATE_REUSE = 64.0
# Per-tile fixed cost, in units of K: about two 32-deep k-blocks of pipeline fill and drain plus the
# epilogue. Efficiency from K alone is K / (K + K_OVERHEAD): K=4096 -> 0.98, K=128 -> 0.67.
K_OVERHEAD = 64.0
# Flash attention relative to the best GEMM on the same GPU. FlashAttention-2 (Dao 2023) reaches
# ~73% of A100 peak forward and ~63% backward, where the best GEMM reaches 87% (hardware.csv).
ATTENTION_FWD_VS_GEMM = 0.84
ATTENTION_BWD_VS_GEMM = 0.72
# Flash kernels tile the sequence in blocks of 128 queries (forward) / keys (backward); one CTA per
# (batch, head, block).
ATTENTION_BLOCK = 128
# A causal flash kernel skips the blocks above the diagonal: it executes about half the model FLOPs
# (which, following the MFU convention, do not halve for causal masking).
CAUSAL_FRACTION = 0.5

# torch dtype name -> peak_tflops key. fp32 matmuls use tf32 where the GPU has it (peak_tflops).
# The hardware schema has no fp8 or fp64 peak: fp8 is modelled at the bf16 rate (conservative),
# fp64 at the fp32 rate (optimistic; fp64 is not a training dtype here).
_PEAK_KEY = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp32"}


@dataclass(frozen=True)
class Estimate:
    """A modelled duration and what bounds it."""

    duration_us: float
    bound: str          # compute | memory | launch
    efficiency: float   # fraction of peak the compute term assumed (0 when no FLOPs)


def estimate(hw: Hardware, k: Kernel) -> Estimate:
    """Duration of kernel ``k`` on ``hw`` by the roofline above."""
    cm = hw.compute_model
    eff = compute_efficiency(hw, k) if k.flops > 0 else 0.0
    compute_us = executed_flops(k) / (peak_tflops(hw, k.dtype) * 1e6 * eff) if eff > 0 else 0.0
    memory_us = k.bytes / (hw.hbm_GBps * 1e3 * cm.hbm_efficiency)
    body = max(compute_us, memory_us)
    if body < cm.kernel_launch_us:
        bound = "launch"
    else:
        bound = "compute" if compute_us >= memory_us else "memory"
    return Estimate(body + cm.kernel_launch_us, bound, eff)


def peak_tflops(hw: Hardware, dtype: str) -> float:
    """Dense peak for a matmul in ``dtype``; fp32 matmuls run on tf32 tensor cores when present."""
    peaks = hw.peak_tflops
    if dtype == "float32" and peaks.tf32 is not None:
        return peaks.tf32
    key = "bf16" if dtype.startswith("float8") else _PEAK_KEY.get(dtype, "fp32")
    return getattr(peaks, key)


def compute_efficiency(hw: Hardware, k: Kernel) -> float:
    """Fraction of peak the FLOPs of ``k`` run at, by op class and shape."""
    best = hw.compute_model.matmul_efficiency * hw.compute_model.sustained_compute
    sms = hw.compute_model.sm_count
    if k.op_class == "gemm":
        dims = gemm_dims(k.base, _shapes(k))
        return best * (gemm_shape_efficiency(*dims, sms) if dims else 1.0)
    if k.op_class == "attention":
        backward = "backward" in k.base
        factor = ATTENTION_BWD_VS_GEMM if backward else ATTENTION_FWD_VS_GEMM
        ctas = attention_ctas(_shapes(k), backward)
        return best * factor * (wave_efficiency(ctas, sms) if ctas else 1.0)
    # FLOPs on another class (the trace counts matmul-class only, but be safe): best GEMM rate.
    return best


def executed_flops(k: Kernel) -> float:
    """FLOPs the kernel actually executes: causal flash attention skips half the model FLOPs."""
    if k.op_class == "attention" and _flag(k, "is_causal"):
        return k.flops * CAUSAL_FRACTION
    return k.flops


# --- GEMM shape efficiency -----------------------------------------------------------------
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


def gemm_shape_efficiency(batch: int, m: int, n: int, k: int, sms: int) -> float:
    """Best over candidate tiles of (tile rate x tile fill x wave fill), times the K factor."""
    if min(batch, m, n, k) <= 0:
        return 1.0
    best = max(_tile_efficiency(batch, m, n, tm, tn, sms) for tm, tn in GEMM_TILES)
    return best * k / (k + K_OVERHEAD)


def _tile_efficiency(batch: int, m: int, n: int, tm: int, tn: int, sms: int) -> float:
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    fill = (m * n) / (tiles_m * tm * tiles_n * tn)  # padded rows/columns of edge tiles do no work
    rate = min(1.0, (tm * tn / (tm + tn)) / FULL_RATE_REUSE)
    return rate * fill * wave_efficiency(batch * tiles_m * tiles_n, sms)


def wave_efficiency(ctas: int, sms: int) -> float:
    """Busy fraction of SM-time when ``ctas`` equal CTAs run in waves of ``sms``: the last wave
    of a grid of sms+1 CTAs runs one CTA while the other SMs idle."""
    waves = math.ceil(ctas / sms)
    return ctas / (waves * sms)


def attention_ctas(shapes: list[list[int]], backward: bool) -> int | None:
    """CTAs of a flash kernel: (batch x heads) x sequence blocks (queries fwd, keys bwd)."""
    q_i = 1 if backward else 0  # backward takes grad_out first
    if len(shapes) < q_i + 2 or len(shapes[q_i]) != 4:
        return None
    b, h, s_q, _ = shapes[q_i]
    s = shapes[q_i + 1][-2] if backward else s_q
    return b * h * math.ceil(s / ATTENTION_BLOCK)


# --- reading the call -----------------------------------------------------------------------
def _shapes(k: Kernel) -> list[list[int]]:
    try:
        shapes = json.loads(k.shapes)
    except (TypeError, ValueError):
        return []
    return shapes if isinstance(shapes, list) else []


def _flag(k: Kernel, arg_name: str) -> bool:
    """A bool argument of the call by schema name (False when absent or unreadable)."""
    from echo.profile.rebuild import bind_raw  # torch import kept out of the pure-model path

    try:
        return bool(bind_raw(k.name, k.args).get(arg_name, False))
    except Exception:  # an op torch does not know: assume the flag is off
        return False
