"""Time of one GEMM kernel on a GPU: a launch floor plus waves of CTA output tiles.

    time = launch_us + (compute^4 + memory^4)^(1/4)          (a smooth max, see OVERLAP_P)
    compute = waves x (wave_overhead_us + 2*tm*tn*(K/split) / (peak/SMs * peak_fraction * tile_rate * recipe))
    memory  = (A + B + C bytes, plus split-K partial sums) / (hbm_GBps * hbm_efficiency)

A cuBLAS/CUTLASS-style kernel gives each CTA one tm x tn output tile and runs one CTA per SM; the
grid (batch x tiles, times the split-K factor) runs in ``waves = ceil(CTAs / SMs)``. Each wave costs
a fixed pipeline fill plus epilogue (``wave_overhead_us``) and its K loop at the format's achieved
main-loop rate (``peak_fraction`` of the dense tensor-core peak). Tiles whose operand reuse
tm*tn/(tm+tn) is below ``full_rate_reuse`` run proportionally slower (their operand traffic limits
them). The library's heuristic is modelled as the best (tile, split-K) pair for the shape; split-K
is considered only for grids that fill at most one wave (it exists to fill the GPU) and keeps each
split at least MIN_SPLIT_DEPTH deep. A memory-bound shape (skinny M, short K) runs at the achievable
HBM bandwidth instead. Every parameter is per GPU and input format (Hardware.compute_model.gemm),
fitted on measured per-shape GEMM times (echo.fit.kernels); the tile set and split rule are
properties of the GEMM libraries, constants here.

Formats (``GemmCall.fmt``), read from the call's operands, not from the trace's dtype column:
bf16 / fp16 -> gemm.bf16 at the bf16 peak; fp32 -> gemm.tf32 at the tf32 peak; float8 inputs with
scalar (or row/column) fp32 scales -> gemm.fp8 (per-tensor); float8_e8m0fnu scales -> MXFP8 (gemm.fp8
x gemm.mxfp8); 2-D fp32 block scales (a: (M, K/128)) -> blockwise FP8 (gemm.fp8 x
gemm.blockwise_fp8, with DeepGEMM's fixed time gemm.blockwise_launch_us where fitted);
float4_e2m1fn_x2 inputs -> NVFP4 (gemm.fp4 at the fp4 peak; the operands pack two values per byte,
so the logical K is twice the shapes' K).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

# CTA output tiles (M x N) the libraries' heuristics choose among. 128x256 / 256x128 are the
# peak-rate Hopper/Blackwell tiles (one CTA, or one CTA pair on Blackwell, per SM); the smaller
# ones serve small or skinny outputs.
TILES = ((128, 256), (256, 128), (128, 128), (128, 64), (64, 128), (64, 64))
SPLIT_K = (1, 2, 4, 8, 16)
# a split-K slice shallower than this would be all pipeline fill
MIN_SPLIT_DEPTH = 128
# fp32 partial sums of split-K, written by the slices and read back by the reduction
PARTIAL_BYTES = 4

_FLOAT8 = {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
_FP4 = {"float4_e2m1fn_x2"}
_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# operand positions (a, b) of each GEMM op and of its scales
_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "_scaled_mm": (0, 1),
             "_scaled_grouped_mm": (0, 1)}
_OUT_DTYPE_AT = {"_scaled_mm": 6, "_scaled_grouped_mm": 7}
GEMM_OPS = frozenset(_OPERANDS)


@dataclass(frozen=True)
class GemmCall:
    """One GEMM as the model sees it: batch x (M x K) @ (K x N), logical K, bytes per element."""

    batch: int
    m: int
    n: int
    k: int
    fmt: str            # bf16 | fp32 (tf32 cores) | fp32_simt | fp64 | fp8 | mxfp8 | blockwise_fp8 | nvfp4
    a_bytes: float      # bytes per element of A and B as stored (fp4: 0.5; scales ignored, < 1%)
    b_bytes: float
    out_bytes: float

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def bytes(self) -> float:
        b = self.batch
        return b * (self.m * self.k * self.a_bytes + self.k * self.n * self.b_bytes + self.m * self.n * self.out_bytes)


def gemm_call(base: str, args_json: str) -> GemmCall | None:
    """The GemmCall of a traced call (``Kernel.base``, ``Kernel.args``), None when it is not a GEMM
    the model reads (unknown op, unexpected ranks)."""
    if base not in _OPERANDS:
        return None
    try:
        call = json.loads(args_json)
    except (TypeError, ValueError):
        return None
    args, kwargs = call.get("args", []), call.get("kwargs", {})
    ia, ib = _OPERANDS[base]
    if len(args) <= ib or not (_is_tensor(args[ia]) and _is_tensor(args[ib])):
        return None
    a, b = args[ia], args[ib]
    dims = _dims(base, a["T"], b["T"], [*args, kwargs.get("offs")])
    if dims is None:
        return None
    batch, m, n, k = dims
    dt_a, dt_b = a["dt"], b["dt"]
    fmt, out_bytes = _format(base, dt_a, args, kwargs)
    if fmt == "nvfp4":
        k *= 2  # two E2M1 values per byte: the shapes' K is half the logical K
    return GemmCall(batch, m, n, k, fmt, _element_bytes(dt_a), _element_bytes(dt_b), out_bytes)


def _is_tensor(x) -> bool:
    return isinstance(x, dict) and "T" in x and "dt" in x


def _dims(base: str, a: list, b: list, args: list) -> tuple[int, int, int, int] | None:
    if base == "_scaled_grouped_mm":
        if len(a) == 2 and len(b) == 3:  # MoE forward: tokens of G experts stacked (offs), one weight each
            groups = b[0]
            return groups, max(1, math.ceil(a[0] / groups)), b[2], a[1]
        if len(a) == 3 and len(b) == 3:
            return a[0], a[1], b[2], a[2]
        if len(a) == 2 and len(b) == 2:  # weight gradient: K split into groups by offs
            offs = next((x for x in args[2:] if _is_tensor(x) and x["dt"].startswith("int")), None)  # or offs=
            groups = offs["T"][0] if offs and offs["T"] else 1
            return groups, a[0], b[1], max(1, math.ceil(a[1] / groups))
        return None
    if len(a) == 2 and len(b) == 2:
        return 1, a[0], b[1], a[1]
    if len(a) == 3 and len(b) == 3:
        return a[0], a[1], b[2], a[2]
    return None


def _format(base: str, dtype: str, args: list, kwargs: dict) -> tuple[str, float]:
    """(format, output bytes per element) of the call, from A's dtype and, for FP8, its scales."""
    if base not in ("_scaled_mm", "_scaled_grouped_mm") or (dtype not in _FLOAT8 and dtype not in _FP4):
        fmt = {"float32": "fp32", "float64": "fp64"}.get(dtype, "bf16")
        return fmt, float(_BYTES.get(dtype, 2))
    # out_dtype is a keyword of both ops; positional it comes after bias and scale_result
    out = kwargs.get("out_dtype", args[_OUT_DTYPE_AT[base]] if len(args) > _OUT_DTYPE_AT[base] else None)
    out_name = out.get("S", "") if isinstance(out, dict) else str(out or "")
    out_bytes = float(_BYTES.get(out_name.removeprefix("torch."), 2))  # bf16 output unless said
    if dtype in _FP4:
        return "nvfp4", out_bytes
    scale = args[2] if len(args) > 2 and _is_tensor(args[2]) else None
    if scale is not None and scale["dt"].startswith("float8_e8m0"):
        return "mxfp8", out_bytes
    if scale is not None and scale["dt"] == "float32" and len(scale["T"]) == 2 and min(scale["T"]) > 1:
        return "blockwise_fp8", out_bytes  # (M, K/128) activation scales; rowwise (M, 1) is per-tensor-like
    return "fp8", out_bytes


def _element_bytes(dtype: str) -> float:
    if dtype in _FP4:
        return 0.5
    if dtype in _FLOAT8:
        return 1.0
    return float(_BYTES.get(dtype, 2))


# How a pipelined kernel joins its compute and memory times: max() when one dominates, but near
# the ridge point neither hides the other fully. A p-norm with p = 4 (of {inf, 8, 4, 3} tried, the
# one the fit shapes of the XLA and DeepGEMM tables preferred without inflating peak_fraction
# above the measured large-GEMM ceiling) adds 19% at the ridge and under 1% at a 2:1 ratio.
OVERLAP_P = 4.0


def _join(compute, memory):
    return (compute**OVERLAP_P + memory**OVERLAP_P) ** (1 / OVERLAP_P)


# --- the time --------------------------------------------------------------------------------
def gemm_time(rate, launch_us: float, peak_tflops: float, sms: int, hbm_GBps: float, batch, m, n, k,
              a_bytes, b_bytes, out_bytes, recipe: float = 1.0):
    """(time, compute, memory) in microseconds of GEMMs of these dims (scalars or equal-shaped
    arrays); ``rate``: a GemmRate (peak_fraction, wave_overhead_us, full_rate_reuse); ``hbm_GBps``:
    the achievable bandwidth; ``recipe``: the main-loop factor of a block-scaled format (1 otherwise)."""
    batch, m, n, k = (np.asarray(x, dtype=float) for x in (batch, m, n, k))
    sm_rate = peak_tflops * 1e12 / sms * rate.peak_fraction * recipe  # FLOP/s of one SM's main loop
    base_bytes = batch * (m * k * a_bytes + k * n * b_bytes + m * n * out_bytes)
    best = np.full(np.broadcast(batch, m, n, k).shape, np.inf)
    best_compute = best.copy()
    best_memory = best.copy()
    for tm, tn in TILES:
        tile_rate = min(1.0, tm * tn / (tm + tn) / rate.full_rate_reuse)
        tiles = batch * np.ceil(m / tm) * np.ceil(n / tn)
        for split in SPLIT_K:
            ctas = tiles * split
            depth = k / split
            compute = np.ceil(ctas / sms) * (rate.wave_overhead_us * 1e-6 + 2.0 * tm * tn * depth / (sm_rate * tile_rate))
            extra = batch * m * n * PARTIAL_BYTES * 2 * split if split > 1 else 0.0
            memory = (base_bytes + extra) / (hbm_GBps * 1e9)
            t = _join(compute, memory)
            if split > 1:  # split only to fill one wave, never below the minimum depth
                t = np.where((ctas <= sms) & (depth >= MIN_SPLIT_DEPTH), t, np.inf)
            better = t < best
            best = np.where(better, t, best)
            best_compute = np.where(better, compute, best_compute)
            best_memory = np.where(better, memory, best_memory)
    return launch_us + best * 1e6, best_compute * 1e6, best_memory * 1e6
