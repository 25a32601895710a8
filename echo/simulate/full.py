"""Schedule level, full mode: every rank on its own device, collectives as rendezvous.

For small jobs (and to check symmetric mode): each rank replays its class's programs, with the
groups and peers of its representative relabelled to its own (a translation on the parallel
mesh: ``Relabel``), through its pipeline stage's task order. The op semantics are the symmetric
engine's (``program.replay_steps``); what differs is everything between ranks:

- a collective starts when the last member of its group arrives (the n-th collective a rank
  issues on a group meets the n-th of every other member); a non-blocking one then shares each
  member's link and ends when the slowest member is done;
- a p2p recv matches its peer's send: the n-th recv from a peer in a direction (forward
  activations, backward gradients) takes the n-th send of that peer to this rank in that
  direction;
- ranks may differ: ``compute_scale`` makes a rank's kernels slower (a straggler), and the
  collectives it is in wait for it.

Cost: O(ranks x micro-batches x ops), which is why symmetric mode exists; full mode is for
jobs up to a few hundred ranks.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from echo.simulate.engine import (
    EngineOptions,
    EngineResult,
    Event,
    Ledger,
    StageTimes,
    batched_waits,
    critical_of,
    drain_of,
    stage_programs,
    task_label,
)
from echo.simulate.gpu import Gpu
from echo.simulate.overlaps import with_overlaps
from echo.simulate.program import ASYNC, COMPUTE, Op, RankCosts, replay_steps
from echo.training.schedule import Task

MESH = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Relabel:
    """The parallel mesh of a job: rank <-> coordinates, from rank_classes.parquet."""

    coords: Mapping[int, tuple[int, ...]]   # rank -> (pp, dp, cp, tp)
    ranks: Mapping[tuple[int, ...], int]    # the inverse
    sizes: tuple[int, ...]

    @classmethod
    def from_columns(cls, columns: Mapping[str, Sequence[int]]) -> Relabel:
        """From rank_classes.parquet's columns rank, pp_rank, dp_rank, cp_rank, tp_rank."""
        coords = dict(zip(columns["rank"], zip(*(columns[f"{d}_rank"] for d in MESH), strict=True), strict=True))
        sizes = tuple(1 + max(columns[f"{d}_rank"]) for d in MESH)
        return cls(coords, {c: r for r, c in coords.items()}, sizes)

    @cached_property
    def stage_stride(self) -> int | None:
        """The rank distance between pipeline stages where each stage's ranks fill one block of
        consecutive ranks, laid out alike in every stage (rank = pp x stride + an offset fixed by
        the other coordinates); None otherwise. A move along pp then shifts each rank by a
        multiple of the stride (``stage._moves_alike``)."""
        stages, n = self.sizes[0], len(self.coords)
        if n % stages:
            return None
        stride, offsets = n // stages, {}
        for rank, c in self.coords.items():
            offset = rank - c[0] * stride
            if not 0 <= offset < stride or offsets.setdefault(c[1:], offset) != offset:
                return None
        return stride

    def at_stage(self, rank: int, stage: int) -> int:
        """The rank with ``rank``'s coordinates on pipeline stage ``stage``."""
        return self.ranks[(stage, *self.coords[rank][1:])]

    def mapper(self, rep: int, rank: int):
        """A function taking a global rank seen by ``rep`` to the one ``rank`` sees in its place."""
        delta = [a - b for a, b in zip(self.coords[rank], self.coords[rep], strict=True)]
        # only the axes that move (a class spanning stages moves along pp alone): groups of
        # thousands of ranks are moved member by member
        axes = [(i, d, n) for i, (d, n) in enumerate(zip(delta, self.sizes, strict=True)) if d % n]
        coords, ranks = self.coords, self.ranks

        def move(g: int) -> int:
            c = list(coords[g])
            for i, d, n in axes:
                c[i] = (c[i] + d) % n
            return ranks[tuple(c)]

        return move


def relabel_costs(costs: RankCosts, move, link_of, compute_scale: float = 1.0, timer=None) -> RankCosts:
    """A class's programs as one of its ranks runs them: groups and peers moved by ``move``, link
    classes by ``link_of``, network times re-estimated by ``timer`` (a ``costing.CommTimer``; the
    rank's groups may sit differently on the nodes than its representative's)."""
    cache: dict[int, Op] = {}
    moved: dict[tuple[int, ...], tuple[int, ...]] = {}  # a rank's few groups, each moved once

    def move_group(group: tuple[int, ...]) -> tuple[int, ...]:
        if group not in moved:
            moved[group] = tuple(move(g) for g in group)
        return moved[group]

    def op_of(op: Op) -> Op:
        key = id(op)
        if key not in cache:
            if op.code == COMPUTE:
                cache[key] = dataclasses.replace(op, duration_us=op.duration_us * compute_scale) \
                    if compute_scale != 1.0 else op
            elif op.group or op.peer >= 0:
                group = move_group(tuple(op.group))
                us, latency, loads = (timer.transfer(op.op, group, op.nbytes, op.api) if timer is not None and op.nbytes > 0
                                      else (op.duration_us, op.latency_us, op.loads))
                cache[key] = dataclasses.replace(op, group=group, peer=move(op.peer) if op.peer >= 0 else -1,
                                                 link=link_of(group), duration_us=us, latency_us=latency,
                                                 loads=loads)
            else:
                cache[key] = op
        return cache[key]

    return costs.map_ops(op_of)


@dataclass(frozen=True)
class RankSpec:
    """One rank of the job as the full engine runs it."""

    rank: int
    stage: int
    costs: RankCosts


class _Full:
    def __init__(self, ranks: Sequence[RankSpec], orders: Sequence[Sequence[Task]], options: EngineOptions):
        self.ranks = {r.rank: r for r in ranks}
        self.orders, self.options = orders, options
        self.gpus = {r.rank: Gpu(options.sharing) for r in ranks}
        self.ledgers = {r.rank: Ledger() for r in ranks}
        self.events: list[Event] = []
        self.v = ranks[0].costs.chunks
        self.flows = 0
        self.counters: dict[tuple, int] = {}
        firsts: dict[int, RankCosts] = {}
        for r in ranks:
            firsts.setdefault(r.stage, r.costs)
        # batched_sends: per stage, as the symmetric engine plans it from the stage's programs
        self.batched = batched_waits([with_overlaps(firsts[s], options.tp_comm_overlap) for s in range(len(orders))],
                                     orders, options) if len(firsts) == len(orders) else [{} for _ in orders]
        self.meets: dict[tuple, dict[int, tuple]] = {}      # collective -> {member: its request}
        self.sent: dict[tuple, tuple[float, float, int]] = {}  # p2p key -> (start, arrival, flow)
        self.waiting: dict[tuple, int] = {}                  # p2p key -> the rank waiting for it
        self.flow_in: dict[int, int] = {}                    # rank -> flow its current task received
        self.flow_of: dict[tuple[int, int, float], int] = {}  # (rank, id(op), start) -> flow

    def _count(self, key: tuple) -> int:
        n = self.counters.get(key, 0)
        self.counters[key] = n + 1
        return n

    def program(self, r: int):
        """Rank r's step, as a generator of rendezvous requests."""
        spec, gpu, led = self.ranks[r], self.gpus[r], self.ledgers[r]
        order = self.orders[spec.stage]
        staged = stage_programs(spec.costs, order, self.options)
        last_b, grad_sync = staged.last_b, staged.grad_sync
        carried: list = []
        batched = self.batched[spec.stage]
        sends_end: dict[int, float] = {}  # task position -> when its sends ended
        i = 0
        while i < len(order):
            pair = staged.pairs.get(i)
            tasks = order[i:i + 2] if pair is not None else order[i:i + 1]
            prog = pair or staged.special.get(i) or staged.program(tasks[0])
            self.flow_in[r] = -1
            if i in batched:  # its receive's batch holds earlier tasks' sends (engine.py: batched_sends)
                led.wait(max(sends_end.get(q, 0.0) for q in batched[i]), "pp")
            run = yield from replay_steps(prog, gpu, led.free)
            led.add(run)
            if batched and run.sends:
                sends_end[i] = max(b for _, b, _ in run.sends)
            if i == staged.last_backward:
                carried = [f for f in run.flows if f[2].carry]
            for task in tasks:
                label = task_label(task, self.v)
                kind = "forward" if task.kind == "F" else "backward"
                self.events.append(Event(spec.stage, "compute", label, kind, task.microbatch, task.chunk, run.begin,
                                         run.end, rank=r, flow=self.flow_in[r]))
            gathers = tasks[0].kind == "F" and i in staged.special  # the parameter all-gathers it overlaps
            self._log_comm(r, spec.stage, run, task_label(tasks[0], self.v), tasks[0].microbatch, tasks[0].chunk,
                           flow_prefix="param_gather " if gathers else "")
            i += len(tasks)
        drain = drain_of(grad_sync, self.options.overlap_grad_reduce, last_b)
        run = yield from replay_steps(grad_sync, gpu, led.free, drain=drain)
        led.add(run)
        run.flows[:0] = carried
        self._log_comm(r, spec.stage, run, "grad_sync", -1, -1, prefix="grad_sync ")
        opt = yield from replay_steps(staged.optimizer, gpu, led.free)
        led.add(opt)
        self._log_comm(r, spec.stage, opt, "optimizer", -1, -1)
        self.events.append(Event(spec.stage, "compute", "optimizer", "optimizer", -1, -1, run.end, opt.end, rank=r))

    def _log_comm(self, r: int, stage: int, run, label: str, mb: int, chunk: int, prefix: str = "",
                  flow_prefix: str = "") -> None:
        for a, b, op in run.sends:
            self.events.append(Event(stage, op.stream, f"send {label}", "send", mb, chunk, a, b, rank=r,
                                     flow=self.flow_of.get((r, id(op), a), -1)))
        flows = run.flows if prefix else [f for f in run.flows if not f[2].carry]
        for a, b, op in run.colls + flows:
            name = f"{prefix or (flow_prefix if op.code == ASYNC else '')}{op.op} {op.comm_kind}"
            self.events.append(Event(stage, op.stream if op.code == ASYNC else "collective",
                                     name, "collective", mb, chunk, a, b, rank=r,
                                     flow=self.flow_of.get((r, id(op), a), -1)))

    def run(self) -> None:
        gens = {r: self.program(r) for r in self.ranks}
        queue = deque((r, None) for r in sorted(gens))
        done: set[int] = set()
        blocked: dict[int, tuple] = {}
        while queue:
            r, value = queue.popleft()
            try:
                request = gens[r].send(value)
            except StopIteration:
                done.add(r)
                continue
            blocked[r] = request
            for rr, vv in self._serve(r, request):
                blocked.pop(rr, None)
                queue.append((rr, vv))
        if len(done) != len(gens):
            r = min(set(gens) - done)
            raise RuntimeError(f"full mode deadlocks: rank {r} waits forever at {_describe(blocked.get(r))}")

    def _serve(self, r: int, request: tuple) -> list[tuple[int, object]]:
        """Answers that can be given now: [(rank, value to resume it with)]."""
        what, op = request[0], request[1]
        if what == "send":
            a, b = request[2]
            key = (r, op.peer, op.stream, self._count(("send", r, op.peer, op.stream)))
            self.flows += 1
            self.sent[key] = (a, b, self.flows)
            self.flow_of[(r, id(op), a)] = self.flows
            out: list[tuple[int, object]] = [(r, None)]
            if key in self.waiting:
                rr = self.waiting.pop(key)
                out.append((rr, self._deliver(rr, key)))
            return out
        if what == "recv":
            key = (op.peer, r, op.stream, self._count(("recv", op.peer, r, op.stream)))
            if key in self.sent:
                return [(r, self._deliver(r, key))]
            self.waiting[key] = r
            return []
        group = tuple(sorted(op.group))
        if r not in group:
            raise ValueError(f"rank {r} issues {op.op} on group {list(group)} it is not in")
        key = (what, group, self._count((r, group)))
        meet = self.meets.setdefault(key, {})
        meet[r] = request
        if len(meet) < len(group):
            return []
        del self.meets[key]
        start = max(req[2] for req in meet.values())
        self.flows += 1
        for m, req in meet.items():
            self.flow_of[(m, id(req[1]), start)] = self.flows
        if what == "coll":
            return [(m, start) for m in sorted(meet)]
        end = max(self.gpus[m].share(start, req[1].flow) for m, req in meet.items())
        for m, req in meet.items():
            self.gpus[m].occupy("comm", req[1].flow, start, end)
        return [(m, (start, end)) for m in sorted(meet)]

    def _deliver(self, r: int, key: tuple) -> tuple[float, float]:
        a, b, flow = self.sent.pop(key)
        self.flow_in[r] = flow
        return a, b


def _describe(request: tuple | None) -> str:
    if not request:
        return ""
    op: Op = request[1]
    return f"({op.op} seq {op.seq}, group {list(op.group) or op.peer})"


def simulate_full(ranks: Sequence[RankSpec], orders: Sequence[Sequence[Task]],
                  options: EngineOptions | None = None) -> EngineResult:
    """Run every rank through its stage's task order; see the module docstring."""
    options = options or EngineOptions()
    if options.post_validation:
        raise ValueError("post_validation (no optimizer synchronization between stages) is modelled in symmetric "
                         "mode only")
    if not ranks:
        raise ValueError("full mode needs at least one rank")
    if len({r.costs.chunks for r in ranks}) != 1:
        raise ValueError("ranks disagree on chunks per stage")
    sim = _Full(ranks, orders, options)
    sim.run()
    step = max(led.free for led in sim.ledgers.values())
    order = sorted(sim.ranks)
    per_rank = tuple(sim.ledgers[r].times(step) for r in order)
    stage_of = tuple(sim.ranks[r].stage for r in order)
    stages: list[StageTimes] = []
    for s in range(len(orders)):
        members = [i for i, st in enumerate(stage_of) if st == s]
        if not members:
            raise ValueError(f"full mode: no rank on pipeline stage {s}")
        stages.append(per_rank[max(members, key=lambda i: (per_rank[i].end_us, -i))])
    critical_stage = critical_of(stages)
    critical_rank = order[critical_of(per_rank)]
    return EngineResult(step_us=step, critical_stage=critical_stage, stages=tuple(stages),
                        events=tuple(sim.events), mode="full", ranks=per_rank, rank_stage=stage_of,
                        critical_rank=critical_rank)
