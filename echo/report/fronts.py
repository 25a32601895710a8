"""A search's figures (echo.sweep.search): step time against memory and against GPU count, every
ranked layout a point, the Pareto front drawn through the layouts no other beats in both."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from echo.report.plots import plt, save


def front_figure(rows: Sequence[dict], front: Sequence[dict], x: str, xlabel: str, title: str):
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    fit = [r for r in rows if r["fits"]]
    # what does not fit is drawn where it was simulated (a search drops most of it unsimulated)
    over = [r for r in rows if not r["fits"] and r["step_time_s"] is not None]
    ax.scatter([r[x] for r in fit], [r["step_time_s"] for r in fit], s=9, color="#4C72B0", alpha=0.5,
               label=f"fits in memory ({len(fit)})")
    if over:
        ax.scatter([r[x] for r in over], [r["step_time_s"] for r in over], s=9, color="#C44E52", alpha=0.3,
                   marker="x", label=f"does not fit ({len(over)} simulated)")
    if front:
        pts = sorted(front, key=lambda r: r[x])
        ax.step([r[x] for r in pts], [r["step_time_s"] for r in pts], where="post", color="#DD8452",
                linewidth=1.6, label="Pareto front")
        ax.scatter([r[x] for r in pts], [r["step_time_s"] for r in pts], s=22, color="#DD8452", zorder=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("step time (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def search_fronts(rows: Sequence[dict], fronts: Sequence[dict], out_dir: Path, title: str) -> list[Path]:
    """Write ``front_memory.svg`` and ``front_gpus.svg`` into ``out_dir``; return their paths."""
    out = []
    for front, x, label in (("memory", "peak_mem_gib", "peak memory per GPU (GiB)"), ("gpus", "gpus", "GPUs")):
        path = Path(out_dir) / f"front_{front}.svg"
        save(front_figure(rows, [f for f in fronts if f["front"] == front], x, label, title), path)
        out.append(path)
    return out
