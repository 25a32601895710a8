"""How the zero-bubble runtime batches its pipeline transfers, and what each pass waits for.

The paper's runtime (sail-sg/zero-bubble-pipeline-parallelism at the paper's commit 6574e0e,
``megatron/core/pipeline_parallel``) runs a stage's passes from a plan in which every transfer
is a pair of communication nodes, and batches those nodes:

1. the plan: each pass gets a start and an end on a pass-level clock (``auto_schedule.ilp_results``
   for ZB-1p / ZB-2p, ``v_schedule.get_v_schedule`` for ZB-V: each pass after its input, plus a
   transfer's time when the input comes from another rank, and after its rank's previous pass);
2. a pass whose output goes to another rank adds a SEND node on its rank and a RECV node on the
   receiving rank, both at the pass' planned end; a rank's nodes are sorted by planned time,
   communication first among equals (by the order the passes were listed in), and then a RECV
   that falls inside the compute before it is moved ahead of that compute (one pass over the
   list), "so that recv is executed before computation and hence can be overlapped";
3. running the list (``zb_schedules.ZeroBubbleScheduler.run``), consecutive communication nodes
   gather into one batch, sent off as one ``batch_isend_irecv`` (``fused_pipeline_ops``) where
   the next compute consumes a RECV of the batch or where the next node is a compute; each
   received tensor keeps the request list of its whole batch, and the pass that consumes it waits
   on all of them (``for h in input_tensor[1]: h.wait()``): the SENDs of its batch included.

``batch_waits`` replays that plan for Echo's orders and pass times and returns, per stage, which
earlier passes' sends each receiving pass waits for (``echo.simulate.engine``,
``EngineOptions.batched_sends``). The plan's clock is the runtime's own model (uniform pass times
per stage and chunk, one transfer time); which sends share a batch follows from it, not from the
simulated times. Not modelled: the post-validation nodes the plan also holds (one place a step),
and NCCL's own rendezvous (a send also waits for its peer's receive to be posted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo.config.workload import virtual_stage
from echo.training.zb_auto import PassTimes, pass_plan

_COMPUTE = 1 << 62  # sorts compute nodes after the communication nodes of the same time
_PASSES = frozenset("FBW")


@dataclass(frozen=True)
class _Node:
    time: float
    tie: int            # a communication node's pass id, _COMPUTE for a compute node
    pos: int            # the compute node's position in the stage's order, or the producer's (SEND)
    kind: str           # "F" | "B" | "W" | "SEND" | "RECV"
    end: float = 0.0    # a compute node's planned end
    task: tuple[str, int, int] = ("", -1, -1)  # a compute node's pass, a RECV's consumer: (kind, micro-batch, chunk)


def batch_waits(orders: Sequence[Sequence], times: Sequence[Sequence[PassTimes]],
                placement: str = "interleaved") -> list[dict[int, tuple[int, ...]]]:
    """Per stage, position of a pass that receives -> positions of the earlier passes on the same
    stage whose sends share its receive's batch (see the module docstring). ``orders``: every
    stage's tasks (``schedule.Task``); ``times[s][c]``: stage s, chunk c's pass times."""
    p = len(orders)
    chunks = len(times[0])
    last = p * chunks - 1
    where = {virtual_stage(placement, p, c, s): (s, c) for s in range(p) for c in range(chunks)}
    plan = pass_plan([[(t.kind, t.microbatch, t.chunk) for t in o] for o in orders], times, placement)
    nodes: list[list[_Node]] = [[] for _ in range(p)]
    tie = 0
    for s in range(p):
        for i, task in enumerate(orders[s]):
            start, end = plan[(s, i)]
            nodes[s].append(_Node(start, _COMPUTE, i, task.kind, end, (task.kind, task.microbatch, task.chunk)))
            k = virtual_stage(placement, p, task.chunk, s)
            to = k + 1 if task.kind == "F" else k - 1
            if task.kind != "W" and 0 <= to <= last and where[to][0] != s:
                rank, chunk = where[to]
                nodes[s].append(_Node(end, tie, i, "SEND"))
                nodes[rank].append(_Node(end, tie, -1, "RECV", task=(task.kind, task.microbatch, chunk)))
            tie += 1
    out: list[dict[int, tuple[int, ...]]] = []
    for s in range(p):
        order = sorted(nodes[s], key=lambda n: (n.time, n.tie))
        for i in range(1, len(order)):  # a receive inside the compute before it moves ahead of it
            if order[i - 1].kind in _PASSES and order[i].kind == "RECV" and order[i].time <= order[i - 1].end:
                order[i - 1], order[i] = order[i], order[i - 1]
        out.append(_batches(order))
    return out


def _batches(order: Sequence[_Node]) -> dict[int, tuple[int, ...]]:
    """Run one stage's node list as the runtime does; consumer position -> the sends it waits for."""
    position = {n.task: n.pos for n in order if n.kind in _PASSES}
    following: list[_Node | None] = [None] * len(order)  # each node's next compute
    for j in range(len(order) - 2, -1, -1):
        nxt = order[j + 1]
        following[j] = nxt if nxt.kind in _PASSES else following[j + 1]
    waits: dict[int, tuple[int, ...]] = {}
    batch: list[_Node] = []
    for j, node in enumerate(order):
        if node.kind in _PASSES:
            continue
        batch.append(node)
        consumes = node.kind == "RECV" and following[j] is not None and node.task == following[j].task
        if consumes or j + 1 == len(order) or order[j + 1].kind in _PASSES:  # the runtime's flush
            sends = tuple(n.pos for n in batch if n.kind == "SEND")
            for n in batch:
                if n.kind == "RECV" and sends:
                    waits[position[n.task]] = sends
            batch = []
    return waits
