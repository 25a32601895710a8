"""The tables of errors: local layouts (real runs on this machine) and published measurements.

``run_local`` gathers the compare stage's tables into ``results/validate/local.parquet`` (LOCAL,
one row per workload, with the columns the report's predicted-vs-measured plot reads);
``run_errors`` writes the Markdown the README shows (``results/validate/errors.md``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pyarrow as pa

from echo.io import atomic_path, read_parquet, write_parquet
from echo.validate.published import EXPOSED_BY_KIND, table_errors

LOCAL = pa.schema([
    ("workload", pa.string()),
    ("hardware", pa.string()),
    ("topology", pa.string()),
    ("world_size", pa.int32()),
    ("oversubscribed", pa.bool_()),              # more ranks than cores
    ("predicted_step_time_s", pa.float64()),
    ("measured_step_time_s", pa.float64()),      # median of the samples
    ("error", pa.float64()),                     # predicted / measured - 1
    ("samples", pa.int32()),
    ("sample_spread", pa.float64()),             # (max - min) / median of the samples
    ("foreign_cores", pa.float64()),             # median cores other processes used meanwhile
    ("scheduling", pa.string()),
    ("kernels_error", pa.float64()),             # simulated compute vs profiled operator time
    ("tp_comm_error", pa.float64()),             # exposed TP communication vs profiled collectives
    ("largest_gap", pa.string()),                # the stage item with the largest absolute gap
])


def local_row(compare: pa.Table, measured: pa.Table) -> dict:
    rows = compare.to_pylist()
    step = next(r for r in rows if r["item"] == "step_time")
    by_item = {r["item"]: r for r in rows if r["stage"] == -1}
    stage_rows = [r for r in rows if r["stage"] >= 0 and r["predicted_s"] is not None and r["measured_s"] is not None]
    gap = max(stage_rows, key=lambda r: abs(r["predicted_s"] - r["measured_s"]), default=None)
    samples = measured["step_time_s"].to_pylist()
    med = measured["median_step_time_s"][0].as_py()
    foreign = [x for x in measured["foreign_cores"].to_pylist() if x is not None]
    return {
        "workload": step["workload"], "hardware": step["hardware"], "topology": step["topology"],
        "world_size": measured["world_size"][0].as_py(), "oversubscribed": measured["oversubscribed"][0].as_py(),
        "predicted_step_time_s": step["predicted_s"], "measured_step_time_s": step["measured_s"],
        "error": step["error"], "samples": len(samples), "sample_spread": (max(samples) - min(samples)) / med,
        "foreign_cores": statistics.median(foreign) if foreign else None,
        "scheduling": measured["scheduling"][0].as_py(),
        "kernels_error": by_item.get("kernels", {}).get("error"), "tp_comm_error": by_item.get("tp_comm", {}).get("error"),
        "largest_gap": (f"{gap['item']} stage {gap['stage']}: {gap['predicted_s'] * 1e3:.1f} vs "
                        f"{gap['measured_s'] * 1e3:.1f} ms") if gap else "",
    }


def run_local(compare_paths: list[Path], measured_paths: list[Path], out_path: Path) -> pa.Table:
    measured = {t["workload"][0].as_py(): t for t in map(read_parquet, measured_paths)}
    rows = []
    for path in compare_paths:
        compare = read_parquet(path)
        rows.append(local_row(compare, measured[compare["workload"][0].as_py()]))
    table = pa.Table.from_pylist(rows, schema=LOCAL)
    write_parquet(table, out_path, LOCAL)
    return table


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def local_markdown(table: pa.Table) -> str:
    lines = ["| workload | ranks | predicted (s) | measured (s) | error | kernels | TP comm | largest gap |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table.to_pylist():
        ranks = f"{r['world_size']}" + (" (oversubscribed)" if r["oversubscribed"] else "")
        lines.append(f"| {r['workload']} | {ranks} | {r['predicted_step_time_s']:.3f} | "
                     f"{r['measured_step_time_s']:.3f} | {_pct(r['error'])} | {_pct(r['kernels_error'])} | "
                     f"{_pct(r['tp_comm_error'])} | {r['largest_gap']} |")
    return "\n".join(lines)


def published_markdown(table: pa.Table) -> str:
    """Validation rows first, with the headline figures; then the fit rows, apart (a figure
    fitted and scored on the same rows is not an accuracy figure)."""
    out = []
    for split, title in (("validation", "Validation rows"), ("fit", "Fit rows (listed apart; not accuracy figures)")):
        rows = [r for r in table.to_pylist() if r.get("split", "validation") == split]
        if not rows:
            continue
        out += [f"#### {title}", "",
                "| table | row | workload | GPUs | predicted (s) | measured (s) | error | exposed TP / CP / DP / PP / EP (s) | host wait (s) | bubble (s) | peak GiB |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            exposed = " / ".join(f"{(r.get(k) or 0):.2f}" for k in EXPOSED_BY_KIND)
            mem = f"{r['peak_mem_gib']:.0f}" + ("" if r["fits"] else " (does not fit)") if r["peak_mem_gib"] else ""
            out.append(f"| {r['table']} | {r['row']} | {r['workload']} | {r['gpus']} | {r['predicted_step_time_s']:.2f} | "
                       f"{r['measured_step_time_s']:.2f} | {_pct(r['error'])} | {exposed} | "
                       f"{(r.get('host_wait_s') or 0):.2f} | {(r['bubble_s'] or 0):.2f} | {mem} |")
        out.append("")
        for key, t in table_errors(table, split).items():
            w = t["worst"]
            out.append(f"- {key} ({split}): mean |error| {t['mean_abs_error']:.1%} over {t['rows']} rows; worst "
                       f"{w['workload']} {w['row']} ({_pct(w['error'])})")
        out.append("")
    return "\n".join(out)


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def layout_rankings(table: pa.Table) -> list[dict]:
    """Ranking fidelity: for each model measured on one GPU in one precision under two or more
    layouts (distinct workloads), the layouts ordered by measured and by predicted throughput
    (TFLOP/s per GPU; a workload measured in several releases takes their median), the fraction
    of layout pairs both put in the same order, and Spearman's rho from three layouts on."""
    sets: dict[tuple, dict[str, dict]] = {}
    for r in table.to_pylist():
        key = (r["table"], r["model"], r["hardware"], r["precision"])
        w = sets.setdefault(key, {}).setdefault(r["workload"], {"measured": [], "predicted": r["predicted_tflops_per_gpu"]})
        w["measured"].append(r["measured_tflops_per_gpu"])
    out = []
    for (tab, model, hw, prec), layouts in sorted(sets.items()):
        if len(layouts) < 2:
            continue
        names = sorted(layouts)
        meas = [statistics.median(layouts[n]["measured"]) for n in names]
        pred = [layouts[n]["predicted"] for n in names]
        pairs = [(i, j) for i in range(len(names)) for j in range(i + 1, len(names)) if meas[i] != meas[j]]
        same = sum((meas[i] - meas[j]) * (pred[i] - pred[j]) > 0 for i, j in pairs)
        rho = None
        if len(names) >= 3:
            rm, rp = _ranks(meas), _ranks(pred)
            mm, mp = statistics.fmean(rm), statistics.fmean(rp)
            num = sum((a - mm) * (b - mp) for a, b in zip(rm, rp, strict=True))
            den = (sum((a - mm) ** 2 for a in rm) * sum((b - mp) ** 2 for b in rp)) ** 0.5
            rho = num / den if den else None
        out.append({"table": tab, "model": model, "hardware": hw, "precision": prec, "layouts": len(names),
                    "concordant": same / len(pairs) if pairs else None, "spearman": rho,
                    "measured_order": [names[i] for i in sorted(range(len(names)), key=lambda i: -meas[i])],
                    "predicted_order": [names[i] for i in sorted(range(len(names)), key=lambda i: -pred[i])]})
    return out


def rankings_markdown(table: pa.Table) -> str:
    rows = layout_rankings(table)
    if not rows:
        return "No model is measured under more than one layout in these rows.\n"
    lines = ["| table | model | GPU | precision | workloads (layout, batch or settings) | pairs in the same order | Spearman rho |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        conc = "" if r["concordant"] is None else f"{r['concordant']:.0%}"
        rho = "" if r["spearman"] is None else f"{r['spearman']:+.2f}"
        lines.append(f"| {r['table']} | {r['model']} | {r['hardware']} | {r['precision']} | {r['layouts']} | {conc} | {rho} |")
    return "\n".join(lines) + "\n"


def run_errors(local_path: Path, published_path: Path, out_path: Path) -> str:
    published = read_parquet(published_path)
    text = ("### Real runs on this machine (local-cpu / local-gloo)\n\n"
            + local_markdown(read_parquet(local_path))
            + "\n\n### Published measurements\n\n"
            + published_markdown(published) + "\n"
            + "\n### Ranking fidelity (does Echo order a model's layouts as the measurements do?)\n\n"
            + rankings_markdown(published))
    with atomic_path(out_path) as tmp:
        tmp.write_text(text)
    return text
