"""Costing: a traced rank's rows priced into its task programs (program.py): compute ops from
kernels.parquet and the overlap slowdown, collectives and p2p from the network's
``echo.network.CollectiveCosts`` (time, link loads, calling API's overhead)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from echo.network.model import CollectiveCosts
from echo.simulate.program import COMPUTE_KINDS, Op, Program, RankCosts

# Which schedule task each trace phase belongs to. Recomputation runs right before the backward
# of the same micro-batch (Megatron-LM's checkpointing and torch.utils.checkpoint alike).
TASK_OF_PHASE = {"forward": "F", "backward": "B", "recompute": "B", "grad_sync": "grad_sync",
                 "optimizer": "optimizer"}


class MissingKernelError(LookupError):
    """An op's kernel key has no duration in kernels.parquet (the profile stage missed it)."""

    def __init__(self, key: str, where: str):
        self.key = key
        super().__init__(f"kernel '{key}' ({where}) has no duration in kernels.parquet")


class CommTimer:
    """Network times from ``network``, each distinct (op, group, bytes, api) asked once: a rank
    repeats the same few collectives layer after layer. Besides the time, each transfer's
    latency and link loads (for link sharing) when the network gives them."""

    def __init__(self, network: CollectiveCosts):
        if not isinstance(network, CollectiveCosts):
            raise TypeError(f"simulate: the network must be an echo.network.CollectiveCosts, got {type(network).__name__}")
        self.network = network
        self._cache: dict[tuple[str, tuple[int, ...], int, str], tuple[float, float, tuple]] = {}
        # the same, by the group tuple's identity: hashing a group of thousands of ranks costs
        # more than the lookup (the tuple is kept beside its entry, so its id stays its own)
        self._by_id: dict[tuple[str, int, int, str], tuple[tuple[int, ...], tuple[float, float, tuple]]] = {}

    def transfer(self, op: str, group: Sequence[int], nbytes: int, api: str = "c10d") -> tuple[float, float, tuple]:
        """(time, latency, link loads) of one transfer called through ``api``."""
        if isinstance(group, tuple):
            hit = self._by_id.get((op, id(group), nbytes, api))
            if hit is not None and hit[0] is group:
                return hit[1]
            out = self._transfer(op, group, nbytes, api)
            self._by_id[op, id(group), nbytes, api] = (group, out)
            return out
        return self._transfer(op, group, nbytes, api)

    def _transfer(self, op: str, group: Sequence[int], nbytes: int, api: str) -> tuple[float, float, tuple]:
        key = (op, tuple(group), int(nbytes), api)
        if key not in self._cache:
            net = self.network
            us = float(net.estimate(op, group=list(group), nbytes=int(nbytes)).time_us)
            latency, loads, extra = 0.0, (), 0.0
            if len(set(group)) > 1:
                f = net.flow(op, group, int(nbytes))
                if f is not None:
                    latency = min(float(f.latency_us), us)
                    loads = tuple(f.loads.items())  # in the network's order (sorting thousands of a big group's links costs)
                # the calling API's own work (a copy, Python on the calling thread) loads no link
                extra = net.api_overhead_us(api, op, nbytes)
            self._cache[key] = (us + extra, latency + extra, loads)
        return self._cache[key]


def api_of(name: str) -> str:
    """The API a traced collective was called through, from its op name."""
    return "functional" if name.startswith("_c10d_functional.") else "c10d"


@dataclass(frozen=True)
class OpContext:
    """What turning trace rows into ops needs besides the rows."""

    kernels: Mapping[str, float]
    timer: CommTimer
    slowdown: object = None      # echo.overlap.Slowdown (None: no overlap slowdown)
    gpus_per_node: int = 1 << 30  # for link classes; default: everything on one node
    launch_us: float = 0.0       # host time per launched op (Hardware.host.launch_us; 0: no host model)
    _links: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # id(group) -> link class

    def link(self, group: Sequence[int]) -> str:
        """nic if ``group`` spans nodes, else nvlink; memoized by a tuple's identity, as
        ``CommTimer.transfer``."""
        hit = self._links.get(id(group)) if isinstance(group, tuple) else None
        if hit is not None and hit[0] is group:
            return hit[1]
        out = "nic" if len({r // self.gpus_per_node for r in group}) > 1 else "nvlink"
        if isinstance(group, tuple):
            self._links[id(group)] = (group, out)
        return out

    def s(self, op_class: str) -> float:
        return self.slowdown.of(op_class) if self.slowdown is not None else 0.0


def to_op(row: Mapping, comm: Mapping | None, ctx: OpContext) -> Op:
    """One ops.parquet row (and its comms.parquet row, for collectives and p2p) as an Op."""
    kind = row["kind"]
    if kind in COMPUTE_KINDS:
        key = row["kernel_key"]
        if key not in ctx.kernels:
            raise MissingKernelError(key, f"rank {row['rank']} seq {row['seq']} {row['name']}")
        op_class = row.get("op_class") or "other"
        return Op(row["seq"], kind, "compute", float(ctx.kernels[key]), flops=float(row["flops"] or 0.0),
                  recompute=row["phase"] == "recompute", slowdown=ctx.s(op_class), op_class=op_class,
                  host_us=ctx.launch_us)
    if comm is None:
        raise ValueError(f"rank {row['rank']} seq {row['seq']}: {kind} op has no comms.parquet row "
                         f"(comm_id {row['comm_id']})")
    group = comm["group"] if isinstance(comm["group"], tuple) else tuple(int(r) for r in comm["group"])
    api = api_of(row["name"])
    us, latency, loads = ctx.timer.transfer(comm["op"], group, comm["bytes"], api)
    stream = row["stream"]
    if kind == "p2p":
        stream = "p2p_bwd" if row["phase"] in ("backward", "recompute") else "p2p_fwd"
    return Op(row["seq"], kind, stream, us, blocking=bool(comm["blocking"]), comm_kind=comm["group_kind"],
              op=comm["op"], group=group, peer=int(comm.get("peer", -1) if comm.get("peer") is not None else -1),
              link=ctx.link(group), nbytes=int(comm["bytes"]), latency_us=latency, loads=loads, api=api,
              host_us=ctx.launch_us)


def mark_host_syncs(rows: Sequence[tuple[Mapping, Op]]) -> list[tuple[Mapping, Op]]:
    """A forward pass's ops (a task's, in seq order) with the host syncs of its MoE layers marked.

    Megatron-Core's token dispatchers (alltoall and flex: DeepEP, HybridEP) copy the number of
    tokens each expert receives to the host before dispatching, and wait for it: the expert
    GEMMs (Transformer Engine's GroupedLinear) take the split sizes as host integers. So the
    host waits for the GPU once per MoE layer in the forward (and in its recomputation); the
    backward's all-to-alls reuse the split sizes and do not wait. In the trace a dispatch is a
    run of expert-parallel all-to-alls with no GEMM between them (the tokens, then their
    routing weights), the combine the next run after the expert GEMMs; the first all-to-all of
    each dispatch is marked (the host waits for everything before it, the routing included)."""
    out, in_run, runs, last = [], False, {}, None
    for row, op in rows:
        phase = row["phase"]
        if phase != last:  # a recomputed layer inside a backward starts its own runs
            in_run, last = False, phase
        if op.op == "all_to_all" and op.comm_kind == "ep" and phase in ("forward", "recompute"):
            if not in_run:
                runs[phase] = runs.get(phase, 0) + 1
                if runs[phase] % 2 == 1:  # dispatch, combine, dispatch, ... in each phase
                    op = dataclasses.replace(op, host_sync=True)
            in_run = True
        elif op.op_class == "gemm":
            in_run = False
        out.append((row, op))
    return out


# Ops that may carry a weight-gradient GEMM's result into its gradient buffer (a cast, an
# accumulation into the fp32 main gradient, a copy) and still belong to W: any other consumer
# (a norm's backward, attention, another GEMM, a collective, a send) makes the GEMM a B op.
CARRY_CLASSES = ("elementwise", "copy")

# Bytes per element of the dtypes a weight-gradient GEMM reads (torch names, as ops.parquet has them).
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
               "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def split_backward(rows: Sequence[Mapping], consumers: Mapping[int, Sequence[int]]) -> set[int]:
    """The seqs of a backward task's W ops (its weight-gradient part; ``rows`` in seq order,
    ``consumers``: op seq -> seqs of the ops that read what it writes, deps.parquet's data edges).

    W is what zero-bubble implementations defer (the ZB paper's WeightGradStore, Megatron's
    delay_wgrad_compute): each GEMM whose result only reaches gradient buffers, through casts and
    accumulations, and those carrying ops. Everything else stays in B: the data-gradient GEMMs,
    attention, norms (their small weight gradients included), bias sums, the embedding's
    gradient, recomputation. Nothing in B reads a W op, so a W may run any time after its B."""
    in_task = {r["seq"] for r in rows}
    sinky: set[int] = set()  # every in-task consumer is sinky too (walked from the end)
    for r in reversed(rows):
        if r["kind"] in COMPUTE_KINDS and r["phase"] == "backward" and \
                (r["op_class"] == "gemm" or r["op_class"] in CARRY_CLASSES) and \
                all(c in sinky for c in consumers.get(r["seq"], ()) if c in in_task):
            sinky.add(r["seq"])
    w: set[int] = set()
    producers: dict[int, list[int]] = {}
    for src, dsts in consumers.items():
        for d in dsts:
            producers.setdefault(d, []).append(src)
    for r in rows:
        seq = r["seq"]
        if seq in sinky and (r["op_class"] == "gemm" or any(p in w for p in producers.get(seq, ()))):
            w.add(seq)
    return w


def input_bytes(row: Mapping) -> float:
    """Bytes of an op's tensor inputs, from its recorded shapes and its dtype."""
    dtype = row.get("dtype") or ""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"rank {row['rank']} seq {row['seq']} {row['name']}: no element size known for dtype "
                         f"'{dtype}' (costing.DTYPE_BYTES)")
    n = 0
    for shape in json.loads(row.get("shapes") or "[]"):
        if isinstance(shape, list):
            n += math.prod(int(x) for x in shape)
    return float(n * DTYPE_BYTES[dtype])


def reduce_rank(ops: Sequence[Mapping], comms: Mapping[int, Mapping], ctx: OpContext,
                waits: Mapping[int, Sequence[int]] | None = None,
                consumers: Mapping[int, Sequence[int]] | None = None) -> RankCosts:
    """One rank's ops (rows of ops.parquet, any order) and comms (by comm_id) -> its programs.
    With ``consumers`` (op seq -> seqs reading its output: deps.parquet's data edges) each
    backward is also split into its B and W parts (``split_backward``)."""
    tasks: dict[tuple[str, int], list[tuple[Mapping, Op]]] = {}
    for row in sorted(ops, key=lambda r: r["seq"]):
        task = TASK_OF_PHASE.get(row["phase"])
        if task is None:
            raise ValueError(f"rank {row['rank']} seq {row['seq']}: unknown phase '{row['phase']}'")
        chunk = row["chunk"] if task in ("F", "B") else 0
        tasks.setdefault((task, chunk), []).append((row, to_op(row, comms.get(row["comm_id"]), ctx)))
    chunks = 1 + max((c for (t, c) in tasks if t in ("F", "B")), default=0)
    if ctx.launch_us > 0:  # the host waits only where it launches: without a host model, no sync either
        tasks = {k: mark_host_syncs(v) if k[0] in ("F", "B") else v for k, v in tasks.items()}

    def prog(task: str, chunk: int = 0, keep=None) -> Program:
        return Program((op for row, op in tasks.get((task, chunk), ()) if keep is None or keep(row["seq"])), waits)

    out = RankCosts(forward=tuple(prog("F", c) for c in range(chunks)),
                    backward=tuple(prog("B", c) for c in range(chunks)),
                    grad_sync=prog("grad_sync"), optimizer=prog("optimizer"))
    if consumers is None:
        return out
    ws = [split_backward([row for row, _ in tasks.get(("B", c), ())], consumers) for c in range(chunks)]
    pending = tuple(sum(input_bytes(row) for row, _ in tasks.get(("B", c), ()) if row["seq"] in w and
                        row["op_class"] == "gemm") for c, w in enumerate(ws))
    return dataclasses.replace(
        out, input_grad=tuple(prog("B", c, lambda seq, w=w: seq not in w) for c, w in enumerate(ws)),
        weight_grad=tuple(prog("B", c, lambda seq, w=w: seq in w) for c, w in enumerate(ws)), w_pending_bytes=pending)


