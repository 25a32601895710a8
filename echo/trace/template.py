"""Layer templates: a rank's per-micro-batch graph composed from blocks traced once.

A transformer rank's forward and backward are its chunks' blocks, one after another, between a
chunk's outer ops (the pipeline receive and send, the embedding, the final norm, head and loss).
Every block of a chunk runs the same kernels on the same shapes, so tracing each block of a
30-layer stage traces one block 30 times. A template traces a small job of the same kind once,
labelled block by block (``Recorder.label_layers``), and a rank of any depth, pipeline size and
data-parallel size is composed from it.

The template job (``template_workload``) keeps everything a block's kernels and collectives
depend on (model, tp, cp, ep, sequence parallelism, micro-batch, recompute, dtype, ZeRO below 3)
and shrinks the rest: ``DEPTH`` blocks per stage, one chunk per rank, the fewest data-parallel
ranks the expert layout allows, and three pipeline stages, whose ranks hold the three kinds of
chunk (``first`` with the embedding, ``middle``, ``last`` with the loss); a one-stage job holds
the fourth (``only``). Each kind's piece is its forward block and its backward block (recompute
included) from the template rank's trace.

Composition (``compose``) lays out each of the target rank's chunks from its kind's piece: the
piece's outer ops as they are, template block 0 as the chunk's first block, block ``DEPTH - 1``
as its last and block 1 as every block between; a chunk of one block needs a one-block
template. Dependencies keep their distance in blocks (an op reading the previous block's output
reads the previous block's), collectives move to the target rank's groups of the same kind, and
pipeline transfers to its peers. What the template cannot stand for is refused with the reason
(``NotComposable``): a piece whose blocks differ in their kernels, collectives over groups
whose size follows the data-parallel or pipeline size (ZeRO 3 / FSDP gathers, FP8 amax
reductions over the stage), or blocks interleaved with outer ops.

Only the micro-batch's phases (forward, backward, recompute) are composed; the gradient
reduction, the optimizer step and the memory follow the whole stage's parameters and are traced
with it. ``check`` compares a composed graph with a full trace op by op.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pac

from echo.artifacts import COMMS, DEPS, OPS
from echo.config.workload import Workload
from echo.trace.hashing import dtensor_flags, kernel_key
from echo.training.layout import Layout, chunk_slots

DEPTH = 3                       # blocks per template stage: a first, a middle and a last block
MICROBATCH_PHASES = ("forward", "backward", "recompute")
KINDS = ("first", "middle", "last", "only")
COMPOSABLE_GROUPS = ("tp", "cp", "ep", "pp")  # group kinds whose size the template keeps
_GROUP_DIMS = ("tp", "cp", "dp", "pp", "ep", "edp", "dpcp", "stage", "world")  # echo.trace.step._groups' order
# c10d functional collectives: the index of the group-name argument (echo.trace.recorder._FUNCTIONAL)
_GROUP_ARG = {"all_reduce": 2, "all_reduce_": 2, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 3,
              "all_to_all_single": 3, "broadcast": 2}


class NotComposable(ValueError):
    """A rank this template cannot stand for; the message says why, ``key`` the setting behind it."""

    def __init__(self, reason: str, key: str = "model.layers"):
        super().__init__(reason)
        self.key = key


def chunk_kind(first: bool, last: bool) -> str:
    return {(True, True): "only", (True, False): "first", (False, True): "last"}.get((first, last), "middle")


def template_workload(w: Workload, stages: int, depth: int = DEPTH) -> Workload:
    """The small job whose ranks hold ``w``'s blocks: ``stages`` pipeline stages (3: first,
    middle and last chunks; 1: the only chunk) of ``depth`` blocks, one chunk each, and the
    fewest data-parallel ranks that ``w``'s expert parallelism can fold over."""
    if w.model.arch in ("hf", "module"):
        # a Hugging Face config or a user module may give its layers kinds by index (DeepSeek's
        # first dense layers, gpt-oss's sliding windows): a block is not every block there
        raise NotComposable(f"model.arch {w.model.arch}: its blocks may differ by index", "model.arch")
    if w.parallel.placement in ("v", "dual"):
        # the template stages stand for the pipeline's first, middle and last chunks in the
        # interleaved order; a V (or DualPipe's two ways) puts the first and last on one rank
        raise NotComposable(f"parallel.schedule {w.parallel.schedule}: its chunks sit in a V or on both ways of "
                            "the pipeline, which the templates' stage roles do not compose", "parallel.schedule")
    if w.parallel.zero == 3:
        raise NotComposable("parallel.zero 3: FSDP gathers and reduces inside the blocks, over groups that "
                            "follow the data-parallel size", "parallel.zero")
    if w.training.dtype == "fp8":
        # the step casts each FP8 linear's weight (fp8.cast_weights), and delayed scaling reduces
        # amaxes over the whole stage: both follow what the template shrinks
        raise NotComposable("training.dtype fp8: the optimizer step's weight casts and the stage's amax "
                            "reductions are not composed yet", "training.dtype")
    t = w.traced()
    p = t.parallel
    dp = p.ep // math.gcd(p.ep, p.tp * p.cp)
    # ZeRO 0-2 differ only in the gradient reduction and the step, which are traced for the
    # target itself (echo.trace.compose): one template serves all three
    parallel = p.model_copy(update={"pp": stages, "dp": dp, "virtual_stages": 1, "schedule": "1f1b",
                                    "stage_layers": None, "pipeline_split": "even", "zero": 1})
    training = t.training.model_copy(update={"global_batch": t.training.micro_batch * dp * stages})
    model = t.model.model_copy(update={"layers": stages * depth})
    return t.model_copy(update={"name": f"{w.name}--template-{stages}x{depth}", "model": model,
                                "parallel": parallel, "training": training})


def template_ranks(w: Workload) -> dict[str, tuple[int, int]]:
    """kind -> (stages of its template job, its rank there)."""
    three = Layout(template_workload(w, 3).parallel).representatives()
    return {"first": (3, three["pp0"]), "middle": (3, three["pp1"]), "last": (3, three["pp2"]),
            "only": (1, 0)}


def needed(w: Workload) -> set[tuple[str, int]]:
    """The (kind, depth) pieces ``w``'s traced ranks are composed from."""
    layout = Layout(w.parallel)
    out = set()
    for rank in layout.representatives().values():
        for slot in chunk_slots(w.parallel, w.model.layers, layout.coords(rank).pp):
            out.add((chunk_kind(slot.first, slot.last), DEPTH if len(slot.layers) > 1 else 1))
    return out


TEMPLATE_TABLES = ("ops", "comms", "deps", "params", "mem_events", "mem_entries")


def template_jobs(w: Workload, cache_dir: Path, missing_only: bool = True) -> list[tuple[Path, Workload, list[int]]]:
    """(folder, template workload, ranks) of each template job ``w`` needs that ``cache_dir``
    does not hold yet (``missing_only=False``: all of them), one folder per job, ``{stages}x{depth}``."""
    where = template_ranks(w)
    out = []
    for stages, depth in sorted({(where[kind][0], depth) for kind, depth in needed(w)}):
        folder = Path(cache_dir) / f"{stages}x{depth}"
        if not missing_only or not (folder / "done").is_file():
            out.append((folder, template_workload(w, stages, depth), sorted({r for s, r in where.values() if s == stages})))
    return out


def _trace_labelled(job: tuple[Workload, int]) -> dict[str, pa.Table]:
    import warnings

    from echo.trace.step import trace_rank

    warnings.filterwarnings("ignore", category=UserWarning)  # funcol's "not awaited" under fake tensors
    return trace_rank(*job, label_layers=True)


def run_template_jobs(jobs: list[tuple[Path, Workload, list[int]]], processes: int = 1) -> None:
    """Trace the jobs' ranks, labelled, in forked processes; write each job's tables into its
    folder, ``done`` last (a job killed half-way is traced again)."""
    from echo.io import write_parquet
    from echo.trace.runner import forked_map

    flat = [(tw, r) for _, tw, ranks in jobs for r in ranks]
    traced = iter(forked_map(_trace_labelled, flat, processes))
    for folder, tw, ranks in jobs:
        mine = [next(traced) for _ in ranks]
        for name in TEMPLATE_TABLES:
            write_parquet(pa.concat_tables([t[name] for t in mine]), folder / f"{name}.parquet")
        (folder / "done").write_text(tw.model_dump_json())


def trace_pieces(w: Workload, cache_dir: Path, jobs: int | None = None) -> dict[tuple[str, int], Piece]:
    """``w``'s pieces, from the labelled template traces in ``cache_dir``, tracing the template
    jobs not there yet (``jobs`` processes at once)."""
    from echo.io import read_parquet

    run_template_jobs(template_jobs(w, cache_dir), jobs or 1)
    where = template_ranks(w)
    pieces = {}
    for kind, depth in sorted(needed(w)):
        stages, r = where[kind]
        folder = Path(cache_dir) / f"{stages}x{depth}"
        tables = {name: read_parquet(folder / f"{name}.parquet") for name in TEMPLATE_TABLES}
        pieces[(kind, depth)] = dataclasses.replace(
            piece(kind, depth, template_workload(w, stages, depth),
                  {n: t.filter(pac.equal(t["rank"], r)) for n, t in tables.items()}), origin=str(folder.resolve()))
    return pieces


@dataclass(frozen=True)
class Piece:
    """One chunk kind's forward and backward from a labelled template trace: rows of its ops (as
    dicts, in order), their comms rows by comm id, and the dependencies among them."""

    kind: str
    depth: int
    rank: int
    layout: Layout
    blocks: dict[str, list[dict]]       # "forward" | "backward" (recompute inside) -> op rows
    comms: dict[int, dict]              # comm_id -> comms row
    deps: list[tuple[int, int, str]]    # (src seq, dst seq, kind) within the micro-batch's phases
    params: list[dict]                  # the rank's parameters in order (echo.trace.manifest.PARAMS rows)
    memory: dict[str, list[dict]]       # the micro-batch's memory events and entries (echo.trace.memory_template)
    runs: dict[str, list[tuple[int, list[dict]]]]  # each block's ops as runs of one layer label (_runs)
    origin: str = ""                    # the template folder it was read from ("": made otherwise)


def piece(kind: str, depth: int, workload: Workload, tables: dict[str, pa.Table]) -> Piece:
    """The ``kind`` piece of a labelled trace of ``workload`` (a ``template_workload``)."""
    ops = [o for o in tables["ops"].to_pylist() if o["phase"] in MICROBATCH_PHASES]
    if not ops or "layer" not in ops[0]:
        raise NotComposable("the template trace has no layer labels (trace_rank(label_layers=True))")
    seqs = {o["seq"] for o in ops}
    blocks = {"forward": [o for o in ops if o["phase"] == "forward"],
              "backward": [o for o in ops if o["phase"] != "forward"]}
    comms = {c["comm_id"]: c for c in tables["comms"].to_pylist() if c["seq"] in seqs}
    for c in comms.values():
        if c["group_kind"] not in COMPOSABLE_GROUPS:
            raise NotComposable(f"a {c['op']} over the {c['group_kind']} group in {c['phase']}: its group follows "
                                "the data-parallel or pipeline size, which the template shrinks")
    deps = [(d["src"], d["dst"], d["kind"]) for d in tables["deps"].to_pylist() if d["dst"] in seqs]
    # checked once here (a block layout it cannot compose is refused), reused by every compose
    runs = {name: _runs(rows, depth, name) for name, rows in blocks.items()}
    return Piece(kind, depth, ops[0]["rank"], Layout(workload.parallel), blocks, comms, deps,
                 tables["params"].to_pylist() if "params" in tables else [],
                 {n: tables[n].to_pylist() for n in ("mem_events", "mem_entries") if n in tables}, runs)


def label_runs(rows: list[dict]) -> list[tuple[int, list[dict]]]:
    """``rows`` (ops or memory events, in order) as runs of one ``layer`` label."""
    runs: list[tuple[int, list[dict]]] = []
    for o in rows:
        if runs and runs[-1][0] == o["layer"]:
            runs[-1][1].append(o)
        else:
            runs.append((o["layer"], [o]))
    return runs


def block_order(block: str, depth: int) -> list[int]:
    """The template blocks in the order a block of the step runs them ("end": after the backwards)."""
    return {"forward": list(range(depth)), "backward": list(reversed(range(depth))), "end": []}[block]


def _runs(rows: list[dict], depth: int, block: str) -> list[tuple[int, list[dict]]]:
    """The block's ops as runs of one layer label: outer ops (-1) only before and after the
    blocks, blocks in order (forward) or reversed (backward), each one contiguous run with the
    same kernels as every other."""
    runs = label_runs(rows)
    labels = [lab for lab, _ in runs]
    inner = [lab for lab in labels if lab >= 0]
    if inner != block_order(block, depth) or any(
            lab < 0 for lab in labels[labels.index(inner[0]):len(labels) - labels[::-1].index(inner[-1])]):
        raise NotComposable(f"{block}: the blocks' ops are not contiguous runs between outer ops ({labels})")
    shape = [_shape(o) for o in next(r for lab, r in runs if lab == 0)]
    for lab, r in runs:
        if lab >= 0 and [_shape(o) for o in r] != shape:
            raise NotComposable(f"{block}: block {lab} runs other kernels than block 0")
    return runs


def _shape(o: dict) -> tuple:
    return (o["name"], o["shapes"], o["dtype"], o["kind"], o["phase"], o["op_class"], o["flops"], o["bytes"])


_OP_NAMES = tuple(f.name for f in OPS)


class _Builder:
    """The composed rank's tables, filled op by op."""

    def __init__(self, rank: int, layout: Layout):
        self.rank, self.layout = rank, layout
        self.ops: list[dict] = []
        self.comms: list[dict] = []
        self.deps: list[tuple[int, int, str]] = []
        self.names = group_names(layout, rank)
        self._groups: dict[str, list[int]] = {}

    def group(self, kind: str) -> list[int]:
        if kind not in self._groups:
            self._groups[kind] = (self.layout.expert_group(self.rank, "ep") if kind == "ep"
                                  else self.layout.group(self.rank, kind))
        return self._groups[kind]

    def add(self, o: dict, chunk: int, comm: dict | None, peer: int | None, names: dict[str, str]) -> int:
        seq = len(self.ops)
        row = {k: o[k] for k in _OP_NAMES}
        row.update(rank=self.rank, seq=seq, chunk=chunk, comm_id=-1)
        if comm is not None:
            row["comm_id"] = len(self.comms)
            args = json.loads(o["args"])
            base = o["name"].split(".")[1]
            if comm["group_kind"] == "pp":
                args["args"][2] = peer  # c10d send / recv_: the peer's global rank
                group = sorted([self.rank, peer])
            else:
                group = self.group(comm["group_kind"])
                if base in _GROUP_ARG:
                    args["args"][_GROUP_ARG[base]] = self.names[comm["group_kind"]]
            row["args"] = json.dumps(args, separators=(",", ":"))
            row["kernel_key"] = kernel_key(o["name"], row["args"], dtensor_flags(o["dtensor"]))
            self.comms.append({**comm, "rank": self.rank, "comm_id": row["comm_id"], "seq": seq, "group": group,
                               "group_size": len(group), "peer": peer if peer is not None else -1, "chunk": chunk})
        self.ops.append(row)
        return seq


def group_names(layout: Layout, rank: int) -> dict[str, str]:
    """The c10d names ``echo.trace.step._groups`` gives the rank's groups: torch numbers each
    new group in creation order, and groups of one rank are not created."""
    names, n = {}, 0
    for dim in _GROUP_DIMS:
        ranks = layout.expert_group(rank, dim) if dim in ("ep", "edp") else layout.group(rank, dim)
        if len(ranks) > 1:
            n += 1
            names[dim] = str(n)
    return names


def compose(pieces: dict[tuple[str, int], Piece], w: Workload, rank: int) -> dict[str, pa.Table]:
    """The forward, backward and recompute ops, comms and deps of ``rank`` of ``w`` from its
    kinds' pieces (``pieces[(kind, depth)]``: depth ``DEPTH``, or 1 for chunks of one block)."""
    layout = Layout(w.parallel)
    pp_rank, v = layout.coords(rank).pp, w.parallel.virtual_stages
    slots = chunk_slots(w.parallel, w.model.layers, pp_rank)
    b = _Builder(rank, layout)
    where: dict[tuple[str, int, int, int], int] = {}  # (block, chunk, template seq, layer) -> composed seq
    order = [("forward", c) for c in range(v)] + [("backward", c) for c in reversed(range(v))]
    for block, c in order:
        n = len(slots[c].layers)
        pc = pieces.get((chunk_kind(slots[c].first, slots[c].last), DEPTH if n > 1 else 1))
        if pc is None:
            raise NotComposable(f"no {chunk_kind(slots[c].first, slots[c].last)} piece of depth {DEPTH if n > 1 else 1}")
        runs = pc.runs[block]
        sources = {o["seq"]: (lab, o) for lab, r in runs for o in r}
        for lab, r in runs:
            for layer in _target_layers(lab, n, pc.depth, block):
                for o in r:
                    comm = pc.comms.get(o["comm_id"]) if o["comm_id"] >= 0 else None
                    peer = None
                    if comm is not None and comm["group_kind"] == "pp":
                        ahead = (comm["op"] == "send") == (block == "forward")
                        peer = layout.chunk_peer(rank, c, 1 if ahead else -1, v)
                    seq = b.add(o, c, comm, peer, b.names)
                    where[(block, c, o["seq"], layer)] = seq
        _link(b, pc, block, c, n, runs, sources, where)
    return _tables(b)


def _target_layers(lab: int, n: int, depth: int, block: str) -> list[int]:
    """The target chunk's blocks that template block ``lab`` stands for, in the order they run."""
    if lab < 0:
        return [-1]
    if depth == 1 or lab == 0:
        return [0] if lab == 0 else [n - 1]
    if lab == depth - 1:
        return [n - 1]
    middle = list(range(1, n - 1))
    return middle if block == "forward" else middle[::-1]


def _template_layer(layer: int, n: int, depth: int) -> int:
    """The template block that stands for the target's block ``layer`` of ``n``."""
    if layer < 0:
        return -1
    if depth == 1 or layer == 0:
        return 0
    return depth - 1 if layer == n - 1 else 1


def _link(b: _Builder, pc: Piece, block: str, c: int, n: int, runs, sources, where) -> None:
    """The composed block's dependencies: each keeps its distance in blocks from its op."""
    fwd = {o["seq"]: o["layer"] for o in pc.blocks["forward"]}
    label = {**fwd, **{s: lab for s, (lab, _) in sources.items()}}
    in_block = set(sources)
    for src, dst, kind in pc.deps:
        if dst not in in_block:
            continue
        src_block = block if src in in_block else "forward"
        if src not in label:
            raise NotComposable(f"{block}: op {dst} depends on op {src} outside the micro-batch's phases")
        lab_d, lab_s = label[dst], label[src]
        for layer in _target_layers(lab_d, n, pc.depth, block):
            if lab_s < 0:
                target = -1
            elif lab_d < 0:  # an outer op reads the first or the last block
                if lab_s not in (0, pc.depth - 1):
                    raise NotComposable(f"{block}: an outer op reads template block {lab_s}")
                target = 0 if lab_s == 0 else n - 1
            else:
                target = layer + (lab_s - _template_layer(layer, n, pc.depth))
            if lab_s >= 0 and not 0 <= target < n:
                raise NotComposable(f"{block}: a dependency reaches block {target} of {n}")
            # the source op in the target block: its template block's op at the same place
            key_layer = target
            src_tpl = src
            if lab_s >= 0 and _template_layer(target, n, pc.depth) != lab_s:
                src_tpl = _same_place(pc, src_block, src, lab_s, _template_layer(target, n, pc.depth))
            s = where.get((src_block, c, src_tpl, key_layer))
            d = where[(block, c, dst, layer)]
            if s is None:
                raise NotComposable(f"{block}: dependency source {src} not composed")
            b.deps.append((s, d, kind))


def _same_place(pc: Piece, block: str, seq: int, lab: int, other: int) -> int:
    """The op of template block ``other`` at the place ``seq`` has in block ``lab``."""
    rows = pc.blocks[block]
    mine = [o["seq"] for o in rows if o["layer"] == lab]
    theirs = [o["seq"] for o in rows if o["layer"] == other]
    return theirs[mine.index(seq)]


def _tables(b: _Builder) -> dict[str, pa.Table]:
    deps = sorted(b.deps, key=lambda d: d[1])  # as recorded: by the reading op, in argument order
    return {"ops": pa.Table.from_pylist(b.ops, schema=OPS), "comms": pa.Table.from_pylist(b.comms, schema=COMMS),
            "deps": pa.table({"rank": [b.rank] * len(deps), "src": [d[0] for d in deps], "dst": [d[1] for d in deps],
                              "kind": [d[2] for d in deps]}, schema=DEPS)}


def microbatch_part(tables: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """A full trace's forward, backward and recompute ops, comms and deps, as ``compose`` makes
    them: ops in order, comm ids renumbered over them, deps sorted."""
    ops = [o for o in tables["ops"].to_pylist() if o["phase"] in MICROBATCH_PHASES]
    seqs = {o["seq"]: i for i, o in enumerate(ops)}
    comm_ids = {o["comm_id"]: i for i, o in enumerate(o for o in ops if o["comm_id"] >= 0)}
    comms = [{**c, "comm_id": comm_ids[c["comm_id"]], "seq": seqs[c["seq"]]}
             for c in tables["comms"].to_pylist() if c["seq"] in seqs]
    ops = [{**{f.name: o[f.name] for f in OPS}, "seq": seqs[o["seq"]],
            "comm_id": comm_ids.get(o["comm_id"], -1) if o["comm_id"] >= 0 else -1} for o in ops]
    deps = [(seqs[d["src"]], seqs[d["dst"]], d["kind"]) for d in tables["deps"].to_pylist()
            if d["dst"] in seqs and d["src"] in seqs]
    rank = ops[0]["rank"] if ops else 0
    return {"ops": pa.Table.from_pylist(ops, schema=OPS),
            "comms": pa.Table.from_pylist(sorted(comms, key=lambda c: c["comm_id"]), schema=COMMS),
            "deps": pa.table({"rank": [rank] * len(deps), "src": [d[0] for d in deps], "dst": [d[1] for d in deps],
                              "kind": [d[2] for d in deps]}, schema=DEPS)}


def check(composed: dict[str, pa.Table], traced: dict[str, pa.Table]) -> list[str]:
    """Differences between a composed rank and the micro-batch part of its full trace: empty when
    every op (all columns), collective and dependency agrees."""
    full = microbatch_part(traced)
    out = []
    for name in ("ops", "comms", "deps"):
        a, t = composed[name].to_pylist(), full[name].to_pylist()
        if len(a) != len(t):
            out.append(f"{name}: {len(a)} composed rows, {len(t)} traced")
        for i, (x, y) in enumerate(zip(a, t, strict=False)):
            if x != y:
                diff = {k: (x[k], y[k]) for k in x if x[k] != y.get(k)}
                out.append(f"{name} row {i}: {diff}")
                break
    return out
