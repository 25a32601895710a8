"""run_simulate: read the trace, classes, kernel times, network model and overlap slowdown; write
the summary, the timeline, the Perfetto trace and the pipeline schedule's p2p (schedule_table.py).

Symmetric mode (the default) reads only representatives' ops and reduces each class once, so the
work grows with the number of classes (first, middle and last pipeline stage today) and
micro-batches; the world size only enters through the per-rank class table, counted with
pyarrow. Full mode (``mode="full"``) relabels each class's programs for every rank and runs
them rank by rank (``full.py``): for small jobs, and to check symmetric mode.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from echo.artifacts import COMMS, DEPS, KERNELS, OPS, RANK_CLASSES, SCHEDULE, SUMMARY, TIMELINE, TRACED_RANKS
from echo.config.limits import full_mode_refusal
from echo.io import atomic_path, read_parquet, write_parquet
from echo.network.degraded import SlowNics
from echo.network.model import CollectiveCosts, NetworkModel
from echo.overlap.table import Slowdown, slowdown_table
from echo.simulate import slow_links, variability
from echo.simulate.costing import CommTimer, OpContext, reduce_rank
from echo.simulate.engine import EngineOptions, pass_times, simulate
from echo.simulate.full import RankSpec, Relabel, relabel_costs, simulate_full
from echo.simulate.perfetto import chrome_trace, timeline_table
from echo.simulate.program import RankCosts, scale_compute, slowest
from echo.simulate.schedule_table import schedule_table
from echo.simulate.summary import ClassInfo, MemoryBreakdown, hungriest, rank_breakdown, summary_table
from echo.training.schedule import BATCHED_SENDS, TIMED, orders_of

MODES = ("symmetric", "full")

# pyarrow imports pandas (where installed: the SLURM executor plugin depends on it) the first time
# it converts Python objects, ~0.2 s; done on import, so that sim_wall_s times the simulation and
# its artifacts, not a library's start (a search simulating thousands of layouts pays it once)
pa.array([0])

log = logging.getLogger(__name__)


OPS_COLUMNS = ["rank", "seq", "name", "op_class", "kind", "phase", "chunk", "stream", "flops", "kernel_key",
               "comm_id", "shapes", "dtype"]
COMMS_COLUMNS = ["rank", "comm_id", "op", "group", "bytes", "group_kind", "blocking", "peer"]


def _of_ranks(path: Path, schema: pa.Schema, columns: list[str], ranks: set[int]) -> pa.Table:
    """The table's rows of the given ranks."""
    table = read_parquet(path, schema, columns=columns)
    return table.filter(pc.is_in(table["rank"], pa.array(sorted(ranks), pa.int32())))


def _rows_by_rank(path: Path, schema: pa.Schema, columns: list[str], ranks: set[int]) -> dict[int, list[dict]]:
    """Rows of the given ranks only: other traced ranks are verification re-traces, not classes."""
    table = _of_ranks(path, schema, columns, ranks)
    out: dict[int, list[dict]] = {r: [] for r in ranks}
    groups = _interned_groups(table["group"]) if "group" in columns else None
    for i, row in enumerate((table.drop_columns(["group"]) if groups is not None else table).to_pylist()):
        if groups is not None:
            row["group"] = groups[i]
        out[row["rank"]].append(row)
    return out


def _interned_groups(column: pa.ChunkedArray) -> list[tuple[int, ...]]:
    """A list column of rank groups as tuples, one tuple object per distinct group: a rank's
    collectives repeat a few groups, of thousands of members at 16K GPUs, which its ops then
    share (costing.CommTimer memoizes by the group's identity)."""
    seen: dict[bytes, tuple[int, ...]] = {}
    out = []
    for chunk in column.chunks:
        offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy()
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
            members = values[a:b]
            key = members.tobytes()
            if key not in seen:
                seen[key] = tuple(members.tolist())
            out.append(seen[key])
    return out


def _deps(trace_dir: Path, ranks: set[int], ops: Mapping[int, list[dict]],
          comms: Mapping[int, Mapping[int, dict]]) -> tuple[dict[int, dict[int, list[int]]], dict[int, dict | None]]:
    """Per rank: (op seq -> seqs of non-blocking collectives it consumes, the only deps the
    stream-ordered replay cannot infer; backward op seq -> seqs of the backward ops that read
    its output, for the B / W split, None without deps.parquet)."""
    path = trace_dir / "deps.parquet"
    waits: dict[int, dict[int, list[int]]] = {r: {} for r in ranks}
    if not path.is_file():
        return waits, dict.fromkeys(ranks)
    consumers: dict[int, dict | None] = {r: {} for r in ranks}
    async_seqs = {r: {o["seq"] for o in rows if o["kind"] == "collective"
                      and not comms[r][o["comm_id"]]["blocking"]} for r, rows in ops.items()}
    backward = {r: {o["seq"] for o in rows if o["phase"] in ("backward", "recompute")} for r, rows in ops.items()}
    edges = _of_ranks(path, DEPS, ["rank", "src", "dst", "kind"], ranks).to_pydict()  # columns: tens of thousands of edges
    for r, src, dst, kind in zip(edges["rank"], edges["src"], edges["dst"], edges["kind"], strict=True):
        if src in async_seqs[r]:
            waits[r].setdefault(dst, []).append(src)
        if kind == "data" and src in backward[r]:
            consumers[r].setdefault(src, []).append(dst)
    return waits, consumers


def _class_table(rank_classes_path: Path) -> list[dict]:
    """One row per class: representative, the pipeline stages it covers, its rank count. A class
    may span stages: the middle stages of a pipeline run the same graph up to rank labels."""
    rc = read_parquet(rank_classes_path, RANK_CLASSES, columns=["class_id", "representative", "pp_rank"]).to_pydict()
    # counted in Python: pyarrow's group_by would load its query engine on first use, longer
    # than the count itself at 16K ranks
    counts = Counter(zip(rc["class_id"], rc["pp_rank"], rc["representative"], strict=True))
    out: dict[int, dict] = {}
    for (class_id, pp_rank, rep), n in sorted(counts.items()):
        c = out.setdefault(class_id, {"class_id": class_id, "reps": set(), "stages": [], "ranks": 0})
        c["reps"].add(rep)
        if pp_rank not in c["stages"]:
            c["stages"].append(pp_rank)
        c["ranks"] += n
    for c in out.values():
        if len(c["reps"]) != 1:
            raise ValueError(f"{rank_classes_path}: class {c['class_id']} has representatives {sorted(c['reps'])}")
        c["representative"] = c["reps"].pop()
    return list(out.values())


def load_classes(workload, trace_dir: Path, rank_classes_path: Path, ctx: OpContext) -> list[ClassInfo]:
    """Every class reduced to its task costs and memory, from its representative's trace."""
    table = _class_table(rank_classes_path)
    total = sum(c["ranks"] for c in table)
    if total != workload.world_size:
        raise ValueError(f"{rank_classes_path}: {total} ranks, but the workload's world size is {workload.world_size}")
    reps = {c["representative"] for c in table}
    ops = _rows_by_rank(trace_dir / "ops.parquet", OPS, OPS_COLUMNS, reps)
    comms = {r: {c["comm_id"]: c for c in rows}
             for r, rows in _rows_by_rank(trace_dir / "comms.parquet", COMMS, COMMS_COLUMNS, reps).items()}
    memory = {r["rank"]: r for r in read_parquet(trace_dir / "ranks.parquet", TRACED_RANKS).to_pylist()}
    waits, consumers = _deps(trace_dir, reps, ops, comms)
    out = []
    for c in table:
        rep = c["representative"]
        if not ops[rep] or rep not in memory:
            raise ValueError(f"class {c['class_id']}: representative rank {rep} is missing from {trace_dir}")
        mem = memory[rep]
        out.append(ClassInfo(
            class_id=c["class_id"], representative=rep, stages=tuple(c["stages"]), ranks=c["ranks"],
            costs=reduce_rank(ops[rep], comms[rep], ctx, waits[rep], consumers[rep]),
            communicators=communicators(comms[rep].values()), **_memory_figures(mem)))
    return out


def _memory_figures(mem: dict) -> dict:
    """A traced rank's memory figures (its ranks.parquet row) as ClassInfo's fields."""
    return {"state_bytes": mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_bytes"],
            "activation_bytes": mem["activation_bytes_per_microbatch"],
            "peak_bytes": mem.get("peak_bytes_per_microbatch") or 0,  # traces before the live meter lack it
            "reserved_bytes": mem.get("reserved_bytes_per_microbatch") or 0,
            "chunk_activation_bytes": tuple(mem.get("activation_bytes_per_chunk") or ())}


def memory_floor(workload, trace_dir: Path, rank_classes_path: Path) -> list[MemoryBreakdown] | None:
    """Each pipeline stage's memory breakdown from the trace's figures alone, before any kernel is
    costed or replayed (a search drops what cannot fit without simulating it): what the summary
    reports where the schedule's order keeps no weight-gradient pass for later, a lower bound where
    it does (the bytes a pending W holds come from the costed programs), None where the order is
    itself built from the pass times (``TIMED``)."""
    par = workload.parallel
    if par.schedule in TIMED:
        return None
    orders = orders_of(par, workload.micro_batches)
    table = _class_table(Path(rank_classes_path))
    reps = {c["representative"] for c in table}
    comms = _rows_by_rank(Path(trace_dir) / "comms.parquet", COMMS, COMMS_COLUMNS, reps)
    memory = {r["rank"]: r for r in read_parquet(Path(trace_dir) / "ranks.parquet", TRACED_RANKS).to_pylist()}

    def breakdowns(c: dict):
        f = _memory_figures(memory[c["representative"]])
        for s in c["stages"]:
            yield s, rank_breakdown(state=f["state_bytes"], activation=f["activation_bytes"], peak=f["peak_bytes"],
                                    reserved=f["reserved_bytes"], chunk_activation=f["chunk_activation_bytes"],
                                    communicators=communicators(comms[c["representative"]]),
                                    chunks=par.virtual_stages, order=orders[s])

    return hungriest(len(orders), (pair for c in table for pair in breakdowns(c)))


def communicators(comms) -> int:
    """NCCL communicators one rank's traced collectives and transfers use: one per group of two
    or more ranks, and one per p2p peer (ProcessGroupNCCL opens a 2-rank communicator per pair)."""
    groups = {tuple(c["group"]) for c in comms if c["peer"] < 0 and len(c["group"]) > 1}
    return len(groups) + len({c["peer"] for c in comms if c["peer"] >= 0})


def stage_costs(classes: list[ClassInfo], stages: int, chunks: int, mesh: Relabel | None = None,
                ctx: OpContext | None = None) -> list[RankCosts]:
    """One cost set per pipeline stage; refuses a stage without a class or a wrong chunk count.

    A class that spans stages (the middle stages hash alike) runs its representative's programs
    on each of them, relabelled (with ``mesh`` and ``ctx``) to that stage's ranks: their groups
    and pipeline peers may sit differently on the nodes, which changes network times and links."""
    by_stage: dict[int, list[RankCosts]] = {}
    for c in classes:
        if c.costs.chunks != chunks:
            raise ValueError(f"class {c.class_id} traced {c.costs.chunks} chunks, the workload has "
                             f"virtual_stages = {chunks}")
        home = mesh.coords[c.representative][0] if mesh is not None else None
        groups = functools.cache(functools.partial(_groups, c.costs))  # made only if _moves_alike asks
        for s in c.stages:
            costs = c.costs
            if mesh is not None and ctx is not None and s != home and 0 <= s < stages:
                move = mesh.mapper(c.representative, mesh.at_stage(c.representative, s))
                if not _moves_alike(groups, move, ctx, mesh.stage_stride):
                    costs = relabel_costs(c.costs, move, ctx.link, timer=ctx.timer)
            by_stage.setdefault(s, []).append(costs)
    missing = [s for s in range(stages) if s not in by_stage]
    extra = sorted(s for s in by_stage if not 0 <= s < stages)
    if missing or extra:
        raise ValueError(f"rank classes do not cover pp = {stages}: stages without a class {missing}, "
                         f"stages out of range {extra}")
    return [slowest(by_stage[s]) for s in range(stages)]


def _groups(costs: RankCosts) -> set[tuple[int, ...]]:
    """The distinct groups (p2p: the two ends) of a rank's collectives and transfers."""
    return {op.group for prog in costs.tasks() + costs.input_grad + costs.weight_grad for op in prog.ops
            if op.group}


def _moves_alike(groups: Callable[[], set[tuple[int, ...]]], move, ctx: OpContext,
                 stage_stride: int | None = None) -> bool:
    """Whether a class's programs moved to another stage's ranks by ``move`` cost what they cost
    where traced, so that ``stage_costs`` need not relabel them (at 16K GPUs it re-times every
    transfer of thousand-member data-parallel groups for each stage): the network is a
    ``NetworkModel``, whose time and latency of a transfer depend on the shape of its group
    alone (size, nodes, fewest members on a node), and every group keeps its shape and link class.
    Its link loads then name other GPUs, one for one (``move`` is a bijection), which the stage's
    device cannot tell apart: in symmetric mode only the stage's own transfers share links.
    Degraded networks (slow NICs, link variability) and other cost models are relabelled.
    ``groups()``: the class's distinct groups (``_groups``). ``stage_stride`` (``full.Relabel.stage_stride``; ``move`` along pp): where it is a multiple of
    the node size, a node holds one stage's ranks and moves whole onto another node, so every
    group keeps its shape without moving its members one by one."""
    net = ctx.timer.network
    if type(net) is not NetworkModel:
        return False
    if stage_stride is not None and stage_stride % net.topology.node_ranks == 0 \
            and stage_stride % ctx.gpus_per_node == 0:
        return True
    for group in groups():
        moved = tuple(move(r) for r in group)
        if net.shape(moved) != net.shape(group) or ctx.link(moved) != ctx.link(group):
            return False
    return True


def stage_activations(classes: list[ClassInfo], stages: int, chunks: int) -> list[list[float]]:
    """Each pipeline stage's saved activations of one micro-batch, per chunk (the largest of its
    classes; a class without a per-chunk split spreads its total evenly)."""
    out = [[0.0] * chunks for _ in range(stages)]
    for c in classes:
        per = list(c.chunk_activation_bytes) if len(c.chunk_activation_bytes) == chunks else \
            [c.activation_bytes / chunks] * chunks
        for s in c.stages:
            if 0 <= s < stages:
                out[s] = [max(a, float(b)) for a, b in zip(out[s], per, strict=True)]
    return out


def _heterogeneous(costs: list[RankCosts], stage_kernels: Mapping[int, Sequence[Path | str]], workload,
                   trace_dir: Path, rank_classes_path: Path, mesh: Relabel, ctx: OpContext) -> list[RankCosts]:
    """Each listed stage's programs as the slowest of the GPU models it runs on (``run_simulate``);
    other stages keep ``costs``."""
    pp = len(costs)
    bad = sorted(s for s in stage_kernels if not 0 <= s < pp)
    if bad:
        raise ValueError(f"stage_kernels names pipeline stages {bad}; the workload has pp = {pp}")
    other: dict[str, list[RankCosts]] = {}
    for path in {str(p) for paths in stage_kernels.values() for p in paths}:
        octx = dataclasses.replace(ctx, kernels=load_kernels(Path(path)))
        classes = load_classes(workload, trace_dir, rank_classes_path, octx)
        other[path] = stage_costs(classes, pp, workload.parallel.virtual_stages, mesh, octx)
    return [slowest([other[str(p)][s] for p in stage_kernels[s]]) if stage_kernels.get(s) else c
            for s, c in enumerate(costs)]


def load_kernels(kernels_path: Path) -> dict[str, float]:
    t = read_parquet(kernels_path, KERNELS, columns=["kernel_key", "duration_us"])
    return dict(zip(t["kernel_key"].to_pylist(), t["duration_us"].to_pylist(), strict=True))


def read_mesh(rank_classes_path: Path) -> tuple[Relabel, dict[str, list]]:
    """The job's mesh and rank_classes' columns (rank, class_id and the coordinates)."""
    cols = read_parquet(rank_classes_path, RANK_CLASSES, columns=["rank", "class_id", "pp_rank", "dp_rank",
                                                                   "cp_rank", "tp_rank"]).to_pydict()
    return Relabel.from_columns(cols), cols


def full_ranks(classes: list[ClassInfo], mesh: Relabel, cols: Mapping[str, list], ctx: OpContext,
               compute_scale: Mapping[int, float] | None = None,
               on_model: Mapping[int, Mapping[int, ClassInfo]] | None = None) -> list[RankSpec]:
    """Every rank of the job with its class's programs relabelled to its own groups and peers
    (``on_model``: rank -> its classes by id as costed on the GPU model it runs on, where not the
    job's: a heterogeneous job)."""
    by_id = {c.class_id: c for c in classes}
    scale, on_model = compute_scale or {}, on_model or {}
    out = []
    for rank, class_id, stage in sorted(zip(cols["rank"], cols["class_id"], cols["pp_rank"], strict=True)):
        c = on_model.get(rank, by_id)[class_id]
        out.append(RankSpec(rank=rank, stage=stage,
                            costs=relabel_costs(c.costs, mesh.mapper(c.representative, rank), ctx.link,
                                                scale.get(rank, 1.0), ctx.timer)))
    return out


def run_simulate(workload, hardware, topology, trace_dir, rank_classes_path, kernels_path, calib_dir, out_dir,
                 *, network: CollectiveCosts | None = None, options: EngineOptions | None = None,
                 overlap: Slowdown | Path | str | None = None, mode: str = "symmetric", overlap_grad_reduce: bool | None = None,
                 compute_scale: Mapping[int, float] | None = None, summary_only: bool = False,
                 timer: CommTimer | None = None, stragglers: Mapping[int, float] | None = None,
                 stage_kernels: Mapping[int, Sequence[Path | str]] | None = None,
                 slow_nodes: Mapping[int, float] | None = None,
                 stage_memory_gib: Mapping[int, float] | None = None,
                 rank_kernels: Mapping[int, Path | str] | None = None) -> pa.Table:
    """Simulate one step of ``workload`` on ``hardware`` GPUs over ``topology``; write summary,
    timeline, trace.json and schedule.parquet to ``out_dir`` and return the summary
    (``summary_only``: the summary alone, as a search that ranks thousands of layouts wants).

    ``network``: the collective costs; default: the calibrated ``echo.network.NetworkModel`` in
    ``calib_dir/network.json``. ``overlap``: the overlap slowdown (a ``Slowdown``, or the overlap
    rule's parquet); default: ``slowdown_table(hardware)``.
    ``mode``: symmetric | full. ``overlap_grad_reduce``: gradient buckets overlap the last
    backward; None: as the workload's ``parallel.overlap_grad_reduce`` says (engine.py). The
    other overlaps (``parallel.overlap_param_gather``, ``tp_comm_overlap``, ``ep_comm_overlap``) are
    the workload's. ``options`` (all engine choices) overrides all three. ``compute_scale`` (full
    mode): rank -> factor on its kernel times (a straggler). ``timer``: a ``CommTimer`` over
    ``network`` that earlier simulations on the same topology filled (a search's layouts share
    most of their collectives). ``stragglers``: rank -> factor on its kernel times, in either
    mode (symmetric: the rank's pipeline stage runs that much slower, as the replicas and its TP
    group wait for it; echo.simulate.variability). ``stage_kernels`` (symmetric mode): a
    heterogeneous job, pipeline stage -> the kernels.parquet of every GPU model the stage's ranks
    run on (``kernels_path`` among them only if listed; stages not listed run on ``kernels_path``'s
    model): stages on another GPU, or data-parallel replicas on a mix of GPUs, where each task of
    the stage takes the slowest model's program, as its collectives wait for it;
    ``stage_memory_gib``: the memory of the smallest of those models, which the stage must fit
    (summary ``fits``, ``stage_capacity_gib``). ``rank_kernels`` (full mode): a heterogeneous job
    rank by rank, rank -> the kernels.parquet of the GPU model it runs on (others on
    ``kernels_path``'s), which checks symmetric mode's slowest-model stages. ``slow_nodes``:
    node -> factor on the transfer time of its NICs (a link straggler, in either mode:
    echo.simulate.slow_links). A topology with ``link_variability`` adds the step at quantiles of
    its slowest node's NICs (symmetric mode; summary ``step_link_p50_s`` ...)."""
    t0 = time.perf_counter()
    if mode not in MODES:
        raise ValueError(f"simulate mode must be one of {MODES}, got '{mode}'")
    if compute_scale and mode != "full":
        raise ValueError("compute_scale (per-rank kernel factors) needs mode='full'")
    if mode == "full" and (reason := full_mode_refusal(workload)):  # the workflow refuses it earlier
        raise ValueError(reason)
    trace_dir, out_dir = Path(trace_dir), Path(out_dir)
    if network is None:  # the calibrate stage's model
        network = NetworkModel.load(Path(calib_dir) / "network.json")
    slow = overlap if isinstance(overlap, Slowdown) else slowdown_table(hardware, overlap)
    par = workload.parallel
    if overlap_grad_reduce is None:
        overlap_grad_reduce = par.overlap_grad_reduce
    options = options or EngineOptions(overlap_grad_reduce=overlap_grad_reduce,
                                       overlap_param_gather=par.overlap_param_gather,
                                       tp_comm_overlap=par.tp_comm_overlap, ep_comm_overlap=par.ep_comm_overlap,
                                       post_validation=par.post_validation, placement=par.placement,
                                       batched_sends=par.schedule in BATCHED_SENDS)
    # where the chunks sit is the layout's, not a modelling choice: the trace was made for it
    options = dataclasses.replace(options, placement=par.placement)
    # ranks fill node_ranks GPUs of each node (ranks_per_node: e.g. 64 of an NVL72 rack's 72)
    if timer is None:
        timer = CommTimer(network)
    elif timer.network is not network:
        raise ValueError("simulate: the timer given times another network than the one given")
    if stage_kernels and mode != "symmetric":
        raise ValueError("stage_kernels (GPU models per pipeline stage) needs mode='symmetric'; full mode takes "
                         "rank_kernels")
    if rank_kernels and mode != "full":
        raise ValueError("rank_kernels (a GPU model per rank) needs mode='full'; symmetric mode takes stage_kernels")
    mesh, cols = read_mesh(Path(rank_classes_path))
    stage_of = dict(zip(cols["rank"], cols["pp_rank"], strict=True))
    slow_stages = variability.stage_factors(stragglers, stage_of) if stragglers else {}
    spread = topology.link_variability.nic_bw_sigma.value if topology.link_variability is not None else 0.0
    if (slow_nodes or spread) and not isinstance(network, NetworkModel):
        raise ValueError("slow links (slow_nodes, a topology's link_variability) need an echo.network.NetworkModel "
                         f"to degrade, got {type(network).__name__}")
    slow_nodes = slow_links.check_slow_nodes(slow_nodes or {}, topology.nodes(workload.world_size), topology.node_ranks)
    if slow_nodes:
        # full mode: each rank's transfers that cross a slow node; symmetric: those of every rank of a
        # stage with a slow node, its rings and its neighbours' sends (echo.simulate.slow_links)
        timer = CommTimer(SlowNics(network, slow_nodes) if mode == "full" else
                          SlowNics(network, ranks=slow_links.slow_stage_ranks(slow_nodes, stage_of, topology.node_ranks)))
    # the launching host's pace (a GPU's kernel queue hides it until the host falls behind or waits);
    # a step captured whole in a CUDA graph is launched at once
    launch_us = hardware.host.launch_us.value if hardware.host is not None and \
        workload.training.cuda_graph == "none" else 0.0
    ctx = OpContext(load_kernels(Path(kernels_path)), timer, slow, topology.node_ranks, launch_us)
    classes = load_classes(workload, trace_dir, Path(rank_classes_path), ctx)

    def staged(octx: OpContext) -> list[RankCosts]:
        """Every stage's programs costed in ``octx``, heterogeneous stages on their GPUs, stragglers slower."""
        octx_classes = classes if octx is ctx else load_classes(workload, trace_dir, Path(rank_classes_path), octx)
        out = stage_costs(octx_classes, par.pp, par.virtual_stages, mesh, octx)  # also checks the classes cover the pipeline
        if stage_kernels:
            out = _heterogeneous(out, stage_kernels, workload, trace_dir, Path(rank_classes_path), mesh, octx)
        return [scale_compute(c, slow_stages.get(s, 1.0)) for s, c in enumerate(out)]

    costs = staged(ctx)
    # a schedule built for the stages' pass times (zb-2p) gets them from the programs it will run
    orders = orders_of(par, workload.micro_batches,
                       pass_times(costs, stage_activations(classes, par.pp, par.virtual_stages))
                       if par.schedule in TIMED else None)
    if mode == "full":
        scale = dict(compute_scale or {})
        for rank, factor in (stragglers or {}).items():
            scale[rank] = scale.get(rank, 1.0) * factor
        on_path = {p: {c.class_id: c for c in load_classes(workload, trace_dir, Path(rank_classes_path),
                                                          dataclasses.replace(ctx, kernels=load_kernels(Path(p))))}
                   for p in {str(p) for p in (rank_kernels or {}).values()}}
        on_model = {rank: on_path[str(p)] for rank, p in (rank_kernels or {}).items()}
        result = simulate_full(full_ranks(classes, mesh, cols, ctx, scale, on_model), orders, options)
        rank_class = dict(zip(cols["rank"], cols["class_id"], strict=True))
    else:
        result = simulate(costs, orders, options)
        rank_class = None
    stage_classes: dict[int, list[int]] = {}
    for c in classes:
        for s in c.stages:
            stage_classes.setdefault(s, []).append(c.class_id)
    if not summary_only:
        write_parquet(timeline_table(result, stage_classes, rank_class), out_dir / "timeline.parquet", TIMELINE)
        comms = read_parquet(trace_dir / "comms.parquet", COMMS, ["rank", "op", "phase", "chunk", "peer", "bytes"])
        write_parquet(schedule_table(workload, comms, orders), out_dir / "schedule.parquet", SCHEDULE)
        trace = chrome_trace(result, stage_classes, rank_class,
                             {"workload": workload.name, "hardware": hardware.name, "topology": topology.name,
                              "mode": result.mode, "overlap_slowdown": slow.source})
        with atomic_path(out_dir / "trace.json") as tmp:  # orjson: tens of thousands of events at 16K GPUs
            tmp.write_bytes(orjson.dumps(trace))
    link_columns = {}
    if mode == "symmetric":
        link_columns = slow_links.link_quantile_columns(
            spread, topology.nodes(workload.world_size), result.step_us / 1e6, lambda f: simulate(
                staged(dataclasses.replace(ctx, timer=CommTimer(SlowNics(network, every=f)))), orders, options).step_us / 1e6)
    summary = summary_table(workload=workload, hardware=hardware, topology=topology, classes=classes,
                            orders=orders, result=result, sim_wall_s=time.perf_counter() - t0,
                            stage_capacity_gib=stage_memory_gib, extra={**link_columns, "overlap_source": slow.source,
                                   "overlap_grad_reduce": options.overlap_grad_reduce,
                                   "overlap_param_gather": options.overlap_param_gather,
                                   "tp_comm_overlap": options.tp_comm_overlap,
                                   "ep_comm_overlap": options.ep_comm_overlap,
                                   "post_validation": options.post_validation})
    write_parquet(summary, out_dir / "summary.parquet", SUMMARY)
    log.info("simulated %s on %s/%s (%s mode): step %.3f s, %d events, %.2f s wall", workload.name, hardware.name,
             topology.name, result.mode, result.step_us / 1e6, len(result.events), summary["sim_wall_s"][0].as_py())
    return summary
