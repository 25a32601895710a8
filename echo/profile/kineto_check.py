"""A hardware model's error on the kernels of a real GPU trace: per-kernel ground truth.

Each op event of an imported trace (echo.profile.gpu_trace) that launched GEMM, elementwise or
copy kernels is a measurement: its GPU time (the summed duration of the kernels it launched, e.g.
a GEMM and its split-K reduction) against the roofline estimate of the same op on the same shapes
(echo.profile.roofline). Events of one (op, shapes, dtype, format) are pooled by their median,
apart for events that ran alone and events beside another stream's kernel (an NCCL all-to-all
takes SMs and HBM bandwidth: those are overlap slowdowns, not the kernel model's error).

The GEMM format is read from the kernel's name, not from the dtype alone: an fp32 GEMM runs on
TF32 tensor cores (``tensorop_s1688gemm``, ``tf32``) only where the job allowed it
(``torch.backends.cuda.matmul.allow_tf32``, off by default since PyTorch 1.12); otherwise on the CUDA
cores (``sgemm``), at the fp32 peak.

Elementwise and copy ops stream their bytes: every tensor input at its recorded dtype plus one
output of the broadcast shape at the first input's dtype (an in-place op writes its first input).
Scalars and 0-d tensors (recorded with no dims) count nothing; ops that only write their first
input (``copy_``, ``fill_``) count their inputs alone.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from echo.config import Hardware
from echo.profile import roofline
from echo.profile.gemm_model import GemmCall
from echo.profile.gpu_trace import DTYPE_BYTES
from echo.profile.kernel import Kernel

CHECKED_CLASSES = ("gemm", "elementwise", "copy")
# also streamed by the model (one output the size of the broadcast inputs), but not ground truth
# for it: a norm's backward writes several outputs, a softmax's reads its input twice
STREAMED_CLASSES = ("norm", "softmax")
# kernel-name marks of a tensor-core fp32 (TF32) GEMM; cuBLAS' split-K reduction carries none
_TF32_MARKS = ("tensorop_s1688", "tensorop_s16816", "tf32", "xmma_gemm_f32f32_tf32")
_SIMT_MARKS = ("sgemm", "simt_sgemm")
_REDUCTION_ONLY = "splitKreduce"
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_"}


def model_error(rows: list[dict], hw: Hardware) -> list[dict]:
    """One row per (rank, op, shapes, dtype, format) measured: median measured us, the model's us."""
    events: dict[tuple, dict] = {}
    for a in rows:
        if (a["kind"] != "kernel" or not a["launched"] or not a["with_shapes"]
                or a["op_class"] not in CHECKED_CLASSES):
            continue
        key = (a["rank"], a["op_ts_us"], a["op"], a["shapes"], a["dtype"])
        ev = events.setdefault(key, {"us": 0.0, "kernels": [], "class": a["op_class"],
                                     "input_bytes": a["input_bytes"], "isolated": True,
                                     "signature": a["signature"]})
        ev["us"] += a["dur_us"]
        ev["isolated"] &= a["concurrent_share"] == 0.0
        ev["kernels"].append(a["kernel"])
    pooled: dict[tuple, list[float]] = defaultdict(list)
    meta: dict[tuple, dict] = {}
    for (rank, _, op, shapes, dtype), ev in events.items():
        if ev["class"] == "gemm" and all(_REDUCTION_ONLY in k for k in ev["kernels"]):
            continue  # a GEMM event whose main-loop kernel the trace lost: only its split-K reduction
        fmt = gemm_format(dtype, ev["kernels"]) if ev["class"] == "gemm" else ""
        key = (rank, op, shapes, dtype, fmt, ev["isolated"])
        pooled[key].append(ev["us"])
        meta[key] = ev
    out = []
    for (rank, op, shapes, dtype, fmt, isolated), measured in sorted(pooled.items(), key=lambda kv: kv[0]):
        ev = meta[(rank, op, shapes, dtype, fmt, isolated)]
        est = event_estimate(hw, op, ev["class"], json.loads(shapes), dtype, fmt, ev["input_bytes"] or 0)
        if est is None:
            continue
        m = float(statistics.median(measured))
        cls = f"gemm ({fmt})" if fmt else ev["class"]
        out.append({"rank": rank, "op": op, "op_class": cls, "shapes": shapes, "dtype": dtype,
                    "isolated": isolated, "fmt": fmt, "signature": ev["signature"], "work": est.work,
                    "events": len(measured), "measured_us": m, "predicted_us": est.duration_us,
                    "error": est.duration_us / m - 1.0 if m > 0 else math.nan, "bound": est.bound})
    return out


def summarize(errors: list[dict]) -> dict[str, dict]:
    """Per op class: shapes checked, events, mean |error| and signed mean (by shape), the worst
    shape, and the error weighted by measured time (what it costs a step)."""
    by_class: dict[str, list[dict]] = defaultdict(list)
    for e in errors:
        if math.isfinite(e["error"]):
            by_class[e["op_class"] + ("" if e["isolated"] else ", beside another stream")].append(e)
    out = {}
    for cls, es in sorted(by_class.items()):
        worst = max(es, key=lambda e: abs(e["error"]))
        time_m = sum(e["measured_us"] * e["events"] for e in es)
        time_p = sum(e["predicted_us"] * e["events"] for e in es)
        out[cls] = {"shapes": len(es), "events": sum(e["events"] for e in es),
                    "mean_abs_error": statistics.fmean(abs(e["error"]) for e in es),
                    "mean_error": statistics.fmean(e["error"] for e in es),
                    "median_abs_error": statistics.median(abs(e["error"]) for e in es),
                    "time_weighted_error": time_p / time_m - 1.0 if time_m else None,
                    "worst_error": worst["error"], "worst_op": worst["op"], "worst_shapes": worst["shapes"],
                    "worst_measured_us": worst["measured_us"], "worst_predicted_us": worst["predicted_us"]}
    return out


def gemm_format(dtype: str | None, kernels: list[str]) -> str:
    """The GemmCall format of a measured GEMM: its dtype, and for fp32 the kernels' names."""
    if dtype in ("bfloat16", "float16"):
        return "bf16"
    if dtype == "float64":
        return "fp64"
    names = " ".join(kernels).lower()
    if any(m in names for m in _TF32_MARKS):
        return "fp32"
    return "fp32_simt" if any(m in names for m in _SIMT_MARKS) or dtype == "float32" else "bf16"


@dataclass(frozen=True)
class EventEstimate:
    """The model's reading of one measured op event."""

    duration_us: float
    bound: str
    work: float          # FLOPs of a GEMM, bytes of a streamed op: the size of its shape regime


def event_estimate(hw: Hardware, op: str, cls: str, shapes: list, dtype: str, fmt: str,
                   input_bytes: int) -> EventEstimate | None:
    """``estimate_event`` with the event's work (FLOPs or bytes)."""
    base = op.split("::")[-1]
    est = estimate_event(hw, op, cls, shapes, dtype, fmt, input_bytes)
    if est is None:
        return None
    if cls == "gemm":
        b, m, n, k = roofline.gemm_dims(base, shapes)
        work = 2.0 * b * m * n * k
    else:
        work = float(input_bytes + (0 if base in _WRITE_ONLY_SELF else
                                    math.prod(_broadcast(shapes)) * DTYPE_BYTES.get(dtype, 4)))
    return EventEstimate(est.duration_us, est.bound, work)


def estimate_event(hw: Hardware, op: str, cls: str, shapes: list, dtype: str, fmt: str,
                   input_bytes: int) -> roofline.Estimate | None:
    """The model's time of one measured op event (``fmt``: gemm_format's, for a GEMM); None where
    the model has no reading of it (an op class that does not stream its inputs, a GEMM of
    unexpected ranks, inputs that do not broadcast)."""
    if cls not in (*CHECKED_CLASSES, *STREAMED_CLASSES):
        return None
    base = op.split("::")[-1]
    if cls == "gemm":
        dims = roofline.gemm_dims(base, shapes)
        if dims is None:
            return None
        size = DTYPE_BYTES.get(dtype, 2)
        return roofline.gemm_estimate(hw, GemmCall(*dims, fmt, size, size, size))
    out_shape = _broadcast(shapes)
    if out_shape is None:
        return None
    # ops that only write their first input (copy_ reads src and writes self; fill_ writes self)
    written = 0 if base in _WRITE_ONLY_SELF else math.prod(out_shape) * DTYPE_BYTES.get(dtype, 4)
    nbytes = input_bytes + written
    k = Kernel(kernel_key="", name=f"aten.{base}.default", op_class=cls, kind="compute",
               shapes=json.dumps(shapes), dtype=dtype, flops=0.0, bytes=float(nbytes), args="")
    return roofline.estimate(hw, k)


def _broadcast(shapes: list[list[int]]) -> list[int] | None:
    """The broadcast shape of the inputs (None when they do not broadcast: not one output)."""
    if not shapes:
        return None
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        dims = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0} - {1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return out
