"""A sweep's tables: every candidate layout (kept or dropped, with why), and the ranking of the
simulated layouts by step time among those that fit in memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa

from echo.artifacts import SUMMARY
from echo.io import read_parquet
from echo.sweep.spec import AXES, Expansion, split_name


def _axis_type(axis: str) -> pa.DataType:
    if axis in ("schedule", "recompute"):
        return pa.string()
    if axis in ("sequence_parallel", "post_validation"):
        return pa.bool_()
    return pa.int64()


LAYOUTS = pa.schema([
    ("sweep", pa.string()),
    ("layout", pa.string()),      # the workload name, {sweep}--{tokens}
    ("tokens", pa.string()),
    ("kept", pa.bool_()),
    ("key", pa.string()),         # the key that made it invalid (dropped only)
    ("reason", pa.string()),      # why it was dropped
    ("trace", pa.string()),       # the shared trace's workload name (kept only)
    *[(a, _axis_type(a)) for a in AXES],
])


def layouts_table(exp: Expansion) -> pa.Table:
    """One row per candidate combination of the sweep's axes."""
    rows = []
    for c in exp.candidates:
        rows.append({"sweep": exp.sweep.name, "layout": c.name, "tokens": split_name(c.name)[1], "kept": c.kept,
                     "key": c.key or None, "reason": c.reason or None, "trace": c.trace or None,
                     **{a: c.values.get(a) for a in AXES}})
    return pa.Table.from_pylist(rows, schema=LAYOUTS)


RANKING = pa.schema([
    ("rank", pa.int64()),          # 1 = fastest among the layouts that fit in memory; null: does not fit
    ("layout", pa.string()),
    ("tokens", pa.string()),
    ("hardware", pa.string()),
    ("topology", pa.string()),
    *[(a, _axis_type(a)) for a in AXES],
    ("step_time_s", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("tflops_per_gpu", pa.float64()),
    ("mfu", pa.float64()),
    ("peak_mem_gib", pa.float64()),
    ("fits", pa.bool_()),
    ("compute_s", pa.float64()),
    ("exposed_comm_s", pa.float64()),
    ("bubble_s", pa.float64()),
    ("bubble_fraction", pa.float64()),
    ("world_size", pa.int64()),
    ("sim_wall_s", pa.float64()),
    ("trace", pa.string()),        # the shared trace's workload name
])
SUMMARY_COLUMNS = tuple(f.name for f in RANKING if f.name not in {"rank", "layout", "tokens", "hardware",
                                                                   "topology", "trace", *AXES})


def ranking_table(layouts: pa.Table, summaries: Sequence[Path | str]) -> pa.Table:
    """Kept layouts x topologies (``layouts``: a LAYOUTS table; ``summaries``: their simulate
    summaries), best first: those that fit in memory by step time (rank 1, 2, ...), then those
    that do not (rank null), also by step time."""
    kept = {r["layout"]: r for r in layouts.to_pylist() if r["kept"]}
    rows = []
    for path in summaries:
        row = read_parquet(path, SUMMARY).to_pylist()[0]
        layout = kept[row["workload"]]
        rows.append({"layout": layout["layout"], "tokens": layout["tokens"], "hardware": row["hardware"],
                     "topology": row["topology"], **{a: layout[a] for a in AXES},
                     **{k: row.get(k) for k in SUMMARY_COLUMNS}, "trace": layout["trace"]})
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"], r["layout"], r["topology"]))
    for i, r in enumerate(rows):
        r["rank"] = i + 1 if r["fits"] else None
    return pa.Table.from_pylist(rows, schema=RANKING)


def best(ranking: pa.Table, n: int = 3) -> list[dict]:
    """The first ``n`` ranked (fitting) rows."""
    return [r for r in ranking.to_pylist() if r["rank"] is not None][:n]
