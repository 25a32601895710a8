"""Entry point of one tracing process: ``python -m echo.trace.worker WORKLOAD_JSON RANK OUT_DIR
[--label-layers]`` (the last for layer templates: echo.trace.template).

Each traced rank runs in its own process because the fake process group cannot change groups
within one process (docs/DESIGN.md, "Tracing on a CPU").
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from echo.config.workload import Workload
from echo.io import write_parquet
from echo.trace.hashing import graph_hash
from echo.trace.step import trace_rank
from echo.training.layout import Layout


def main(argv: list[str]) -> None:
    label = "--label-layers" in argv
    workload_json, rank, out_dir = [a for a in argv if a != "--label-layers"]
    warnings.filterwarnings("ignore", category=UserWarning)  # funcol's "not awaited" noise under fake tensors
    workload = Workload.model_validate(json.loads(Path(workload_json).read_text()))
    tables = trace_rank(workload, int(rank), label_layers=label)
    digest = graph_hash(tables["ops"], tables["comms"], Layout(workload.parallel), int(rank))
    tables["ranks"] = tables["ranks"].set_column(
        tables["ranks"].schema.get_field_index("graph_hash"), "graph_hash", [[digest]])
    for name, table in tables.items():
        write_parquet(table, Path(out_dir) / f"{name}.parquet")


if __name__ == "__main__":
    main(sys.argv[1:])
