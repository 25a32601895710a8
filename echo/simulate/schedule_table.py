"""schedule.parquet: the pipeline's send/recv sequence of every traced rank, in the order simulated:
the traced per-chunk p2p (one forward, one backward) expanded over each stage's task order
(echo.training.schedule), a table to audit beside the timeline."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from echo.artifacts import SCHEDULE
from echo.config.workload import Workload
from echo.training.layout import Layout
from echo.training.schedule import Task

_PHASE = {"F": "forward", "B": "backward", "W": None}  # a W task sends and receives nothing


def schedule_table(w: Workload, comms: pa.Table, orders: Sequence[Sequence[Task]]) -> pa.Table:
    """SCHEDULE rows of ``comms`` (rank, op, phase, chunk, peer, bytes) over each stage's ``orders``."""
    layout = Layout(w.parallel)
    rows = comms.to_pylist()
    p2p = [r for r in rows if r["op"] in ("send", "recv")]
    cols: dict[str, list] = {f.name: [] for f in SCHEDULE}
    for rank in sorted({r["rank"] for r in rows} | set(layout.representatives().values())):
        template = [r for r in p2p if r["rank"] == rank]
        for step, task in enumerate(orders[layout.coords(rank).pp]):
            for r in template:
                if r["phase"] == _PHASE[task.kind] and r["chunk"] == task.chunk:
                    row = dict(rank=rank, step=step, task=task.kind, microbatch=task.microbatch,
                               chunk=task.chunk, op=r["op"], peer=r["peer"], bytes=r["bytes"])
                    for k, v in row.items():
                        cols[k].append(v)
    return pa.table(cols, schema=SCHEDULE)
