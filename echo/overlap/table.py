"""Overlap slowdown factors: how much a kernel slows while communication runs on the same device.

A kernel that would take ``T0`` alone takes ``T = (1 - r) T0 + r T0 (1 + s)`` when a fraction
``r`` of its work runs while a communication kernel (an NCCL collective or p2p transfer, or on
this CPU gloo's worker threads) is in flight on the same device: it runs at ``1 / (1 + s)`` of its
speed during the overlap. ``s`` depends on the kernel's class (``ops.op_class``) and the device.

Where the figures come from, per hardware (``slowdown_table(hardware)``):

- ``kind: cpu`` (this machine): measured by the ``overlap`` rule (``echo.overlap.measure``),
  timing kernels of every class with and without concurrent gloo all-reduce traffic, written to
  ``results/overlap/{hardware}/slowdown.parquet`` and passed to the simulate stage.
- GPUs: the Echo paper's per-kernel figures next to a 25 MB NCCL all-reduce on an A100 node
  (arXiv 2412.12487 section 2.3, ``echo_overlap_slowdown.csv`` of the reference folder): GEMM 1.269x,
  sum 1.508x, transform 1.142x, gradient 1.613x. ``PUBLISHED`` maps each op class to the
  closest of the four kernels. No per-kernel figure is published for H100, H200 or B200; they
  use the A100 figures until measured (the paper's A800 / RTX 3090 rows show the factor moving
  with the CUDA version by 4-60%, so treat these as +-30%).

A hardware yaml may later carry an ``overlap_slowdown: {op_class: s}`` mapping (proposed to the
profile owner); ``slowdown_table`` prefers it when present.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import pyarrow as pa

log = logging.getLogger(__name__)

OP_CLASSES = ("gemm", "attention", "elementwise", "norm", "softmax", "embedding", "cross_entropy",
              "optimizer", "copy", "reduction", "other")

# results/overlap/{hardware}/slowdown.parquet: one row per op class measured on this machine.
SLOWDOWN = pa.schema([
    ("op_class", pa.string()),
    ("kernel", pa.string()),          # what was timed, e.g. "mm 256x256 @ 256x1024 fp32"
    ("comm_op", pa.string()),         # the concurrent traffic, e.g. all_reduce
    ("comm_bytes", pa.int64()),       # its message size
    ("alone_us", pa.float64()),       # median kernel time without traffic
    ("overlapped_us", pa.float64()),  # median kernel time with traffic in flight
    ("slowdown", pa.float64()),       # s = overlapped / alone - 1 (median of paired windows)
    ("spread", pa.float64()),         # interquartile range of the paired ratios (noise of the estimate)
    ("windows", pa.int32()),          # paired quiet/busy windows the median is over
    ("ranks", pa.int32()),            # processes (each computing and communicating)
    ("threads", pa.int32()),          # torch intra-op threads per process
    ("source", pa.string()),          # measured
])

# Echo paper, A100 node, next to a 25 MB all-reduce (T / T0): the four kernels it reports.
_PAPER_A100 = {"gemm": 1.269, "sum": 1.508, "transform": 1.142, "gradient": 1.613}
# op class -> the paper's kernel it is closest to:
#   GEMM: tensor-core GEMMs and attention (GEMM-dominated); sum: reduction kernels (norms'
#   mean/variance, softmax's max/sum, cross entropy's log-sum-exp); transform: element-wise,
#   copies, gathers; gradient: the optimizer's gradient update (memory-bound, reads grads).
_KERNEL_OF_CLASS = {
    "gemm": "gemm", "attention": "gemm", "norm": "sum", "softmax": "sum", "cross_entropy": "sum",
    "reduction": "sum", "elementwise": "transform", "copy": "transform", "embedding": "transform",
    "other": "transform", "optimizer": "gradient",
}
PUBLISHED_SOURCE = ("Echo paper (arXiv 2412.12487) sec. 2.3, A100 node next to a 25 MB all-reduce: "
                    "GEMM 1.269, sum 1.508, transform 1.142, gradient 1.613")
PUBLISHED: Mapping[str, float] = MappingProxyType(
    {c: round(_PAPER_A100[k] - 1.0, 6) for c, k in _KERNEL_OF_CLASS.items()})

# GPU hardware name -> (figures, provenance). Others of kind gpu fall back to the A100 figures.
GPU_TABLE: Mapping[str, tuple[Mapping[str, float], str]] = MappingProxyType({
    "a100-sxm-80gb": (PUBLISHED, PUBLISHED_SOURCE),
    "h100-sxm-80gb": (PUBLISHED, "A100 figures (no H100 data yet): " + PUBLISHED_SOURCE),
    "h200-sxm-141gb": (PUBLISHED, "A100 figures (no H200 data yet): " + PUBLISHED_SOURCE),
    "b200-sxm": (PUBLISHED, "A100 figures (no B200 data yet): " + PUBLISHED_SOURCE),
})


@dataclass(frozen=True)
class Slowdown:
    """s per op class for one device, with where the figures came from."""

    factors: Mapping[str, float] = field(default_factory=dict)
    source: str = "none"
    default: float = 0.0  # for classes the table lacks

    def of(self, op_class: str) -> float:
        return max(0.0, float(self.factors.get(op_class, self.default)))

    @classmethod
    def none(cls) -> Slowdown:
        return cls({}, "none (no overlap slowdown)", 0.0)


def read_measured(path: Path) -> Slowdown:
    """The overlap rule's measurement of this machine."""
    from echo.io import read_parquet

    rows = read_parquet(path).to_pylist()
    factors = {r["op_class"]: max(0.0, float(r["slowdown"])) for r in rows}
    if not factors:
        raise ValueError(f"{path}: no measured slowdown rows")
    median = sorted(factors.values())[len(factors) // 2]
    comm = rows[0]
    return Slowdown(factors, f"measured on this machine next to {comm['comm_op']} of {comm['comm_bytes']} B "
                             f"({path})", median)


def slowdown_table(hardware, measured: Path | str | None = None) -> Slowdown:
    """The overlap slowdown of ``hardware`` (a echo.config.Hardware): a field of its yaml if it
    has one, the measured artifact for the local CPU, the published table for a GPU."""
    own = getattr(hardware, "overlap_slowdown", None)
    if own:
        return Slowdown(dict(own), f"config/hardware/{hardware.name}.yaml overlap_slowdown",
                        float(dict(own).get("other", 0.0)))
    if measured is not None:
        return read_measured(Path(measured))
    if hardware.kind == "cpu":
        log.warning("overlap slowdown for %s: no measurement given (rule overlap writes one); using none",
                    hardware.name)
        return Slowdown.none()
    figures, source = GPU_TABLE.get(hardware.name, (PUBLISHED, "A100 figures (unknown GPU): " + PUBLISHED_SOURCE))
    return Slowdown(figures, source, figures["other"])
