"""Op level: one traced rank's ops reduced to the durations of its schedule tasks.

A rank's trace holds one forward and one backward per chunk (a per-micro-batch template), the
data-parallel gradient reduction (grad_sync) and the optimizer step. Each becomes one task whose
duration comes from replaying its ops on two streams:

- compute and memcpy ops run one after another on the compute stream (kernel times from
  kernels.parquet);
- blocking collectives (TP) hold the compute stream for their network time;
- non-blocking collectives queue on the comm stream once issued, overlapping compute; the
  compute stream only waits where an op consumes their result (deps.parquet) or at the end of
  the task, and that wait is the exposed part;
- p2p sends and receives are left to the engine, which knows when the peer stage is ready.

Every microsecond a task's compute stream is not computing is attributed to the communication
it was waiting for, so duration = compute + exposed comm holds exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Which schedule task each trace phase belongs to. Recomputation runs right before the backward
# of the same micro-batch (Megatron-LM's checkpointing and torch.utils.checkpoint alike).
TASK_OF_PHASE = {"forward": "F", "backward": "B", "recompute": "B", "grad_sync": "grad_sync",
                 "optimizer": "optimizer"}
COMPUTE_KINDS = ("compute", "memcpy")


class MissingKernelError(LookupError):
    """An op's kernel key has no duration in kernels.parquet (the profile stage missed it)."""

    def __init__(self, key: str, where: str):
        self.key = key
        super().__init__(f"kernel '{key}' ({where}) has no duration in kernels.parquet")


@dataclass(frozen=True)
class Op:
    """One recorded op, reduced to what the op-level replay needs."""

    seq: int
    kind: str              # compute | memcpy | collective | p2p
    stream: str            # compute | comm | p2p
    duration_us: float     # kernel time, or network time of a collective
    blocking: bool = False
    comm_kind: str = ""    # group kind of a collective (tp, dp, pp, cp, ep, world)
    flops: float = 0.0
    recompute: bool = False


@dataclass(frozen=True)
class TaskCost:
    """What one task costs its rank: the time it holds the compute stream, and how that splits."""

    duration_us: float = 0.0
    compute_us: float = 0.0
    exposed_us: tuple[tuple[str, float], ...] = ()  # (group kind, us the compute stream waited on it)
    flops: float = 0.0              # matmul-class FLOPs executed, recomputation included
    recompute_flops: float = 0.0
    comm_us: tuple[float, ...] = ()  # non-blocking collectives' network times, in issue order

    def exposed(self, kind: str) -> float:
        return sum(us for k, us in self.exposed_us if k == kind)


@dataclass(frozen=True)
class RankCosts:
    """One rank's (or one pipeline stage's) tasks, ready for the schedule-level engine."""

    forward: tuple[TaskCost, ...]           # per chunk
    backward: tuple[TaskCost, ...]          # per chunk, recomputation included
    send_forward_us: tuple[float, ...]      # per chunk: shipping its output to the next virtual stage
    send_backward_us: tuple[float, ...]     # per chunk: shipping its input gradient to the previous one
    grad_sync: TaskCost = TaskCost()
    optimizer: TaskCost = TaskCost()

    @property
    def chunks(self) -> int:
        return len(self.forward)


@dataclass
class _Streams:
    """Replay state of one task: when each stream frees up and where the waiting went."""

    compute_free: float = 0.0
    comm_free: float = 0.0
    compute_us: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    ends: dict[int, tuple[float, str]] = field(default_factory=dict)  # async collective seq -> (end, kind)
    last_comm_kind: str = ""
    comm_us: list[float] = field(default_factory=list)

    def wait_compute(self, until: float, kind: str) -> None:
        if until > self.compute_free:
            self.exposed[kind] = self.exposed.get(kind, 0.0) + until - self.compute_free
            self.compute_free = until

    def ready(self, op: Op, waits: Mapping[int, Sequence[int]]) -> tuple[float, str]:
        """When the async collectives ``op`` consumes have finished, and the kind of the latest."""
        t, kind = 0.0, ""
        for src in waits.get(op.seq, ()):
            end, k = self.ends.get(src, (0.0, ""))
            if end > t:
                t, kind = end, k
        return t, kind


def simulate_ops(ops: Iterable[Op], waits: Mapping[int, Sequence[int]] | None = None) -> TaskCost:
    """Replay one task's ops (in seq order) on the compute and comm streams; see module docstring.

    ``waits`` maps an op's seq to the seqs whose results it consumes (deps.parquet data edges);
    only edges from non-blocking collectives matter, the rest are implied by stream order."""
    waits = waits or {}
    st = _Streams()
    flops = recompute_flops = 0.0
    for op in ops:
        flops += op.flops
        recompute_flops += op.flops if op.recompute else 0.0
        if op.kind == "p2p":
            continue  # the engine schedules transfers between stages
        ready, why = st.ready(op, waits)
        if op.kind in COMPUTE_KINDS:
            st.wait_compute(ready, why)
            st.compute_free += op.duration_us
            st.compute_us += op.duration_us
        elif op.blocking:
            st.wait_compute(ready, why)
            if op.stream == "comm":  # queued behind the comm stream's earlier work
                st.wait_compute(st.comm_free, st.last_comm_kind)
            st.wait_compute(st.compute_free + op.duration_us, op.comm_kind)
            if op.stream == "comm":
                st.comm_free = st.compute_free
        else:
            # Issued when the compute stream reaches it: its input was produced by earlier ops.
            start = max(st.comm_free, st.compute_free, ready)
            st.comm_free = start + op.duration_us
            st.ends[op.seq] = (st.comm_free, op.comm_kind)
            st.last_comm_kind = op.comm_kind
            st.comm_us.append(op.duration_us)
    st.wait_compute(st.comm_free, st.last_comm_kind)  # a task ends when its streams have drained
    return TaskCost(duration_us=st.compute_free, compute_us=st.compute_us,
                    exposed_us=tuple(sorted(st.exposed.items())), flops=flops,
                    recompute_flops=recompute_flops, comm_us=tuple(st.comm_us))


class CommTimer:
    """Network times from a model with ``estimate(op, group=, nbytes=)``, each distinct
    (op, group, bytes) asked once: a rank repeats the same few collectives layer after layer."""

    def __init__(self, network):
        self._network = network
        self._cache: dict[tuple[str, tuple[int, ...], int], float] = {}

    def time_us(self, op: str, group: Sequence[int], nbytes: int) -> float:
        key = (op, tuple(group), int(nbytes))
        if key not in self._cache:
            self._cache[key] = float(self._network.estimate(op, group=list(group), nbytes=int(nbytes)).time_us)
        return self._cache[key]


def to_op(row: Mapping, comm: Mapping | None, kernels: Mapping[str, float], timer: CommTimer) -> Op:
    """One ops.parquet row (and its comms.parquet row, for collectives and p2p) as an Op."""
    kind = row["kind"]
    if kind in COMPUTE_KINDS:
        key = row["kernel_key"]
        if key not in kernels:
            raise MissingKernelError(key, f"rank {row['rank']} seq {row['seq']} {row['name']}")
        return Op(row["seq"], kind, row["stream"], float(kernels[key]), flops=float(row["flops"] or 0.0),
                  recompute=row["phase"] == "recompute")
    if comm is None:
        raise ValueError(f"rank {row['rank']} seq {row['seq']}: {kind} op has no comms.parquet row "
                         f"(comm_id {row['comm_id']})")
    return Op(row["seq"], kind, row["stream"], timer.time_us(comm["op"], comm["group"], comm["bytes"]),
              blocking=bool(comm["blocking"]), comm_kind=comm["group_kind"])


def reduce_rank(ops: Sequence[Mapping], comms: Mapping[int, Mapping], kernels: Mapping[str, float],
                timer: CommTimer, waits: Mapping[int, Sequence[int]] | None = None) -> RankCosts:
    """One rank's ops (rows of ops.parquet, any order) and comms (by comm_id) -> its task costs."""
    tasks: dict[tuple[str, int], list[Op]] = {}
    sends: dict[tuple[str, int], float] = {}
    for row in sorted(ops, key=lambda r: r["seq"]):
        task = TASK_OF_PHASE.get(row["phase"])
        if task is None:
            raise ValueError(f"rank {row['rank']} seq {row['seq']}: unknown phase '{row['phase']}'")
        chunk = row["chunk"] if task in ("F", "B") else 0
        op = to_op(row, comms.get(row["comm_id"]), kernels, timer)
        tasks.setdefault((task, chunk), []).append(op)
        if op.kind == "p2p" and comms[row["comm_id"]]["op"] == "send":
            sends[(task, chunk)] = sends.get((task, chunk), 0.0) + op.duration_us
    chunks = 1 + max((c for (t, c) in tasks if t in ("F", "B")), default=0)

    def cost(task: str, chunk: int = 0) -> TaskCost:
        return simulate_ops(tasks.get((task, chunk), ()), waits)

    return RankCosts(forward=tuple(cost("F", c) for c in range(chunks)),
                     backward=tuple(cost("B", c) for c in range(chunks)),
                     send_forward_us=tuple(sends.get(("F", c), 0.0) for c in range(chunks)),
                     send_backward_us=tuple(sends.get(("B", c), 0.0) for c in range(chunks)),
                     grad_sync=cost("grad_sync"), optimizer=cost("optimizer"))


def slowest(costs: Sequence[RankCosts]) -> RankCosts:
    """The stage's costs when several classes share it: each task as long as its slowest class
    (their TP collectives keep them in lockstep, so the stage moves at the slowest one's pace)."""
    if len(costs) == 1:
        return costs[0]
    if len({c.chunks for c in costs}) != 1:
        raise ValueError(f"classes of one stage disagree on chunk count: {[c.chunks for c in costs]}")

    def pick(tasks: Iterable[TaskCost]) -> TaskCost:
        return max(tasks, key=lambda t: t.duration_us)

    n = costs[0].chunks
    return RankCosts(forward=tuple(pick(c.forward[i] for c in costs) for i in range(n)),
                     backward=tuple(pick(c.backward[i] for c in costs) for i in range(n)),
                     send_forward_us=tuple(max(c.send_forward_us[i] for c in costs) for i in range(n)),
                     send_backward_us=tuple(max(c.send_backward_us[i] for c in costs) for i in range(n)),
                     grad_sync=pick(c.grad_sync for c in costs), optimizer=pick(c.optimizer for c in costs))
