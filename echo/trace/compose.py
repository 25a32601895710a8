"""A traced rank composed from layer templates (echo.trace.template), whole: the micro-batch's
phases from the pieces, the gradient reduction and optimizer step traced for real over stand-in
parameters, and the rank's row.

The reduction and the step do not depend on what the parameters hold, only on how many elements
each has, in which order, which are experts and which reduce over tp first
(``echo.training.data_parallel``). The template's parameter manifest says that for one block and
for the chunk's outer modules; the target chunk's list repeats the block's entries once per
block. ``echo.training.data_parallel.DataParallel`` then runs over parameters of those sizes,
recorded as the tracer records it (``trace_tail``), in a process of the target rank (the fake
process group is per process); ``compose_ranks`` forks those processes from one that has already
imported torch, so a rank costs tens of milliseconds, not an interpreter.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import torch
from torch import nn

from echo.artifacts import COMMS, DEPS, OPS, TRACED_RANKS
from echo.config.workload import Workload
from echo.trace.step import process_settings
from echo.trace.template import (
    DEPTH,
    NotComposable,
    Piece,
    chunk_kind,
    compose,
    needed,
    template_workload,
    trace_pieces,
)
from echo.training.layout import Layout, chunk_slots


def chunk_params(piece: Piece, n: int) -> list[dict]:
    """The parameter entries of a chunk of ``n`` blocks of ``piece``'s kind, in module order."""
    rows = piece.params
    blocks = [r for r in rows if r["layer"] >= 0]
    if not blocks:
        raise NotComposable(f"{piece.kind}: no block parameters in the template")
    first, last = rows.index(blocks[0]), rows.index(blocks[-1])
    if any(r["layer"] < 0 for r in rows[first:last + 1]):
        raise NotComposable(f"{piece.kind}: outer parameters between the blocks' parameters")
    per_block = [[(r["numel"], r["dtype"], r["expert"], r["tp_partial"]) for r in blocks if r["layer"] == i]
                 for i in range(piece.depth)]
    if any(b != per_block[0] for b in per_block):
        raise NotComposable(f"{piece.kind}: blocks of the template hold different parameters")
    one = [r for r in blocks if r["layer"] == 0]
    return rows[:first] + [r for _ in range(n) for r in one] + rows[last + 1:]


class _StandIn(nn.Module):
    """Parameters of the given sizes and kinds, in order: what the gradient reduction reads."""

    def __init__(self, rows: list[dict]):
        super().__init__()
        self.params = nn.ParameterList()
        for r in rows:
            p = nn.Parameter(torch.empty(r["numel"], dtype=getattr(torch, r["dtype"])))
            p.echo_tp_partial = r["tp_partial"]
            if r["expert"]:
                p.echo_expert = True
            self.params.append(p)


@process_settings()
def trace_tail(w: Workload, rank: int, chunks: list[list[dict]]) -> dict:
    """The gradient reduction and optimizer step of ``rank`` over parameters ``chunks`` (one entry
    list per chunk), recorded; with the rank's parameter, gradient and optimizer bytes. Run in a
    process with no process group of its own (it creates the rank's fake one)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from echo.trace.recorder import Recorder
    from echo.trace.step import _groups
    from echo.training import data_parallel
    from echo.training.model import DTYPES

    layout, p, t = Layout(w.parallel), w.parallel, w.training
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        rec = Recorder(rank)
        groups = _groups(layout, rank, rec)
        dtype = DTYPES[t.dtype]
        torch.set_default_dtype(dtype)
        grad_dtype = torch.float32 if t.grad_reduce_in_fp32 else dtype
        with rec, rec.muted():
            modules = [_StandIn(rows) for rows in chunks]
        with rec:
            dp = data_parallel.DataParallel(modules, groups, p, dtype, rec=rec, grad_dtype=grad_dtype)
            dp.grad_sync()
            dp.step()
        mem = data_parallel.rank_memory(modules, groups, p, dtype, 0, grad_dtype)
        return {**rec.tables(), "param_bytes": mem.param_bytes, "grad_bytes": mem.grad_bytes,
                "optimizer_bytes": mem.optimizer_bytes}
    finally:
        dist.destroy_process_group()


def tail_jobs(w: Workload, pieces: dict, ranks: list[int]) -> list[tuple]:
    """(workload, rank, chunk parameter lists) for each rank's ``trace_tail``."""
    layout, jobs = Layout(w.parallel), []
    for rank in ranks:
        chunks = []
        for slot in chunk_slots(w.parallel, w.model.layers, layout.coords(rank).pp):
            n = len(slot.layers)
            chunks.append(chunk_params(pieces[(chunk_kind(slot.first, slot.last), DEPTH if n > 1 else 1)], n))
        jobs.append((w, rank, chunks))
    return jobs


def tail_key(job: tuple) -> str:
    """What a tail depends on: the group sizes, the numerics and the parameters; ranks with equal
    keys (the middle stages of a pipeline; layouts that differ only in the micro-batch, the
    recompute or the schedule) run the same tail over their own groups."""
    import hashlib
    import json

    w, _, chunks = job
    p, t = w.parallel, w.training
    key = {"sizes": [p.tp, p.cp, p.dp, p.pp, p.ep, p.zero, p.sequence_parallel], "dtype": t.dtype,
           "fp32_grads": t.grad_reduce_in_fp32,
           "params": [[(r["numel"], r["dtype"], r["expert"], r["tp_partial"]) for r in rows] for rows in chunks]}
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def relabel_tail(tail: dict, layout: Layout, rank: int) -> dict:
    """A tail traced on another rank of the same layout, over ``rank``'s groups (the c10d calls
    of the reduction and the step carry no rank in their arguments; their comms rows do)."""
    comms, groups = [], {}
    for c in tail["comms"].to_pylist():
        kind = c["group_kind"]
        if kind not in groups:
            groups[kind] = layout.expert_group(rank, kind) if kind in ("ep", "edp") else layout.group(rank, kind)
        comms.append({**c, "rank": rank, "group": groups[kind], "group_size": len(groups[kind])})
    return {**tail, "ops": tail["ops"].set_column(0, "rank", pa.array([rank] * tail["ops"].num_rows, pa.int32())),
            "comms": pa.Table.from_pylist(comms, schema=COMMS),
            "deps": tail["deps"].set_column(0, "rank", pa.array([rank] * tail["deps"].num_rows, pa.int32()))}


_TAILS: dict[str, dict] = {}  # tail_key -> a traced tail, kept for the process's later layouts


def _tail_job(job: tuple) -> dict:
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    return trace_tail(*job)


def tails(jobs: list[tuple], processes: int) -> list[dict]:
    """``trace_tail`` of each job: one trace per distinct ``tail_key`` (in processes forked from
    this one, which has torch imported), relabelled for the ranks that share it."""
    keys = [tail_key(j) for j in jobs]
    todo = {k: j for k, j in zip(keys, jobs, strict=True) if k not in _TAILS}
    from echo.trace.runner import forked_map

    # the reduction and the step make c10d calls without group names in their arguments, so one
    # process may trace many tails in turn, each under its own fake process group
    for k, tail in zip(todo, forked_map(_tail_job, list(todo.values()), processes, fresh=False), strict=True):
        _TAILS[k] = {**tail, "layout": Layout(todo[k][0].parallel), "rank": todo[k][1]}
    out = []
    for k, (w, rank, _) in zip(keys, jobs, strict=True):
        hit = _TAILS[k]
        # a tail of another layout with the same sizes: its groups are this layout's
        out.append(hit if hit["rank"] == rank and hit["layout"] == Layout(w.parallel)
                   else relabel_tail(hit, Layout(w.parallel), rank))
    return out


def assemble(w: Workload, rank: int, micro: dict[str, pa.Table], tail: dict, memory: dict, wall_s: float) -> dict[str, pa.Table]:
    """One rank's ops, comms, deps and ranks row: the micro-batch's phases, then the tail."""
    from echo.trace.hashing import graph_hash

    n_ops, n_comms = micro["ops"].num_rows, micro["comms"].num_rows
    t_ops = tail["ops"].to_pylist()
    for o in t_ops:
        o["seq"] += n_ops
        o["comm_id"] = o["comm_id"] + n_comms if o["comm_id"] >= 0 else -1
    t_comms = [{**c, "seq": c["seq"] + n_ops, "comm_id": c["comm_id"] + n_comms} for c in tail["comms"].to_pylist()]
    t_deps = [{**d, "src": d["src"] + n_ops, "dst": d["dst"] + n_ops} for d in tail["deps"].to_pylist()]
    ops = pa.concat_tables([micro["ops"], pa.Table.from_pylist(t_ops, schema=OPS)])
    comms = pa.concat_tables([micro["comms"], pa.Table.from_pylist(t_comms, schema=COMMS)])
    deps = pa.concat_tables([micro["deps"], pa.Table.from_pylist(t_deps, schema=DEPS)])
    layout = Layout(w.parallel)
    c = layout.coords(rank)
    from echo.training.model import chunk_buffer_bytes

    # the model's buffers (llama's RoPE tables) are held beside the parameters, as trace_rank counts them
    param_bytes = tail["param_bytes"] + chunk_buffer_bytes(w, c.pp)
    ranks = pa.table({
        "rank": [rank], "role": [layout.role_of(rank)], "pp_rank": [c.pp], "tp_rank": [c.tp], "dp_rank": [c.dp],
        "cp_rank": [c.cp], "graph_hash": [graph_hash(ops, comms, layout, rank)], "param_bytes": [param_bytes],
        "grad_bytes": [tail["grad_bytes"]], "optimizer_bytes": [tail["optimizer_bytes"]],
        "activation_bytes_per_microbatch": [memory["saved_bytes"]], "trace_wall_s": [wall_s]}, schema=TRACED_RANKS)
    ranks = ranks.append_column("peak_bytes_per_microbatch", pa.array([memory["peak_bytes"]], pa.int64()))
    ranks = ranks.append_column("activation_bytes_per_chunk", pa.array([list(memory["chunk_bytes"])], pa.list_(pa.int64())))
    ranks = ranks.append_column("reserved_bytes_per_microbatch", pa.array([memory["reserved_bytes"]], pa.int64()))
    return {"ops": ops, "comms": comms, "deps": deps, "ranks": ranks}


def signature(w: Workload) -> str:
    """What ``w``'s templates depend on: its template job without the name (layouts that share
    it share the templates)."""
    import hashlib
    import json

    dump = template_workload(w, 3).trace_dump()
    dump.pop("name", None)
    dump.pop("description", None)
    return hashlib.sha256(json.dumps(dump, sort_keys=True, default=str).encode()).hexdigest()[:16]


_PIECES: dict[tuple[str, str], dict] = {}  # (cache folder, signature) -> pieces read so far


def cached_pieces(w: Workload, cache_dir: Path, jobs: int | None = None) -> dict:
    """``w``'s pieces, from ``{cache_dir}/{signature}/`` (traced there first if need be), kept
    in this process for the next layout with the same blocks."""
    key = (str(cache_dir), signature(w))
    have = _PIECES.setdefault(key, {})
    if not needed(w) <= set(have):
        have.update(trace_pieces(w, Path(cache_dir) / key[1], jobs=jobs))
    return {k: have[k] for k in needed(w)}


def compose_trace(w: Workload, out_dir: Path, cache_dir: Path, processes: int = 1) -> dict[str, pa.Table]:
    """``run_trace``'s artifacts for ``w`` (ops, comms, deps, ranks in ``out_dir``), composed from
    layer templates cached in ``cache_dir``; returns the tables."""
    from echo.io import write_parquet
    from echo.trace.runner import TABLES

    reps = sorted(Layout(w.parallel).representatives().values())
    ranks = compose_ranks(w, cached_pieces(w, cache_dir, processes), reps, processes)
    tables = {name: pa.concat_tables([ranks[r][name] for r in reps]) for name in TABLES}
    for name, schema in TABLES.items():
        write_parquet(tables[name], Path(out_dir) / f"{name}.parquet", schema)
    return tables


class _Recent(dict):
    """A dict that forgets its oldest entries past ``size`` (a search worker's recent layouts)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        while len(self) > self.size:
            del self[next(iter(self))]


# Composed parts that layouts of one search share, kept in the process that composes them:
# a rank's micro-batch memory follows its pieces and its chunks' kinds and depths alone (the
# middle stages of every layout with the same blocks per chunk share it), and its micro-batch
# graph is the same for ZeRO 0, 1 and 2 (one template stands for the three).
_MEMORY: _Recent = _Recent(4096)
_MICRO: _Recent = _Recent(64)


def compose_ranks(w: Workload, pieces: dict, ranks: list[int], processes: int = 1) -> dict[int, dict[str, pa.Table]]:
    """Every rank of ``ranks`` composed whole."""
    from echo.trace.memory_template import compose_memory

    t0 = time.perf_counter()
    done = tails(tail_jobs(w, pieces, ranks), processes)
    out = {}
    layout = Layout(w.parallel)
    # the parts are kept only for pieces read from a template folder, and by that folder: pieces
    # of the same signature from another (re-traced, or damaged) folder are composed anew
    origin = tuple(sorted((k, p.origin) for k, p in pieces.items()))
    keep = all(o for _, o in origin)
    graph = (origin, w.model.layers, w.parallel.model_dump_json(exclude={"zero"}))
    micro_parts = _MICRO if keep else {}
    memory_parts = _MEMORY if keep else {}
    for rank, tail in zip(ranks, done, strict=True):
        t = time.perf_counter()
        if (graph, rank) not in micro_parts:
            micro_parts[(graph, rank)] = compose(pieces, w, rank)
        slots = chunk_slots(w.parallel, w.model.layers, layout.coords(rank).pp)
        shape = (origin, tuple((chunk_kind(s.first, s.last), len(s.layers)) for s in slots))
        if shape not in memory_parts:
            memory_parts[shape] = compose_memory(pieces, w, rank)
        out[rank] = assemble(w, rank, micro_parts[(graph, rank)], tail, memory_parts[shape],
                             time.perf_counter() - t + (t - t0) / len(ranks))
    return out


def differences(composed: dict[str, pa.Table], traced: dict[str, pa.Table]) -> list[str]:
    """Where one composed rank differs from its full trace (both: that rank's ops, comms, deps
    and ranks tables): the first differing row of each table, row counts that differ; every
    column but the ranks row's ``trace_wall_s``. Empty: the graphs are the same."""
    out = []
    for name in ("ops", "comms", "deps", "ranks"):
        a, b = composed[name], traced[name]
        if name == "ranks":
            a, b = a.drop_columns(["trace_wall_s"]), b.drop_columns(["trace_wall_s"])
        if a.column_names != b.column_names:
            out.append(f"{name}: columns {a.column_names} composed, {b.column_names} traced")
            continue
        a, b = a.to_pylist(), b.to_pylist()
        if len(a) != len(b):
            out.append(f"{name}: {len(a)} composed rows, {len(b)} traced")
        bad = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if bad is not None:
            diff = {k: (a[bad][k], b[bad][k]) for k in a[bad] if a[bad][k] != b[bad][k]}
            out.append(f"{name} row {bad}: {diff}")
    return out
