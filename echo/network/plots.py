"""Measured vs predicted bus bandwidth over message size, the picture a calibration is judged by.

``plot_busbw(model, measured, path)``: one colour per (op, GPU count, nodes); measured points as
markers (nccl-tests' busbw, in- and out-of-place averaged), the model's prediction as a line over
the same size range (marked where the chosen algorithm/protocol changes; for a log whose one thread drove several
GPUs, not below that thread's launch floor, as the log measured it). Without measurements
(a nominal topology) it draws the model's predictions for the usual group shapes. Rendered with
matplotlib's Agg backend (no display), written atomically.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from echo.io import atomic_path
from echo.network.costs import Shape, bus_factor
from echo.network.fit import runs_from_measurements
from echo.network.model import NetworkModel

_MIN_BYTES = 1024


def _curves(model: NetworkModel, measured: pa.Table) -> list[dict]:
    """One curve per measured run (with its points), or per usual shape when nothing was measured."""
    runs = runs_from_measurements(measured) if measured.num_rows else []
    if runs:
        return [{"op": r.op, "shape": r.shape, "bytes": r.bytes, "measured_us": r.time_us,
                 "per_thread": r.gpus_per_thread, "label": r.label, "forced": (r.nccl_algo, r.nccl_proto)}
                for r in runs]
    gpn = model.topology.node_ranks
    shapes = [Shape(n, 1, n) for n in (2, 4, 8) if n < gpn] + [Shape(gpn, 1, gpn)] if gpn > 1 else []
    shapes += [Shape(m * gpn, m, gpn) for m in (2, 4, 16)]
    sizes = np.array([_MIN_BYTES << i for i in range(25)], dtype=np.float64)
    return [{"op": "all_reduce", "shape": s, "bytes": sizes, "measured_us": None, "per_thread": 1}
            for s in dict.fromkeys(shapes)]


def plot_busbw(model: NetworkModel, measured: pa.Table, path: str | Path) -> None:
    """Write the measured-vs-predicted bus bandwidth plot of ``model`` to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = _curves(model, measured)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colors = plt.get_cmap("tab10")
    for i, curve in enumerate(curves):
        op, shape, sizes = curve["op"], curve["shape"], np.asarray(curve["bytes"], dtype=np.float64)
        lo, hi = max(sizes.min(), 1.0), sizes.max()
        grid = np.unique(np.concatenate([np.geomspace(lo, hi, 200), sizes]))
        forced = curve.get("forced")
        cols = (model.forcing(*forced) if forced else model).predict(op, shape, grid)
        # as the log's harness measured it: not faster than one thread launching on its GPUs
        floor = curve["per_thread"] * model.params.launch_us
        if floor > 0:
            cols["busbw_GBps"] = grid / (np.maximum(cols["time_us"], floor) * 1e3) * bus_factor(op, shape.gpus)
        color = colors(i % 10)
        where = f"{shape.nodes} node{'s' if shape.nodes > 1 else ''}"
        label = curve.get("label") or f"{op} {shape.gpus} GPUs ({where})"
        ax.plot(grid, cols["busbw_GBps"], "-", color=color, lw=1.6, label=f"{label}: model")
        changes = [j for j in range(1, grid.size)
                   if (cols["algorithm"][j], cols["protocol"][j]) != (cols["algorithm"][j - 1], cols["protocol"][j - 1])]
        ax.plot(grid[changes], np.asarray(cols["busbw_GBps"])[changes], "|", color=color, ms=9)
        if curve["measured_us"] is not None:
            busbw = sizes / (np.asarray(curve["measured_us"]) * 1e3) * bus_factor(op, shape.gpus)
            ax.plot(sizes, busbw, "o", color=color, ms=4, mfc="none", label=f"{label}: measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    source = "fitted to measurements" if model.source == "fitted" else "nominal figures"
    ax.set_title(f"{model.topology.name}: bus bandwidth, model ({source})\n"
                 "lines: model, circles: measured, |: the chosen algorithm/protocol changes", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
