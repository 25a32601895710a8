"""The profile stage: one duration per distinct kernel of a trace, on the target hardware.

A GPU target is modelled (``roofline``); the local CPU (``kind: cpu``) is measured (``measure``).
Only compute and memcpy ops are kernels here; collectives and p2p belong to the network model.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from echo.artifacts import KERNELS
from echo.config import Hardware
from echo.io import read_parquet, write_parquet
from echo.profile import roofline
from echo.profile.kernel import Kernel, Result

log = logging.getLogger(__name__)

PROFILED_KINDS = ("compute", "memcpy")
_FIELDS = ("name", "op_class", "kind", "shapes", "dtype", "flops", "bytes", "args")
# Columns written besides the KERNELS contract: the roofline bound of modelled rows and the
# thread count of measured ones (0 when modelled).
EXTRA = pa.schema([("kind", pa.string()), ("bound", pa.string()), ("threads", pa.int32())])


def run_profile(hardware: Hardware, trace_dir: Path, out_path: Path, cache_dir: Path | None = None) -> None:
    """Write ``out_path`` (KERNELS): each distinct kernel of ``trace_dir/ops.parquet`` with its
    duration on ``hardware``, modelled for a GPU, measured for the local CPU."""
    kernels = distinct_kernels(read_parquet(Path(trace_dir) / "ops.parquet"))
    if hardware.kind == "gpu":
        results = model_kernels(kernels, hardware)
    else:
        from echo.profile.measure import measure_kernels  # imports torch; GPU targets need not

        results = measure_kernels(kernels, hardware, Path(cache_dir) if cache_dir else None)
    table = kernels_table(kernels, results)
    write_parquet(table, out_path, KERNELS)
    total_ms = sum(k.count * results[k.kernel_key].duration_us for k in kernels) / 1e3
    log.info("profile %s: %d kernels, %.1f ms of kernel time over the traced ops -> %s",
             hardware.name, len(kernels), total_ms, out_path)


def distinct_kernels(ops: pa.Table) -> list[Kernel]:
    """One Kernel per distinct kernel_key of the compute/memcpy ops, with its occurrence count,
    in order of first appearance."""
    ops = ops.filter(pc.is_in(ops["kind"], pa.array(PROFILED_KINDS)))
    ops = ops.select(["kernel_key", *_FIELDS])
    first: dict[str, dict] = {}
    counts: dict[str, int] = {}
    for row in ops.to_pylist():
        key = row["kernel_key"]
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, row)
    return [Kernel(**first[key], count=counts[key]) for key in first]


def model_kernels(kernels: list[Kernel], hardware: Hardware) -> dict[str, Result]:
    """kernel_key -> Result from the roofline model."""
    out = {}
    for k in kernels:
        est = roofline.estimate(hardware, k)
        out[k.kernel_key] = Result(est.duration_us, "model", 0, est.bound)
    return out


def kernels_table(kernels: list[Kernel], results: dict[str, Result]) -> pa.Table:
    """The KERNELS table (plus EXTRA columns), one row per kernel, in ``kernels`` order.

    ``achieved_tflops`` is the rate of the FLOPs the kernel executes: a causal flash kernel runs
    half its model FLOPs (``flops``, the MFU convention), and counting those would show rates
    above the GPU's peak."""
    rows = []
    for k in kernels:
        r = results[k.kernel_key]
        per_us = 1.0 / r.duration_us if r.duration_us > 0 else 0.0  # a zero-cost model (no launch floor)
        rows.append(dict(
            kernel_key=k.kernel_key, name=k.name, op_class=k.op_class, shapes=k.shapes, dtype=k.dtype,
            flops=k.flops, bytes=k.bytes, duration_us=r.duration_us,
            achieved_tflops=roofline.executed_flops(k) * per_us / 1e6, achieved_GBps=k.bytes * per_us / 1e3,
            source=r.source, count=k.count, kind=k.kind, bound=r.bound, threads=r.threads,
        ))
    schema = pa.schema(list(KERNELS) + list(EXTRA))
    return pa.Table.from_pylist(rows, schema=schema)
