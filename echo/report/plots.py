"""The report's figures, made with matplotlib (Agg) and written as SVG (or PNG, by suffix).

Each function takes plain tables (pyarrow) or rows (dicts) read from the results and returns a
matplotlib Figure; ``save(fig, path)`` writes it. Every figure has a title, labelled axes with
units and a legend, so that it reads on its own, without Echo.

- ``step_breakdown``: where each experiment's step time goes (compute, optimizer, exposed
  communication by kind, pipeline bubble), as shares of its step, labelled with the step time.
- ``gantt``: one iteration across the pipeline stages (timeline.parquet).
- ``memory``: peak memory of each pipeline stage's ranks, split into parameters, gradients,
  optimizer state and activations, against the GPU's memory.
- ``sweep_heatmap``: a sweep's step times, tensor x pipeline split against the other axes.
- ``predicted_vs_measured``: predictions next to measurements, where any exist.
- ``error_by_layout``: each validated row's step-time error against its TP, PP, CP and EP
  degree, so that a layout-dependent bias shows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in SVGs: searchable, small
import matplotlib.pyplot as plt  # noqa: E402
import pyarrow as pa  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from echo.io import atomic_path  # noqa: E402

GIB = 1024**3
EXPOSED_KINDS = ("tp", "cp", "ep", "dp", "pp", "other")
# one colour per part of a step, used by every figure
COLORS = {
    "compute": "#4C72B0", "forward": "#4C72B0", "backward": "#DD8452", "recompute": "#937860",
    "optimizer": "#55A868", "bubble": "#C7C7C7",
    "exposed_tp": "#C44E52", "exposed_cp": "#DA8BC3", "exposed_ep": "#8172B3", "exposed_dp": "#8C564B",
    "exposed_pp": "#64B5CD", "exposed_other": "#7F7F7F",
    "send": "#64B5CD", "recv": "#64B5CD", "collective": "#C44E52",
    "params": "#4C72B0", "grads": "#DD8452", "optimizer_state": "#55A868", "activations": "#8172B3",
}
LABELS = {
    "compute": "compute (forward, backward)", "optimizer": "optimizer step", "bubble": "pipeline bubble",
    **{f"exposed_{k}": f"exposed {k.upper() if k != 'other' else 'other'} communication" for k in EXPOSED_KINDS},
}


def save(fig: Figure, path: Path | str) -> None:
    """Write ``fig`` to ``path`` (format from the suffix) under a temporary name, then rename."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip("."), bbox_inches="tight", dpi=150,
                    metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def experiment_label(row: dict) -> str:
    return f"{row['workload']}\n{row['hardware']} / {row['topology']}"


def _empty(fig: Figure, ax, text: str) -> Figure:
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=11, wrap=True, transform=ax.transAxes)
    return fig


# --- step-time breakdown ------------------------------------------------------------------------


def breakdown_parts(summary: dict, optimizer_s: float = 0.0) -> dict[str, float]:
    """A summary row's step split into parts that add up to its step time (seconds)."""
    exposed = {f"exposed_{k}": float(summary.get(f"exposed_{k}_s") or 0.0) for k in EXPOSED_KINDS}
    accounted = sum(exposed.values())
    total_exposed = float(summary.get("exposed_comm_s") or 0.0)
    if total_exposed > accounted + 1e-12:  # a summary without the per-kind columns
        exposed["exposed_other"] += total_exposed - accounted
    compute = float(summary.get("compute_s") or 0.0)
    optimizer_s = min(optimizer_s, compute)
    return {"compute": compute - optimizer_s, "optimizer": optimizer_s, **exposed,
            "bubble": float(summary.get("bubble_s") or 0.0)}


def optimizer_seconds(timeline: pa.Table, stage: int) -> float:
    """Time the optimizer step takes on ``stage``'s compute stream."""
    rows = [r for r in timeline.select(["pp_rank", "stream", "kind", "start_s", "end_s"]).to_pylist()
            if r["pp_rank"] == stage and r["kind"] == "optimizer" and r["stream"] == "compute"]
    return sum(r["end_s"] - r["start_s"] for r in rows)


def step_breakdown(summaries: Sequence[dict], optimizer_s: Sequence[float] | None = None) -> Figure:
    """One horizontal bar per experiment: the shares of its step time, labelled with the step time."""
    n = len(summaries)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.7 * max(n, 1)), layout="constrained")
    if not n:
        return _empty(fig, ax, "no experiments simulated")
    optimizer_s = optimizer_s or [0.0] * n
    parts = [breakdown_parts(s, o) for s, o in zip(summaries, optimizer_s, strict=True)]
    keys = [k for k in parts[0] if any(p[k] > 0 for p in parts)]
    for i, (s, p) in enumerate(zip(summaries, parts, strict=True)):
        step, left = float(s.get("step_time_s") or 0.0), 0.0
        for k in keys:
            share = p[k] / step if step > 0 else 0.0
            ax.barh(i, share, left=left, color=COLORS[k], edgecolor="white", linewidth=0.5)
            if share > 0.06:
                ax.text(left + share / 2, i, f"{share:.0%}", ha="center", va="center", fontsize=8, color="white")
            left += share
        mfu = f"\nMFU {s['mfu']:.0%}" if s.get("mfu") is not None else ""
        ax.text(1.01, i, f"step {_seconds(step)}{mfu}", va="center", fontsize=8)
    ax.set_yticks(range(n), [experiment_label(s) for s in summaries], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("share of the step time (critical pipeline stage)")
    ax.set_title("Step-time breakdown per experiment")
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in keys], ncol=3, fontsize=8,
               loc="outside lower center", frameon=False)
    return fig


# --- Gantt of one iteration --------------------------------------------------------------------


def gantt(timeline: pa.Table, title: str, max_bars: int = 20000) -> Figure:
    """One row per pipeline stage: its compute stream (forward, backward, optimizer) above thin
    lanes for its communication streams (p2p sends, data-parallel collectives)."""
    rows = timeline.select(["pp_rank", "stream", "kind", "microbatch", "chunk", "start_s", "end_s"]).to_pylist()
    stages = sorted({r["pp_rank"] for r in rows})
    fig, ax = plt.subplots(figsize=(12, 2.0 + 0.55 * max(len(stages), 1)), layout="constrained")
    if not rows:
        return _empty(fig, ax, "empty timeline")
    end = max(r["end_s"] for r in rows)
    unit, scale = ("s", 1.0) if end >= 1 else ("ms", 1e3)
    streams = sorted({r["stream"] for r in rows if r["stream"] != "compute"})
    lane = 0.16 if streams else 0.0
    few = len({r["microbatch"] for r in rows}) <= 16
    bars: dict[tuple[str, float, float], list[tuple[float, float]]] = {}  # (kind, y, height) -> (x, width)
    for r in rows[:max_bars]:
        s = stages.index(r["pp_rank"])
        if r["stream"] == "compute":
            y, h = s - 0.4, 0.8 - lane * len(streams)
        else:
            y, h = s + 0.4 - lane * (streams.index(r["stream"]) + 1), lane * 0.9
        bars.setdefault((r["kind"], y, h), []).append((r["start_s"] * scale, (r["end_s"] - r["start_s"]) * scale))
        if few and r["stream"] == "compute" and r["microbatch"] >= 0 and (r["end_s"] - r["start_s"]) / end > 0.012:
            ax.text((r["start_s"] + r["end_s"]) / 2 * scale, y + h / 2, str(r["microbatch"]), ha="center",
                    va="center", fontsize=6, color="white")
    many = len(rows) > 1500  # draw the bars as an image inside the SVG: small files, crisp text
    for (kind, y, h), spans in bars.items():
        ax.broken_barh(spans, (y, h), facecolors=COLORS.get(kind, "#7F7F7F"), edgecolor="white",
                       linewidth=0.2, rasterized=many)
    kinds = sorted({kind for kind, _, _ in bars})
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.set_ylim(len(stages) - 0.5, -0.5)
    ax.set_xlim(0, end * scale)
    ax.set_xlabel(f"time in the iteration ({unit})")
    ax.set_title(title, fontsize=10)
    lanes = f"; thin lanes: {', '.join(streams)}" if streams else ""
    fig.legend(handles=[Patch(color=COLORS.get(k, "#7F7F7F"), label=k) for k in kinds],
               ncol=len(kinds), fontsize=8, loc="outside lower center", frameon=False,
               title=f"wide bars: compute stream{' (numbers: micro-batch)' if few else ''}{lanes}",
               title_fontsize=8)
    return fig


# --- memory per rank ---------------------------------------------------------------------------


def memory(summary: dict, traced_ranks: pa.Table, memory_gib: float | None, title: str) -> Figure:
    """Per pipeline stage, the peak memory of its ranks: model state from the trace (parameters,
    gradients, optimizer state) and activations in flight at the peak (the rest of the
    simulated peak), against the GPU's memory."""
    peaks = [float(x or 0.0) for x in summary.get("stage_peak_mem_gib") or [summary.get("peak_mem_gib")]]
    state: dict[int, dict[str, float]] = {}
    for r in traced_ranks.to_pylist():
        parts = {"params": r["param_bytes"] / GIB, "grads": r["grad_bytes"] / GIB,
                 "optimizer_state": r["optimizer_bytes"] / GIB}
        if sum(parts.values()) > sum(state.get(r["pp_rank"], {}).values()):
            state[r["pp_rank"]] = parts
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(peaks) + 3), 4), layout="constrained")
    for s, peak in enumerate(peaks):
        parts = dict(state.get(s, {}))
        parts["activations"] = max(0.0, peak - sum(parts.values()))
        bottom = 0.0
        for k, v in parts.items():
            ax.bar(s, v, bottom=bottom, color=COLORS[k], edgecolor="white", linewidth=0.5)
            bottom += v
        ax.text(s, bottom, f"{peak:.1f}", ha="center", va="bottom", fontsize=7)
    if memory_gib:
        ax.axhline(memory_gib, color="black", linestyle="--", linewidth=1)
        ax.text(-0.5, memory_gib, f" GPU memory {memory_gib:g} GiB", va="bottom", ha="left", fontsize=8)
        ax.set_ylim(0, max(memory_gib, max(peaks)) * 1.15)
    ax.set_xticks(range(len(peaks)), [str(s) for s in range(len(peaks))])
    ax.set_xlabel("pipeline stage (every rank of a stage holds the same)")
    ax.set_ylabel("peak memory per rank (GiB)")
    fits = summary.get("fits")
    ax.set_title(f"{title}\n{'fits' if fits or fits is None else 'does NOT fit'} in memory", fontsize=10)
    fig.legend(handles=[Patch(color=COLORS[k], label=k.replace("_", " ")) for k in
                       ("params", "grads", "optimizer_state", "activations")], fontsize=8, loc="outside right upper")
    return fig


# --- sweeps --------------------------------------------------------------------------------------


def sweep_heatmap(ranking: pa.Table, title: str) -> Figure:
    """Rows: tensor x pipeline split (dp follows); columns: the other swept settings (and the
    topology when there are several). Cells: step time; the best three ranked; layouts that do
    not fit in memory greyed out with their peak memory."""
    rows = ranking.to_pylist()
    fig_rows = sorted({(r["tp"], r["pp"], r["cp"], r["dp"]) for r in rows})
    topologies = sorted({r["topology"] for r in rows})

    def rest(r: dict) -> list[str]:
        return [t for t in r["tokens"].split("-") if not re.fullmatch(r"(tp|pp|dp|cp)\d+", t)]

    common = set.intersection(*(set(rest(r)) for r in rows)) if rows else set()  # said once, in the title

    def column(r: dict) -> str:
        name = " ".join(t for t in rest(r) if t not in common) or "1f1b"
        return f"{name}\n{r['topology']}" if len(topologies) > 1 else name

    cols = sorted({column(r) for r in rows})
    fig, ax = plt.subplots(figsize=(2.2 + 1.5 * max(len(cols), 1), 1.6 + 0.6 * max(len(fig_rows), 1)),
                           layout="constrained")
    if not rows:
        return _empty(fig, ax, f"{title}\nno layout simulated (see layouts.parquet for the dropped ones)")
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    lo, hi = (min(fitting), max(fitting)) if fitting else (0.0, 1.0)
    cmap = plt.get_cmap("viridis_r")
    grid = [[math.nan] * len(cols) for _ in fig_rows]
    for r in rows:
        i, j = fig_rows.index((r["tp"], r["pp"], r["cp"], r["dp"])), cols.index(column(r))
        t = r["step_time_s"]
        grid[i][j] = t
        if r["fits"]:
            shade = (t - lo) / (hi - lo) if hi > lo else 0.0
            color, text_color = cmap(shade), "white" if shade > 0.5 else "black"
            label = f"{t:.2f} s" + (f"\n#{r['rank']}" if r["rank"] and r["rank"] <= 3 else "")
        else:
            color, text_color = "#E0E0E0", "#555555"
            label = f"{t:.2f} s\nOOM {r['peak_mem_gib']:.0f} GiB"
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=color, edgecolor="white", linewidth=2))
        weight = "bold" if r["rank"] == 1 else "normal"
        ax.text(j, i, label, ha="center", va="center", fontsize=8, color=text_color, fontweight=weight)
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(len(fig_rows) - 0.5, -0.5)
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.set_yticks(range(len(fig_rows)), [f"tp{tp} pp{pp}" + (f" cp{cp}" if cp > 1 else "") + f" (dp{dp})"
                                         for tp, pp, cp, dp in fig_rows], fontsize=8)
    ax.set_xlabel("other settings (schedule, virtual stages, micro-batch, recompute, ...)")
    ax.set_ylabel("tensor x pipeline split")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(lo, hi))
    fig.colorbar(sm, ax=ax, label="step time (s), layouts that fit")
    every = f"every layout: {' '.join(sorted(common))}; " if common else ""
    ax.set_title(f"{title}\n{every}#1-#3: fastest that fit in memory; grey: out of memory", fontsize=10)
    return fig


# --- predicted vs measured ------------------------------------------------------------------------


def predicted_vs_measured(points: Sequence[dict], band: float = 0.2, title: str = "Predicted vs measured step time",
                          xlabel: str = "measured step time (s)") -> Figure:
    """Each point: {label, predicted_s, measured_s, source}. Log-log, with the line of perfect
    prediction and a +-``band`` area; one marker per source (published cluster runs, runs on
    this machine)."""
    fig, ax = plt.subplots(figsize=(6.5, 5.5), layout="constrained")
    points = [p for p in points if p.get("predicted_s") and p.get("measured_s")]
    if not points:
        return _empty(fig, ax, "Predicted vs measured step time\n\nno measurements yet (results/validate/ "
                               "or results/measure/ hold none that pair with a prediction)")
    xs, ys = [p["measured_s"] for p in points], [p["predicted_s"] for p in points]
    lo, hi = min(xs + ys) / 1.5, max(xs + ys) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="prediction = measurement")
    grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]  # straight edges on log axes
    ax.fill_between(grid, [g * (1 - band) for g in grid], [g * (1 + band) for g in grid], color="#DDDDDD",
                    label=f"within {band:.0%}")
    sources = sorted({p.get("source", "") for p in points})
    markers = "osD^v<>"
    for i, source in enumerate(sources):
        mine = [p for p in points if p.get("source", "") == source]
        ax.scatter([p["measured_s"] for p in mine], [p["predicted_s"] for p in mine], s=30, zorder=3,
                   marker=markers[i % len(markers)], label=source or None)
        for p in mine:
            err = p["predicted_s"] / p["measured_s"] - 1
            ax.annotate(f"{p['label']} ({err:+.0%})", (p["measured_s"], p["predicted_s"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    return fig


# --- error against layout degree -----------------------------------------------------------------

LAYOUT_DIMS = ("tp", "pp", "cp", "ep")
_LAYOUT_NAMES = {"tp": "tensor", "pp": "pipeline", "cp": "context", "ep": "expert"}


def error_by_layout(points: Sequence[dict], band: float = 0.10,
                    title: str = "Step-time error against layout degree") -> Figure:
    """Each point: {label, table, error (predicted / measured - 1), tp, pp, cp, ep, and optionally
    split: fit | validation}. One panel per degree (TP, PP, CP, EP; log2 x axis), error in percent,
    a zero line and a +-``band`` area; one marker and colour per source table, filled for
    validation rows and hollow for fit rows (all filled when no point has a split). A grey line
    joins the mean error at each degree."""
    points = [p for p in points if p.get("error") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), layout="constrained", sharey=True)
    if not points:
        for ax in axes.flat[1:]:
            ax.axis("off")
        return _empty(fig, axes.flat[0], f"{title}\n\nno validated rows yet")
    tables = sorted({p["table"] for p in points})
    colors, markers = plt.get_cmap("tab10"), "osD^v<>P*"
    style = {t: (colors(i % 10), markers[i % len(markers)]) for i, t in enumerate(tables)}
    has_split = any(p.get("split") for p in points)
    errors = [100.0 * p["error"] for p in points]
    lo, hi = min(min(errors), -100 * band), max(max(errors), 100 * band)
    pad = 0.08 * (hi - lo)
    for ax, dim in zip(axes.flat, LAYOUT_DIMS, strict=True):
        degrees = sorted({int(p[dim]) for p in points})
        ax.axhspan(-100 * band, 100 * band, color="#E6E6E6", zorder=0)
        ax.axhline(0.0, color="black", linewidth=1, zorder=1)
        for t in tables:
            color, marker = style[t]
            for fit in (False, True):
                mine = [p for p in points if p["table"] == t and (p.get("split") == "fit") == fit]
                if not mine:
                    continue
                ax.scatter([int(p[dim]) for p in mine], [100.0 * p["error"] for p in mine], s=34, zorder=3,
                           marker=marker, facecolors="none" if fit else color, edgecolors=color, linewidths=1.2)
        means = [sum(100.0 * p["error"] for p in points if int(p[dim]) == d) /
                 sum(1 for p in points if int(p[dim]) == d) for d in degrees]
        if len(degrees) > 1:
            ax.plot(degrees, means, color="#7F7F7F", linestyle="--", linewidth=1, zorder=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(degrees, [str(d) for d in degrees])
        ax.minorticks_off()
        ax.set_xlim(degrees[0] / 1.6, degrees[-1] * 1.6)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel(f"{dim.upper()} degree ({_LAYOUT_NAMES[dim]} parallel size)")
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(100.0))
        if len(degrees) == 1:
            ax.text(0.03, 0.03, f"every row at {dim.upper()} = {degrees[0]}", transform=ax.transAxes, ha="left",
                    va="bottom", fontsize=8, color="#555555", bbox={"facecolor": "white", "edgecolor": "none"})
    for ax in axes[:, 0]:
        ax.set_ylabel("step-time error (predicted / measured - 1)")
    handles = [plt.Line2D([], [], linestyle="none", marker=style[t][1], color=style[t][0], label=t) for t in tables]
    if has_split:
        handles += [plt.Line2D([], [], linestyle="none", marker="o", color="black", label="filled: validation row"),
                    plt.Line2D([], [], linestyle="none", marker="o", markerfacecolor="none", color="black",
                               label="hollow: fit row")]
    handles += [Patch(color="#E6E6E6", label=f"within {band:.0%}"),
                plt.Line2D([], [], color="#7F7F7F", linestyle="--", label="mean error per degree")]
    fig.legend(handles=handles, ncol=min(len(handles), 4), fontsize=8, loc="outside lower center", frameon=False)
    fig.suptitle(f"{title} ({len(points)} rows)")
    return fig


def time_to_train(points: Sequence[dict], title: str) -> Figure:
    """Days to train and cost against GPU count (``points``: gpus, time_to_train_days, ideal_days,
    cost_usd, effective_training_time, layout), the strong-scaling view of ``echo plan-search``."""
    fig, (days_ax, cost_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    if not points:
        return _empty(fig, days_ax, "no layout fits")
    pts = sorted(points, key=lambda p: p["gpus"])
    gpus = [p["gpus"] for p in pts]
    days_ax.plot(gpus, [p["time_to_train_days"] for p in pts], "o-", label="with interruptions and checkpoints")
    days_ax.plot(gpus, [p["ideal_days"] for p in pts], "s--", alpha=0.7, label="uninterrupted")
    for p in pts:
        days_ax.annotate(f"ETTR {p['effective_training_time']:.0%}", (p["gpus"], p["time_to_train_days"]),
                         textcoords="offset points", xytext=(4, 6), fontsize=7)
    days_ax.set_xscale("log", base=2)
    days_ax.set_xlabel("GPUs")
    days_ax.set_ylabel("days to train")
    days_ax.legend(fontsize=8)
    costs = [p["cost_usd"] for p in pts]
    if all(c is not None for c in costs):
        cost_ax.plot(gpus, [c / 1e6 for c in costs], "o-", color="tab:red")
        cost_ax.set_ylabel("cost (million USD)")
    else:
        cost_ax.plot(gpus, [p["gpu_hours"] / 1e6 for p in pts], "o-", color="tab:red")
        cost_ax.set_ylabel("million GPU-hours (no price for this hardware)")
    cost_ax.set_xscale("log", base=2)
    cost_ax.set_xlabel("GPUs")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
