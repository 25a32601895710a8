"""The simulated step as tables and as a Chrome trace-event file (Perfetto and chrome://tracing
open it): complete ("X") events in microseconds, one thread per stream, and flows linking the
two ends of every pipeline transfer (the send to the task that received it) and the members of
every collective in full mode.

Symmetric mode: one process per class on each pipeline stage. The classes of one stage share
its timeline, so each stage event is written once per class of that stage; a class that spans
stages (the middle stages of a pipeline hash alike) gets one process per stage; flows are drawn
on the first class of each stage. Full mode: one process per rank.

Process ids are 1, 2, ... (Perfetto treats pid 0 as the kernel's swapper, google/perfetto#394);
the process name carries the class id and stage (and rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from echo.artifacts import TIMELINE
from echo.simulate.engine import EngineResult, Event

STREAMS = ("compute", "collective", "comm", "p2p_fwd", "p2p_bwd", "ep")  # thread ids 1, 2, ... in this order


_TIDS = {s: i + 1 for i, s in enumerate(STREAMS)}


def _tid(stream: str) -> int:
    return _TIDS.get(stream, len(STREAMS) + 1)


def _processes(result: EngineResult, stage_classes: Mapping[int, Sequence[int]],
               rank_class: Mapping[int, int] | None) -> tuple[dict, list[tuple[int, str]]]:
    """(key -> [(pid, class_id)], [(pid, name)]); key = stage (symmetric) or rank (full)."""
    if result.mode == "full":
        ranks = sorted(set(rank_class or {}) | {e.rank for e in result.events})
        stage_of = dict(zip(sorted(ranks), result.rank_stage, strict=False)) if result.rank_stage else {}
        out = {r: [(i + 1, (rank_class or {}).get(r, -1))] for i, r in enumerate(ranks)}
        names = [(i + 1, f"rank {r} (class {(rank_class or {}).get(r, -1)}, pp stage {stage_of.get(r, -1)})")
                 for i, r in enumerate(ranks)]
        return out, names
    pairs = sorted((s, c) for s, classes in stage_classes.items() for c in classes)
    pid = {pair: i + 1 for i, pair in enumerate(pairs)}
    out = {}
    for s, c in pairs:
        out.setdefault(s, []).append((pid[(s, c)], c))
    return out, [(pid[(s, c)], f"class {c} (pp stage {s})") for s, c in pairs]


def _key(result: EngineResult, e: Event) -> int:
    return e.rank if result.mode == "full" else e.stage


def timeline_table(result: EngineResult, stage_classes: Mapping[int, Sequence[int]],
                   rank_class: Mapping[int, int] | None = None) -> pa.Table:
    """TIMELINE rows (plus rank, -1 in symmetric mode): symmetric mode writes every event once per
    class of its stage, full mode once per rank."""
    procs, _ = _processes(result, stage_classes, rank_class)
    rows = [(class_id, e) for e in result.events for _, class_id in procs.get(_key(result, e), ())]
    # column by column: tens of thousands of events at 16K GPUs
    cols: dict[str, list] = {"class_id": [c for c, _ in rows]}
    for name in ("stage", "stream", "name", "kind", "microbatch", "chunk", "rank"):
        cols["pp_rank" if name == "stage" else name] = [getattr(e, name) for _, e in rows]
    cols["start_s"] = [e.start_us / 1e6 for _, e in rows]
    cols["end_s"] = [e.end_us / 1e6 for _, e in rows]
    return pa.table(cols, schema=TIMELINE.append(pa.field("rank", pa.int32())))


def chrome_trace(result: EngineResult, stage_classes: Mapping[int, Sequence[int]],
                 rank_class: Mapping[int, int] | None = None, other_data: Mapping[str, object] | None = None) -> dict:
    """The trace-event JSON object (``{"traceEvents": [...]}``) of the simulated step."""
    procs, names = _processes(result, stage_classes, rank_class)
    full = result.mode == "full"
    streams_of: dict[int, set[str]] = {}  # key (stage or rank) -> its streams
    out: list[dict] = []
    ends: dict[int, list[tuple[float, int, int]]] = {}  # flow id -> [(ts, pid, tid)]
    for e in result.events:  # tens of thousands at 16K GPUs: the loop is kept lean
        key = e.rank if full else e.stage
        targets = procs.get(key, ())
        if not targets:
            continue
        streams_of.setdefault(key, set()).add(e.stream)
        tid = _TIDS.get(e.stream, len(STREAMS) + 1)
        args = {"microbatch": e.microbatch, "chunk": e.chunk, "kind": e.kind}
        if e.rank >= 0:
            args["rank"] = e.rank
        dur = e.end_us - e.start_us
        out += [{"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": tid, "ts": e.start_us, "dur": dur,
                 "args": args} for pid, _ in targets]
        if e.flow >= 0:
            ends.setdefault(e.flow, []).append((e.start_us, targets[0][0], tid))
    flows = []
    for fid, points in ends.items():
        if len(points) < 2:
            continue
        points.sort()
        for j, (ts, pid, tid) in enumerate(points):
            ph = "s" if j == 0 else ("f" if j == len(points) - 1 else "t")
            ev = {"ph": ph, "id": fid, "name": "transfer", "cat": "flow", "pid": pid, "tid": tid, "ts": ts}
            if ph != "s":
                ev["bp"] = "e"
            flows.append(ev)
    pid_streams = {pid: streams_of.get(key, set()) for key, targets in procs.items() for pid, _ in targets}
    meta: list[dict] = []
    for pid, name in names:
        meta += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
                 {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
        for stream in sorted(pid_streams.get(pid, ()), key=_tid):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": _tid(stream), "args": {"name": stream}})
    return {"traceEvents": meta + out + flows, "displayTimeUnit": "ms", "otherData": dict(other_data or {})}
