"""Overlaps the trace does not record, applied to a rank's task programs (Megatron-LM and
Transformer Engine options, the workload's ``parallel.overlap_*`` / ``tp_comm_overlap`` keys):

- ``with_buckets``: overlap_grad_reduce, the gradient buckets move into the last backward;
- ``with_param_gather``: overlap_param_gather, the distributed optimizer's parameter all-gathers
  move into the next iteration's first forward of each chunk;
- ``with_tp_overlap``: tp_comm_overlap, each sequence-parallel all-gather / reduce-scatter is
  pipelined with the GEMM beside it (userbuffers' chunked ring exchange);
- ``ep_pairs`` / ``combined``: ep_comm_overlap, a steady-state forward and backward run as one
  task, interleaved at their expert-parallel all-to-alls (Megatron-Core's combined 1F1B).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence

from echo.simulate.program import ASYNC, BLOCKING, COMPUTE, Op, Program, RankCosts


def with_buckets(backward: Program, grad_sync: Program) -> tuple[Program, Program]:
    """Megatron-LM's overlap_grad_reduce: the gradient buckets (grad_sync's non-blocking
    collectives, recorded in backward order) move into the last backward, bucket i issued once
    the backward has done the fraction of its compute work that its cumulative bytes are of all
    buckets' bytes (a bucket is ready when its last gradient is). They are carried past the end of
    the backward; grad_sync keeps its other ops and the wait for the buckets.
    Returns (last backward, grad_sync)."""
    buckets = [op for op in grad_sync.ops if op.code == ASYNC]
    if not buckets:
        return backward, grad_sync
    rest = [op for op in grad_sync.ops if op.code != ASYNC]
    weights = [max(op.nbytes, 1) for op in buckets]
    total_b = float(sum(weights))
    work = [op.duration_us if op.code == COMPUTE else 0.0 for op in backward.ops]
    total_w = sum(work) or 1.0
    out: list[Op] = []
    done, cum_b, k = 0.0, 0.0, 0
    thresholds = []
    for w in weights:
        cum_b += w
        thresholds.append(cum_b / total_b)
    last_compute = max((i for i, op in enumerate(backward.ops) if op.code == COMPUTE), default=-1)
    for i, op in enumerate(backward.ops):
        out.append(op)
        done += work[i]
        while k < len(buckets) and (i == last_compute or done / total_w >= thresholds[k] - 1e-12):
            out.append(dataclasses.replace(buckets[k], carry=True))
            k += 1
    out.extend(dataclasses.replace(b, carry=True) for b in buckets[k:])
    waits = {**backward.waits, **grad_sync.waits}
    return Program(out, waits), Program(rest, waits)


DP_KINDS = ("dp", "dpcp", "edp")   # group kinds of the data-parallel reduction sets
TP_PIPELINED = ("all_gather", "reduce_scatter")


def param_gathers(optimizer: Program) -> list[Op]:
    """The distributed optimizer's parameter all-gathers (one per bucket, in bucket order)."""
    return [op for op in optimizer.ops if op.code in (BLOCKING, ASYNC) and op.op == "all_gather"
            and op.comm_kind in DP_KINDS]


def with_param_gather(forwards: Sequence[Program], optimizer: Program) -> tuple[tuple[Program, ...], Program]:
    """Megatron-LM's overlap_param_gather in steady state: the optimizer's parameter all-gathers
    leave the optimizer task and overlap the next iteration's forward. Buckets are filled in
    backward order, so the forward needs them in reverse; bucket k's layers start at the fraction
    of the stage's forward that the bytes of the buckets before it are of all buckets. The stage's
    forward is its chunks in order, each 1/chunks of it: a bucket goes to the first forward of the
    chunk that fraction falls in, issued (non-blocking, comm stream) at that forward's start, and
    the forward waits for it before the compute op in which its fraction of the chunk's compute
    work is reached (the first bucket: before any compute). Returns (the first forward of each
    chunk, the optimizer without the all-gathers)."""
    gathers = param_gathers(optimizer)
    if not gathers:
        return tuple(forwards), optimizer
    ids = {id(op) for op in gathers}
    rest = Program([op for op in optimizer.ops if id(op) not in ids], optimizer.waits)
    v = len(forwards)
    order = gathers[::-1]
    total = float(sum(max(op.nbytes, 1) for op in order))
    per_chunk: list[list[tuple[float, Op]]] = [[] for _ in range(v)]
    before = 0.0
    for op in order:
        f = before / total * v
        c = min(int(f + 1e-9), v - 1)
        per_chunk[c].append((max(f - c, 0.0), dataclasses.replace(op, blocking=False, stream="comm")))
        before += max(op.nbytes, 1)
    return tuple(_issue_first(fwd, got) if got else fwd for fwd, got in zip(forwards, per_chunk, strict=True)), rest


def _issue_first(forward: Program, buckets: Sequence[tuple[float, Op]]) -> Program:
    """``forward`` with ``buckets`` ((fraction of its compute work where it is needed, op)) issued
    at its start and waited for where needed."""
    work = [op.duration_us if op.code == COMPUTE else 0.0 for op in forward.ops]
    total = sum(work)
    starts, done = [], 0.0
    for i, w in enumerate(work):
        if forward.ops[i].code == COMPUTE:
            starts.append((done, forward.ops[i].seq))
        done += w
    waits = {dst: list(srcs) for dst, srcs in forward.waits.items()}
    if starts:
        for r, op in buckets:
            point = r * total
            # the compute op whose work holds the point (the last one starting at or before it)
            dst = next((seq for start, seq in reversed(starts) if start <= point + 1e-9 * max(total, 1.0)),
                       starts[0][1])
            waits.setdefault(dst, []).append(op.seq)
    return Program([op for _, op in buckets] + list(forward.ops), waits)


def tp_overlap_time(comm_us: float, gemm_us: float, s: float, chunks: int) -> tuple[float, float]:
    """(time of the pair, the GEMM's share of it) for a collective pipelined in ``chunks`` with a
    GEMM (Transformer Engine's userbuffers: chunk k of the transfer beside chunk k -/+ 1 of the
    GEMM). The GEMM runs at 1 / (1 + s) while the transfer is in flight (``gpu.Gpu.stretch`` for
    a transfer as long as the collective): ``slowed = G + s / (1 + s) * min(C, G (1 + s))``; the
    two-stage pipeline then takes ``max(C, slowed) + min(C, slowed) / chunks`` (one chunk of the
    shorter of the two is not overlapped: the first transfer before the first GEMM chunk, or the
    last GEMM chunk before the last transfer)."""
    slowed = gemm_us + s / (1.0 + s) * min(comm_us, gemm_us * (1.0 + s))
    return max(comm_us, slowed) + min(comm_us, slowed) / max(chunks, 1), slowed


def _tp_pairs(ops: Sequence[Op]) -> dict[int, int]:
    """Index of each sequence-parallel TP collective -> index of the GEMM it is pipelined with:
    an all-gather with the first GEMM after it that consumes its output, a reduce-scatter with
    the GEMM before it that produces its input, or when that GEMM is already paired (backward:
    the re-gathered input's all-gather overlaps the data-gradient GEMM) with the GEMM after it
    (the weight-gradient GEMM). Only compute ops may lie between the two; each GEMM pairs once."""
    taken: set[int] = set()
    pairs: dict[int, int] = {}

    def scan(indices) -> int | None:
        for j in indices:
            o = ops[j]
            if o.code != COMPUTE:
                return None  # another collective or a transfer: the GEMM would not be its neighbour
            if o.op_class == "gemm" and j not in taken:
                return j
        return None

    n = len(ops)
    for i, op in enumerate(ops):
        if not (op.code == BLOCKING and op.comm_kind == "tp" and op.op in TP_PIPELINED and len(op.group) > 1):
            continue
        if op.op == "all_gather":
            j = scan(range(i + 1, n))
        else:
            j = scan(range(i - 1, -1, -1))
            if j is None:
                j = scan(range(i + 1, n))
        if j is not None:
            pairs[i] = j
            taken.add(j)
    return pairs


def with_tp_overlap(prog: Program) -> Program:
    """Transformer Engine's tp_comm_overlap: each sequence-parallel all-gather / reduce-scatter
    (blocking, group kind tp) pipelined with its GEMM (``_tp_pairs``) in tp chunks
    (``tp_overlap_time``). The GEMM keeps its place, lengthened by the slowdown beside the
    transfer (and not slowed again by other transfers); the collective keeps its place and its
    rendezvous, holding the compute stream for what the pair takes beyond the GEMM. Collectives
    without a GEMM next to them (the embedding's reduce-scatter) stay as they are."""
    pairs = _tp_pairs(prog.ops)
    if not pairs:
        return prog
    ops = list(prog.ops)
    for i, j in pairs.items():
        comm, gemm = ops[i], ops[j]
        total, slowed = tp_overlap_time(comm.duration_us, gemm.duration_us, gemm.slowdown, len(comm.group))
        ops[j] = dataclasses.replace(gemm, duration_us=slowed, slowdown=0.0,
                                     slowed_us=gemm.slowed_us + slowed - gemm.duration_us)
        ops[i] = dataclasses.replace(comm, duration_us=total - slowed, latency_us=0.0)
    return Program(ops, prog.waits)


# ep_comm_overlap: the backward's ops are renumbered above the forward's in a combined program
_SECOND = 1 << 40


def _renumbered(op: Op, seq: int) -> Op:
    """``op`` under another seq. A shallow copy keeps its cached ``flow`` and ``code`` (neither
    depends on seq), where ``dataclasses.replace`` would rebuild it field by field: a DualPipe
    stage renumbers thousands of backward ops."""
    out = copy.copy(op)
    object.__setattr__(out, "seq", seq)  # Op is frozen
    return out


def _steps(prog: Program, offset: int) -> list[tuple[list[Op], Op | None]]:
    """``prog``'s ops (seq + ``offset``) cut at its blocking expert-parallel collectives: [(the ops
    before one, that collective issued non-blocking on the ep stream)], the last with None."""
    out: list[tuple[list[Op], Op | None]] = []
    seg: list[Op] = []
    for op in prog.ops:
        op = _renumbered(op, op.seq + offset) if offset else op
        if op.code == BLOCKING and op.comm_kind == "ep":
            out.append((seg, dataclasses.replace(op, blocking=False, stream="ep")))
            seg = []
        else:
            seg.append(op)
    return out + [(seg, None)]


def combined(forward: Program, backward: Program, batched_p2p: bool = False, steps=_steps) -> Program:
    """Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm; DeepSeek-V3's DualPipe
    overlap): the forward of one micro-batch and the backward of another as one program. Each is
    cut at its expert-parallel all-to-alls; the pieces alternate on the compute stream, backward
    first, each all-to-all issued on the ep stream where its pass reaches it and waited for where
    that pass resumes, so it runs beside the other pass' next piece: the backward's combine beside
    the forward's attention, the forward's dispatch beside the backward's experts, and so on. The
    backward's ops are renumbered (seq + 2^40) so that the engines can tell the two apart.

    ``batched_p2p``: DualPipe's overlapped chunk (deepseek-ai/DualPipe, ``_forward_backward_chunk``)
    receives both passes' inputs before it starts and sends both outputs after it ends, so its
    receives (backward's first) move to its start and its sends to its end."""
    chains = [steps(backward, _SECOND), steps(forward, 0)]  # ``steps``: _steps, or a cache of it
    if batched_p2p:
        chains, recvs, sends = _hoist_p2p(chains)
    waits = {dst: list(srcs) for dst, srcs in forward.waits.items()}
    waits |= {dst + _SECOND: [s + _SECOND for s in srcs] for dst, srcs in backward.waits.items()}
    pending: list[list[int]] = [[], []]  # per pass: all-to-alls its next op must wait for
    ops: list[Op] = []
    for j in range(max(len(c) for c in chains)):
        for x, chain in enumerate(chains):
            if j >= len(chain):
                continue
            seg, a2a = chain[j]
            if seg and pending[x]:
                waits.setdefault(seg[0].seq, []).extend(pending[x])
                pending[x] = []
            ops += seg
            if a2a is not None:
                ops.append(a2a)
                pending[x].append(a2a.seq)
    if batched_p2p:
        ops = recvs + ops + sends
    return Program(ops, waits)  # the task's end waits for every all-to-all still in flight


def _hoist_p2p(chains: list) -> tuple[list, list[Op], list[Op]]:
    """``chains`` without their p2p ops, and those receives and sends in chain order."""
    recvs, sends, out = [], [], []
    for chain in chains:
        kept = []
        for seg, a2a in chain:
            recvs += [op for op in seg if op.kind == "p2p" and op.op == "recv"]
            sends += [op for op in seg if op.kind == "p2p" and op.op != "recv"]
            kept.append(([op for op in seg if op.kind != "p2p"], a2a))
        out.append(kept)
    return out, recvs, sends


def is_second(op: Op) -> bool:
    """Whether ``op`` of a ``combined`` program belongs to its backward."""
    return op.seq >= _SECOND


def ep_pairs(order: Sequence, programs, skip: Mapping[int, object], batched_p2p: bool = False,
             memo: dict | None = None) -> dict[int, Program]:
    """Position of each forward of ``order`` marked combined (``schedule.orders_of``) -> the
    ``combined`` program of it and the backward after it, unless either runs a program of its
    own (``skip``: the overlapped parameter gathers, the last backward). ``programs(task)`` gives a
    pass' program. ``memo``: pairs and cuts already made, by program identity (an engine shares
    one across its stages: the stages of one class run the same programs)."""
    memo = {} if memo is None else memo

    def steps(prog: Program, offset: int) -> list:
        """_steps, once per program: each pass pairs with several others (the program is kept
        beside its cut so that its id is not reused while the memo lives)."""
        key = ("cut", id(prog), offset)
        if key not in memo:
            memo[key] = (prog, _steps(prog, offset))
        return memo[key][1]

    out: dict[int, Program] = {}
    for i, f in enumerate(order[:-1]):
        b = order[i + 1]
        if getattr(f, "combined", False) and b.kind == "B" and i not in skip and i + 1 not in skip:
            fp, bp = programs(f), programs(b)
            key = ("pair", id(fp), id(bp), batched_p2p)
            if key not in memo:
                memo[key] = (fp, bp, combined(fp, bp, batched_p2p, steps))
            out[i] = memo[key][2]
    return out


def with_overlaps(costs: RankCosts, tp_comm_overlap: bool) -> RankCosts:
    """A rank's programs with the per-task overlaps applied (today: TP communication overlap)."""
    if not tp_comm_overlap:
        return costs
    return dataclasses.replace(costs, forward=tuple(with_tp_overlap(p) for p in costs.forward),
                               backward=tuple(with_tp_overlap(p) for p in costs.backward),
                               input_grad=tuple(with_tp_overlap(p) for p in costs.input_grad),
                               weight_grad=tuple(with_tp_overlap(p) for p in costs.weight_grad))
