"""The simulated step as tables and as a Chrome trace-event file (Perfetto and chrome://tracing
open it): one process per class on each pipeline stage, one thread per stream, complete ("X")
events in microseconds.

In symmetric mode the classes of one pipeline stage share its timeline, so each stage event is
written once per class of that stage; a class that spans stages (the middle stages of a
pipeline hash alike) gets one process per stage. Process ids are 1, 2, ... in (stage, class)
order: Perfetto treats pid 0 as the kernel's swapper (google/perfetto#394); the process name
carries the class id and stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from echo.artifacts import TIMELINE
from echo.simulate.engine import Event

STREAMS = ("compute", "comm", "p2p_fwd", "p2p_bwd")  # thread ids 1, 2, ... in this order


def _tid(stream: str) -> int:
    return 1 + (STREAMS.index(stream) if stream in STREAMS else len(STREAMS))


def _pids(stage_classes: Mapping[int, Sequence[int]]) -> dict[tuple[int, int], int]:
    """(stage, class_id) -> pid."""
    pairs = sorted((s, c) for s, classes in stage_classes.items() for c in classes)
    return {pair: i + 1 for i, pair in enumerate(pairs)}


def timeline_table(events: Sequence[Event], stage_classes: Mapping[int, Sequence[int]]) -> pa.Table:
    """TIMELINE rows: every event once per class of its stage."""
    cols: dict[str, list] = {f.name: [] for f in TIMELINE}
    for e in events:
        for class_id in stage_classes.get(e.stage, ()):
            for name, value in (("class_id", class_id), ("pp_rank", e.stage), ("stream", e.stream),
                                ("name", e.name), ("kind", e.kind), ("microbatch", e.microbatch),
                                ("chunk", e.chunk), ("start_s", e.start_us / 1e6), ("end_s", e.end_us / 1e6)):
                cols[name].append(value)
    return pa.table(cols, schema=TIMELINE)


def _metadata(pid: int, class_id: int, stage: int, streams: Sequence[str]) -> list[dict]:
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
             "args": {"name": f"class {class_id} (pp stage {stage})"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for stream in streams:
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _tid(stream),
                     "args": {"name": stream}})
    return meta


def chrome_trace(events: Sequence[Event], stage_classes: Mapping[int, Sequence[int]],
                 other_data: Mapping[str, object] | None = None) -> dict:
    """The trace-event JSON object (``{"traceEvents": [...]}``) for ``events``."""
    pids = _pids(stage_classes)
    streams_of: dict[int, set[str]] = {}
    out: list[dict] = []
    for e in events:
        streams_of.setdefault(e.stage, set()).add(e.stream)
        args = {"microbatch": e.microbatch, "chunk": e.chunk, "kind": e.kind}
        for class_id in stage_classes.get(e.stage, ()):
            out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pids[(e.stage, class_id)],
                        "tid": _tid(e.stream), "ts": e.start_us, "dur": e.end_us - e.start_us, "args": args})
    meta = [m for (stage, c), pid in pids.items()
            for m in _metadata(pid, c, stage, sorted(streams_of.get(stage, ()), key=_tid))]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms", "otherData": dict(other_data or {})}
