"""Pair predictions with measurements for the report, from whatever the validation rules wrote.

Understood (anything else is skipped with a log line):

- ``results/validate/published.parquet`` and any table with ``predicted_step_time_s`` and
  ``measured_step_time_s`` columns: one point per row, labelled by its ``workload`` (and the
  published ``table``, as the point's source, where present);
- ``results/validate/{workload}/{hardware}/{topology}/compare.parquet`` (``item``,
  ``predicted_s``, ``measured_s``): its ``step_time`` row of the whole step (``stage`` -1);
- ``results/measure/{workload}/measured.parquet`` (``workload``, ``median_step_time_s``): paired
  with the prediction for the same workload on ``local-cpu`` (this machine) among the summaries.

A point measured on this machine is labelled by workload and topology; one experiment appears
once (a compare table wins over a bare measurement of the same run).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from echo.io import read_parquet

log = logging.getLogger(__name__)
LOCAL_HARDWARE = "local-cpu"
HERE = "measured on this machine"


def _label(row: dict, keys=("workload", "hardware", "topology")) -> str:
    return " / ".join(str(row[k]) for k in keys if row.get(k))


def measurement_points(paths: Sequence[Path | str], summaries: Sequence[dict]) -> list[dict]:
    """[{label, predicted_s, measured_s, source}] from the measurement files and the summaries."""
    points: list[dict] = []
    for path in paths:
        table = read_parquet(path)
        cols = set(table.column_names)
        rows = table.to_pylist()
        if {"predicted_step_time_s", "measured_step_time_s"} <= cols:
            for r in rows:
                source = f"published: {r['table']}" if r.get("table") else "published"
                points.append({"label": _label(r, ("workload",)) or Path(path).stem, "source": source,
                               "predicted_s": r["predicted_step_time_s"], "measured_s": r["measured_step_time_s"]})
        elif {"item", "predicted_s", "measured_s"} <= cols:
            for r in rows:
                if r["item"] == "step_time" and r.get("stage", -1) == -1:
                    points.append({"label": _label(r, ("workload", "topology")), "source": HERE,
                                   "predicted_s": r["predicted_s"], "measured_s": r["measured_s"]})
        elif {"workload", "median_step_time_s"} <= cols and rows:
            for s in summaries:
                if s["workload"] == rows[0]["workload"] and s["hardware"] == LOCAL_HARDWARE:
                    points.append({"label": _label(s, ("workload", "topology")), "source": HERE,
                                   "predicted_s": s["step_time_s"], "measured_s": rows[0]["median_step_time_s"]})
        else:
            log.info("%s: no predicted/measured step times, skipped", path)
    seen: dict[tuple[str, str], dict] = {}
    for p in points:
        if p["predicted_s"] and p["measured_s"]:
            seen.setdefault((p["source"], p["label"]), p)
    return list(seen.values())
