"""Plans as Arrow rows: one experiment's plan (the report's summaries gain its columns) and a
search's time-to-train against GPU count (``echo plan-search``, the report's figure)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa

from echo.plan.planner import Plan

# the columns a plan adds to an experiment's summary row (plan_ prefixed where a summary has the name)
PLAN_COLUMNS = ("site", "tokens", "expected_step_s", "interruptions_per_day", "mtti_h", "checkpoint_gb",
                "checkpoint_interval_steps", "effective_training_time", "ideal_days", "time_to_train_days",
                "interruptions", "gpu_hours", "usd_per_gpu_hour", "cost_usd", "energy_mwh", "gpu_busy")


# plan.parquet (rule plan_experiment): typed, so that a figure unknown for every row (a price, an
# energy without a power section) is a float column of nulls, not a column of no type
PLAN_SCHEMA = pa.schema(
    [(k, pa.string()) for k in ("workload", "hardware", "topology", "site")]
    + [(k, pa.int64() if k == "checkpoint_interval_steps" else pa.float64()) for k in PLAN_COLUMNS if k != "site"]
    + [("provenance", pa.string())])


def plan_table(records: Sequence[Mapping]) -> pa.Table:
    """``plan_record`` rows as a PLAN_SCHEMA table."""
    return pa.Table.from_pylist([dict(r) for r in records], schema=PLAN_SCHEMA)


def plan_record(p: Plan) -> dict:
    """One plan as a flat row: the summary's keys (workload, hardware, topology), the figures of
    ``PLAN_COLUMNS`` and where each came from (``provenance``, JSON)."""
    d = p.to_dict()
    row = {"workload": p.workload, "hardware": p.hardware, "topology": p.topology}
    row.update({k: d[k] for k in PLAN_COLUMNS if k != "interruptions_per_day"})
    row["interruptions_per_day"] = p.interruptions_per_day["total"]
    row["provenance"] = json.dumps(p.provenance, sort_keys=True)
    return row


def scaling_rows(planned: Iterable[tuple[Mapping, Plan]]) -> list[dict]:
    """(layout row, plan) pairs (``echo.plan.scaling.scaling_plans``) as the time-to-train table."""
    return [{"gpus": p.gpus, "layout": r["layout"], "topology": p.topology, "step_time_s": p.step_time_s,
             "effective_training_time": p.effective_training_time, "ideal_days": p.ideal_days,
             "time_to_train_days": p.time_to_train_days, "interruptions": p.interruptions,
             "gpu_hours": p.gpu_hours, "cost_usd": p.cost_usd, "energy_mwh": p.energy_mwh} for r, p in planned]
