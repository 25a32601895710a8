"""The pipeline's send/recv sequence of every traced rank, in the workload's schedule order.

The tracer records one forward and one backward per model chunk (their p2p included); the
schedule (echo.training.schedule, the one definition the simulator also runs) says in which
order each stage runs those passes over the micro-batches. Expanding one by the other gives the
micro-batch order and the p2p pattern of the iteration, as a table to audit.
"""

from __future__ import annotations

import pyarrow as pa

from echo.artifacts import SCHEDULE
from echo.config.workload import Workload
from echo.training.layout import Layout
from echo.training.schedule import stage_orders

_PHASE = {"F": "forward", "B": "backward"}


def schedule_table(w: Workload, comms: pa.Table) -> pa.Table:
    p, layout = w.parallel, Layout(w.parallel)
    orders = stage_orders(p.schedule, p.pp, w.micro_batches, p.virtual_stages)
    p2p = [r for r in comms.to_pylist() if r["op"] in ("send", "recv")]
    cols: dict[str, list] = {f.name: [] for f in SCHEDULE}
    for rank in sorted({r["rank"] for r in comms.to_pylist()} | set(layout.representatives().values())):
        template = [r for r in p2p if r["rank"] == rank]
        for step, task in enumerate(orders[layout.coords(rank).pp]):
            for r in template:
                if r["phase"] == _PHASE[task.kind] and r["chunk"] == task.chunk:
                    row = dict(rank=rank, step=step, task=task.kind, microbatch=task.microbatch,
                               chunk=task.chunk, op=r["op"], peer=r["peer"], bytes=r["bytes"])
                    for k, v in row.items():
                        cols[k].append(v)
    return pa.table(cols, schema=SCHEDULE)
