"""Schedule level, symmetric mode: micro-batch tasks across pipeline stages, one device per stage.

Symmetric mode: one timeline per pipeline stage, shared by every rank of that stage (data-parallel
replicas and TP peers run the same tasks at the same times, so every collective's members arrive
together), so the cost is O(stages x chunks x micro-batches) whatever the world size. ``full.py``
expands every rank instead; both replay ops with ``program.replay_steps`` on ``gpu.Gpu`` devices,
and tests hold them to the same step time.

Each stage runs its schedule order (echo.training.schedule) on its compute stream. A task of virtual stage k
takes its input from the sends of the task that produced it (virtual stage k - 1 for a forward,
k + 1 for a backward): its recv ops wait for those transfers. Sends queue on the stage's p2p
stream of their direction and overlap (and slow, ``gpu.py``) what the stage runs next. After its
last backward a stage reduces gradients (grad_sync, comm stream) and then steps the optimizer.

Zero-bubble orders (``schedule.SPLIT_BACKWARD``) hold W tasks: a B runs the backward without its
weight-gradient ops (``RankCosts.input_grad``), a W those ops (``RankCosts.weight_grad``); a W needs
nothing from another stage (its B ran before it on the same stage) and sends nothing. The
gradient buckets of ``overlap_grad_reduce`` ride in the last W, where the gradients are made.
``EngineOptions.post_validation`` (the zero-bubble paper's optimizer post-validation, section 4)
removes the step's one synchronization of every stage, the optimizer's all-ranks collective
(gradient norm, inf / NaN check), which the paper replaces by validating after the update and
rolling back if needed: each stage then starts its next step when it is done and its first input
arrives, so the step is the longest stage's span, from the end of its first task's leading
receive to the end of its optimizer (the wait before that first task leaves the accounts).

``EngineOptions.batched_sends`` (the zero-bubble orders, ``schedule.BATCHED_SENDS``, as the
paper's runtime runs them): the runtime batches each transfer with those planned next to it
and a pass that receives waits for every request of its receive's batch, sends included
(``echo.training.zb_comm``, which replays the runtime's plan for the stage's order and pass
times). A task so waits, before it starts, for the sends of the earlier tasks of its stage that
the plan batches with its receive; the wait is exposed pp communication.

Gradient reduction overlap (``EngineOptions.overlap_grad_reduce``, Megatron-LM's
``--overlap-grad-reduce``) is off by default, as the trace records it: grad_sync after the last
backward, which is what Megatron-LM does without the flag (the default of its DDP config) and
what the SC21 GPT-3 runs did (the reduction after the pipeline flush). On, the buckets move into
the stage's last backward (``overlaps.with_buckets``), issued as their gradients are ready.

Two more overlaps the trace does not record, both off by default (``EngineOptions``; the
workload's ``parallel`` keys of the same names):

- ``overlap_param_gather`` (Megatron-LM's ``--overlap-param-gather``): the distributed
  optimizer's parameter all-gathers leave the optimizer task and run, in steady state, beside the
  next iteration's forward: issued at the start of each chunk's first forward task, each bucket
  waited for where the forward reaches its layers (``overlaps.with_param_gather``).
- ``tp_comm_overlap`` (Transformer Engine's userbuffers): each sequence-parallel all-gather /
  reduce-scatter is pipelined in tp chunks with the GEMM that consumes / produces it
  (``overlaps.with_tp_overlap``), in every forward and backward task.
- ``ep_comm_overlap`` (Megatron-Core's --overlap-moe-expert-parallel-comm): each steady-state
  forward and the backward after it run as one task (``overlaps.combined``), each pass'
  expert-parallel all-to-alls beside the other's compute; the task starts once both inputs have
  been produced (the orders warm up one micro-batch more: ``schedule.orders_of``).

Every gap on a stage's compute stream is classified: waiting for a p2p transfer in flight is
exposed pp communication, waiting for a collective is exposed communication of its kind, the
rest (waiting for another stage to compute, or for the slowest stage to finish the step) is
bubble. compute (slowdown included) + exposed + bubble = step time on every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from echo.config.workload import model_stages, virtual_stage
from echo.simulate.gpu import Gpu, LinkSharing, max_min_share
from echo.simulate.overlaps import ep_pairs, is_second, with_buckets, with_overlaps, with_param_gather
from echo.simulate.program import BLOCKING, Program, RankCosts, Run, replay
from echo.training import zb_comm
from echo.training.schedule import Task, splits_backward
from echo.training.zb_auto import PassTimes

_Key = tuple[str, int, int]  # (kind of the producing task, micro-batch, its virtual stage)


@dataclass(frozen=True)
class EngineOptions:
    """Modelling choices of the schedule level (both modes)."""

    overlap_grad_reduce: bool = False   # see the module docstring
    overlap_param_gather: bool = False  # see the module docstring
    tp_comm_overlap: bool = False       # see the module docstring
    ep_comm_overlap: bool = False       # see the module docstring
    post_validation: bool = False       # see the module docstring (symmetric mode)
    batched_sends: bool = False         # see the module docstring: the zero-bubble runtime's batched p2p
    placement: str = "interleaved"      # chunks on ranks (ParallelConfig.placement): interleaved | v | dual
    sharing: LinkSharing = max_min_share  # how overlapping transfers share links (gpu.py)


@dataclass(frozen=True)
class Event:
    """One interval on one stream (of a stage in symmetric mode, of a rank in full mode)."""

    stage: int
    stream: str      # compute | comm | p2p_fwd | p2p_bwd | collective
    name: str
    kind: str        # forward | backward | optimizer | send | collective (grad_sync's: named "grad_sync ...")
    microbatch: int  # -1 for once-per-step tasks
    chunk: int
    start_us: float
    end_us: float
    rank: int = -1   # full mode
    flow: int = -1   # events sharing a flow id are linked in the Perfetto trace (p2p, collectives)


@dataclass(frozen=True)
class StageTimes:
    """Where one stage's (or rank's) step went: compute_us + sum(exposed_us) + bubble_us = step."""

    end_us: float                                # when its optimizer step finishes
    compute_us: float                            # kernels busy on the compute stream
    exposed_us: tuple[tuple[str, float], ...]    # (group kind, us the compute stream waited on it)
    bubble_us: float                             # idle, waiting for other stages
    slowdown_us: float = 0.0                     # of compute_us, added by the overlap slowdown

    def exposed(self, kind: str) -> float:
        return sum(us for k, us in self.exposed_us if k == kind)


@dataclass(frozen=True)
class EngineResult:
    """The simulated step."""

    step_us: float
    critical_stage: int          # the stage that bounds the step (critical_of)
    stages: tuple[StageTimes, ...]
    events: tuple[Event, ...]
    mode: str = "symmetric"
    ranks: tuple[StageTimes, ...] = ()   # full mode: per rank
    rank_stage: tuple[int, ...] = ()     # full mode: each rank's stage
    critical_rank: int = -1


@dataclass
class Ledger:
    """Running account of one compute stream."""

    free: float = 0.0
    compute: float = 0.0
    slowdown: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0

    def add(self, run: Run) -> None:
        self.compute += run.compute_us
        self.slowdown += run.slowdown_us
        self.bubble += run.bubble_us
        for k, us in run.exposed.items():
            self.exposed[k] = self.exposed.get(k, 0.0) + us
        self.free = run.end

    def wait(self, until: float, kind: str | None) -> None:
        """Idle until ``until``: exposed ``kind``, or bubble when None."""
        if until > self.free:
            if kind is None:
                self.bubble += until - self.free
            else:
                self.exposed[kind] = self.exposed.get(kind, 0.0) + until - self.free
            self.free = until

    def times(self, step: float, lead: tuple[float, float] = (0.0, 0.0)) -> StageTimes:
        """The account at a step of ``step``; ``lead``: (bubble, pp) before the first task began,
        left out (post-validation: the stage's step starts there)."""
        pp = lead[1]
        exposed = dict(self.exposed)
        if pp:
            exposed["pp"] = exposed.get("pp", 0.0) - pp
        # compute + exposed + bubble = free before; the lead's pp moves to the bubble, which the
        # step then trims: compute + exposed' + bubble' = step
        return StageTimes(end_us=self.free, compute_us=self.compute, exposed_us=tuple(sorted(exposed.items())),
                          bubble_us=self.bubble + pp + step - self.free, slowdown_us=self.slowdown)


def bucket_programs(last: Program, grad_sync: Program, overlap: bool) -> tuple[Program, Program]:
    """(last backward, grad_sync) programs of a stage whose last gradient-making task runs ``last``."""
    if not overlap:
        return last, grad_sync
    return with_buckets(last, grad_sync)


@dataclass(frozen=True)
class StagePrograms:
    """What one stage (or rank) runs through its order, with the overlaps of the options applied."""

    costs: RankCosts                 # per-chunk programs (TP overlap applied)
    special: dict[int, Program]      # position in the order -> the program that task runs instead
    last_backward: int               # position of the last backward in the order (-1: none)
    last_b: Program                  # the last backward (gradient buckets carried out of it, if overlapped)
    grad_sync: Program
    optimizer: Program               # without the parameter all-gathers, if overlapped
    pairs: dict[int, Program] = field(default_factory=dict)  # position -> the combined program of it and the next
    split: bool = False              # the order has W tasks (zero-bubble): B and W run apart

    def program(self, task: Task) -> Program:
        """The program a task of the order runs (before the per-position specials)."""
        return task_program(self.costs, task, self.split)


def task_program(costs: RankCosts, task: Task, split: bool) -> Program:
    """A task's program in an order that does (``split``) or does not run W tasks: a whole
    backward (dualpipev's) keeps its W even in a split order."""
    return costs.program(task.kind, task.chunk, split and not task.whole)


def stage_programs(costs: RankCosts, order: Sequence[Task], options: EngineOptions,
                   memo: dict | None = None) -> StagePrograms:
    """A stage's programs for ``order``: the last backward with the gradient buckets
    (overlap_grad_reduce), the first forward of each chunk with the parameter all-gathers
    (overlap_param_gather), every forward and backward with TP overlap (tp_comm_overlap).
    ``memo``: programs already made from the same programs (the stages that run one class's
    programs, ``stage.stage_costs``): the buckets, the gathers and the combined pairs
    (``overlaps.ep_pairs``), by the identity of what they were made of."""
    memo = {} if memo is None else memo

    def once(key: tuple, sources: tuple, make):
        """``make()``, once per key (``sources``, kept beside it, keep the ids in the key their own)."""
        if key not in memo:
            memo[key] = (sources, make())
        return memo[key][1]

    costs = once(("tp", id(costs), options.tp_comm_overlap), (costs,),
                 lambda: with_overlaps(costs, options.tp_comm_overlap))
    split = splits_backward(list(order))
    if split and options.ep_comm_overlap:
        raise ValueError("ep_comm_overlap pairs a forward with a whole backward; it does not run with W tasks "
                         "(dualpipev pairs its own)")
    # the task that computes the step's last weight gradients: the last W (or whole backward), else backward
    ends = [i for i, t in enumerate(order) if (t.kind == "W" or t.whole if split else t.kind == "B")]
    last = max(ends, default=-1)
    last_prog = task_program(costs, order[last], split) if last >= 0 else Program()
    last_b, grad_sync = once(("buckets", id(last_prog), id(costs.grad_sync), options.overlap_grad_reduce),
                             (last_prog, costs.grad_sync),
                             lambda: bucket_programs(last_prog, costs.grad_sync, options.overlap_grad_reduce))
    special: dict[int, Program] = {}
    optimizer = costs.optimizer
    if options.overlap_param_gather:
        firsts, optimizer = once(("gather", *map(id, costs.forward), id(costs.optimizer)),
                                 (costs.forward, costs.optimizer),
                                 lambda: with_param_gather(costs.forward, costs.optimizer))
        for c, prog in enumerate(firsts):
            i = next((i for i, t in enumerate(order) if t.kind == "F" and t.chunk == c), -1)
            if i >= 0 and prog is not costs.forward[c]:
                special[i] = prog
    if last >= 0:
        special[last] = last_b
    pairs = {}
    # combined 1F1B's pairs, or a schedule's own: dualpipev's, the only pairs in an order with W
    # tasks (a forward and a whole backward), which receive and send their two passes' p2p together
    if options.ep_comm_overlap or split:
        pairs = ep_pairs(order, lambda t: task_program(costs, t, split), special, batched_p2p=split, memo=memo)
    return StagePrograms(costs, special, last, last_b, grad_sync, optimizer, pairs, split)


def drain_of(grad_sync: Program, overlap: bool, buckets: Program) -> tuple[str, str] | None:
    """What grad_sync waits for at its end besides its own ops: the carried buckets."""
    carried = [op for op in buckets.ops if op.carry]
    return ("comm", carried[-1].comm_kind or "dp") if overlap and carried else None


def task_label(task: Task, chunks: int) -> str:
    return f"{task.kind}{task.microbatch}" + (f".c{task.chunk}" if chunks > 1 else "")


class _Pipeline:
    """State of one symmetric simulation: devices, ledgers, transfers in flight, events."""

    def __init__(self, costs: Sequence[RankCosts], orders: Sequence[Sequence[Task]], options: EngineOptions):
        self.options = options
        self.p, self.v = len(costs), costs[0].chunks
        self.gpus = [Gpu(options.sharing) for _ in costs]
        self.ledgers = [Ledger() for _ in costs]
        self.arrivals: dict[_Key, list[tuple[float, float, int]]] = {}  # -> (start, arrival, flow) per send
        self.events: list[Event] = []
        self.flows = 0
        memo: dict = {}  # stages that run one class's programs (stage_costs) pair them once
        staged = [stage_programs(c, o, options, memo) for c, o in zip(costs, orders, strict=True)]
        self.last_b = [x.last_backward for x in staged]
        self.costs = [x.costs for x in staged]
        self.special = [x.special for x in staged]
        self.last_progs = [(x.last_b, x.grad_sync) for x in staged]
        # each optimizer before and from its all-ranks collective, where every stage meets
        self.optimizers = [_split_at_world(x.optimizer) for x in staged]
        self.pairs = [x.pairs for x in staged]
        self.staged = staged
        if options.placement not in ("interleaved", "v", "dual"):
            raise ValueError(f"unknown chunk placement '{options.placement}' (interleaved | v | dual)")
        # the last position on a micro-batch's way (dual: one chunk of each stage)
        self.last_k = model_stages(options.placement, self.p, self.v) - 1
        self.lead = [(0.0, 0.0)] * len(costs)   # (bubble, pp) before each stage's first task began
        self.started = [False] * len(costs)
        self.opt_start = [0.0] * len(costs)
        self.carried: list[list[tuple[float, float, object]]] = [[] for _ in costs]
        # batched_sends: per stage, task position -> the earlier positions whose sends it waits for,
        # and when each task's sends ended
        self.batched = batched_waits(self.costs, orders, options)
        self.sends_end: list[dict[int, float]] = [{} for _ in costs]

    def virtual_stage(self, chunk: int, s: int) -> int:
        """Chunk ``chunk`` of stage s as a position in the model (ParallelConfig.virtual_stage)."""
        return virtual_stage(self.options.placement, self.p, chunk, s)

    def needs(self, task: Task, k: int) -> _Key | None:
        """What ``task`` (on virtual stage k) waits for, besides its own stage being free."""
        if task.kind == "F":
            return None if k == 0 else ("F", task.microbatch, k - 1)
        if task.kind == "W":  # its B ran before it on this stage
            return None
        return ("F", task.microbatch, k) if k == self.last_k else ("B", task.microbatch, k + 1)

    def try_run(self, s: int, order: Sequence[Task], pos: int) -> int:
        """Run the task at ``pos`` of stage s's order (with the next one when the two run
        combined) if its inputs have been produced; returns how many tasks ran (0: not yet)."""
        pair = self.pairs[s].get(pos)
        tasks = order[pos:pos + 2] if pair is not None else order[pos:pos + 1]
        ks = [self.virtual_stage(t.chunk, s) for t in tasks]
        needs = [self.needs(t, k) for t, k in zip(tasks, ks, strict=True)]
        if any(n is not None and n not in self.arrivals for n in needs):
            return 0
        inputs = [self.arrivals.pop(n) if n is not None else [] for n in needs]
        led, gpu = self.ledgers[s], self.gpus[s]
        last = pos == self.last_b[s]
        parts = [self.staged[s].program(t) for t in tasks]
        prog = pair or self.special[s].get(pos) or parts[0]
        recvs: list[tuple[float, float]] = []
        for x in ((1, 0) if pair is not None else (0,)):  # a combined program's backward comes first
            got = [(a, b) for a, b, _ in inputs[x]]
            if got and (prog if pair is None else parts[x]).recvs == 0:  # input without a recv op in the trace: wait before the task
                sent, arrive = min(a for a, _ in got), max(b for _, b in got)
                led.wait(max(led.free, min(sent, arrive)), None)
                led.wait(arrive, "pp")
            elif pair is not None:
                recvs += (got + [(0.0, 0.0)] * parts[x].recvs)[:parts[x].recvs]
            else:
                recvs = got
        if pos in self.batched[s]:  # its receive's batch holds earlier tasks' sends (batched_sends)
            led.wait(max(self.sends_end[s].get(q, 0.0) for q in self.batched[s][pos]), "pp")
        run = replay(prog, gpu, led.free, recvs)
        if self.batched[s] and run.sends:
            self.sends_end[s][pos] = max(b for _, b, _ in run.sends)
        begin = max([run.start, *(b for _, b in recvs[:prog.recvs])])
        if not self.started[s]:
            self.started[s] = True
            # nothing ran before: the stage waited from 0 to begin, for a transfer in flight (pp) or not
            pp = led.exposed.get("pp", 0.0) + min(run.exposed.get("pp", 0.0), begin - run.start)
            self.lead[s] = (begin - pp, pp)
        led.add(run)
        if last:
            self.carried[s] = [f for f in run.flows if f[2].carry]
        for x, (task, k) in enumerate(zip(tasks, ks, strict=True)):
            flow_in = inputs[x][-1][2] if inputs[x] else -1
            kind = "forward" if task.kind == "F" else "backward"
            label = task_label(task, self.v)
            self.events.append(Event(s, "compute", label, kind, task.microbatch, task.chunk, begin, run.end,
                                     flow=flow_in))
            if task.kind == "F" and pos in self.special[s]:  # the parameter all-gathers it overlaps
                for a, b, op in run.flows:
                    self.events.append(Event(s, "comm", f"param_gather {op.op} {op.comm_kind}", "collective",
                                             task.microbatch, task.chunk, a, b))
            sends = [f for f in run.sends if is_second(f[2]) == (x == 1)] if pair is not None else run.sends
            self._deliver(s, task, k, sends, run.end, label)
        if pair is not None:  # the pair's all-to-alls, on the ep stream beside the other pass' compute
            for a, b, op in run.flows:
                task = tasks[1] if is_second(op) else tasks[0]
                self.events.append(Event(s, op.stream, f"{op.op} {op.comm_kind}", "collective", task.microbatch,
                                         task.chunk, a, b))
        return len(tasks)

    def _deliver(self, s: int, task: Task, k: int, sends: list, end: float, label: str) -> None:
        """Hand a finished task's sends to the task that consumes them."""
        last = self.last_k
        if task.kind == "F" and k == last:
            self.arrivals[("F", task.microbatch, k)] = []  # the loss' gradient stays here
            return
        if (task.kind == "B" and k == 0) or task.kind == "W":
            return
        out = []
        for a, b, op in sends:
            self.flows += 1
            out.append((a, b, self.flows))
            self.events.append(Event(s, op.stream, f"send {label}", "send", task.microbatch, task.chunk, a, b,
                                     flow=self.flows))
        self.arrivals[(task.kind, task.microbatch, k)] = out or [(end, end, -1)]

    def finish_step(self, s: int) -> float:
        """grad_sync (on the comm stream), then the optimizer up to its first collective over every
        rank (the gradient norm's all-reduce: every stage meets there); returns when stage s
        arrives at it (its end, without one)."""
        led, gpu = self.ledgers[s], self.gpus[s]
        last_b, grad_sync = self.last_progs[s]
        drain = drain_of(grad_sync, self.options.overlap_grad_reduce, last_b)
        run = replay(grad_sync, gpu, led.free, drain=drain)
        led.add(run)
        self.opt_start[s] = run.end
        for a, b, op in self.carried[s] + [f for f in run.flows if not f[2].carry]:
            self.events.append(Event(s, "comm", f"grad_sync {op.op} {op.comm_kind}", "collective", -1, -1, a, b))
        self._optimizer_part(s, self.optimizers[s][0])
        return led.free

    def finish_optimizer(self, s: int, meet: float) -> None:
        """The optimizer from the all-ranks collective on, which starts at ``meet`` (the last
        stage's arrival: the wait is exposed communication of its kind, as in full mode)."""
        after = self.optimizers[s][1]
        led = self.ledgers[s]
        if after.ops and not self.options.post_validation:
            led.wait(meet, after.ops[0].comm_kind)
        self._optimizer_part(s, after)
        self.events.append(Event(s, "compute", "optimizer", "optimizer", -1, -1, self.opt_start[s], led.free))

    def _optimizer_part(self, s: int, prog: Program) -> None:
        led = self.ledgers[s]
        opt = replay(prog, self.gpus[s], led.free)
        led.add(opt)
        for a, b, op in opt.flows:
            self.events.append(Event(s, "comm", f"{op.op} {op.comm_kind}", "collective", -1, -1, a, b))


def _split_at_world(prog: Program) -> tuple[Program, Program]:
    """``prog`` before and from its first blocking collective over every rank (group kind world)."""
    i = next((i for i, op in enumerate(prog.ops) if op.code == BLOCKING and op.comm_kind == "world"), len(prog.ops))
    return Program(prog.ops[:i], prog.waits), Program(prog.ops[i:], prog.waits)


def pass_times(costs: Sequence[RankCosts], activations: Sequence[Sequence[float]]) -> list:
    """Each stage's F, B and W times (their programs' clean replays), its longest p2p send and the
    share of a chunk's activations (``activations[s][c]``: a micro-batch's, bytes) that a W owed
    keeps (at most all of them: what it keeps beyond, its output gradients, is small beside a
    stage's activations in flight): what a schedule built for the pass times (``schedule.TIMED``)
    is built on. One ``PassTimes`` per stage (chunk 0), or, for stages of several chunks, a list
    of them per stage."""
    out = []
    for c, activation in zip(costs, activations, strict=True):
        if not c.weight_grad:
            raise ValueError("a schedule built for pass times needs the backward split into B and W")
        per = []
        for k in range(c.chunks):
            sends = [op.duration_us for p in (c.forward[k], c.input_grad[k]) for op in p.send_ops]
            share = min(1.0, c.w_pending_bytes[k] / activation[k]) if activation[k] else 1.0
            per.append(PassTimes(c.forward[k].cost.duration_us, c.input_grad[k].cost.duration_us,
                                 c.weight_grad[k].cost.duration_us, max(sends, default=0.0), share))
        out.append(per[0] if c.chunks == 1 else per)
    return out


def batched_waits(costs: Sequence[RankCosts], orders: Sequence[Sequence[Task]],
                  options: EngineOptions) -> list[dict[int, tuple[int, ...]]]:
    """Per stage, task position -> positions whose sends it waits for (``batched_sends``, the
    module docstring), from the stages' pass times; none without the option or W tasks."""
    if not options.batched_sends or not splits_backward(list(orders[0])):
        return [{} for _ in orders]
    times = pass_times(costs, [[0.0] * c.chunks for c in costs])
    return zb_comm.batch_waits(orders, [t if isinstance(t, list) else [t] for t in times], options.placement)


def simulate(costs: Sequence[RankCosts], orders: Sequence[Sequence[Task]],
             options: EngineOptions = EngineOptions()) -> EngineResult:
    """Run every stage's task order (``orders[s]``) with the stage's programs (``costs[s]``)."""
    if len(costs) != len(orders) or not costs:
        raise ValueError(f"{len(costs)} stage costs for {len(orders)} stage orders")
    if len({c.chunks for c in costs}) != 1:
        raise ValueError(f"stages disagree on chunks per stage: {[c.chunks for c in costs]}")
    run = _Pipeline(costs, orders, options)
    pos = [0] * len(orders)
    progress = True
    while progress:  # each pass runs every task whose input has arrived; orders fix the rest
        progress = False
        for s, order in enumerate(orders):
            while pos[s] < len(order) and (ran := run.try_run(s, order, pos[s])):
                pos[s] += ran
                progress = True
    stuck = [(s, order[pos[s]]) for s, order in enumerate(orders) if pos[s] < len(order)]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: stage {stuck[0][0]} waits forever at {stuck[0][1]}")
    arrivals = [run.finish_step(s) for s in range(len(costs))]
    for s in range(len(costs)):
        run.finish_optimizer(s, max(arrivals))
    if options.post_validation:  # each stage's span, without the wait before its first task
        step = max(led.free - sum(lead) for led, lead in zip(run.ledgers, run.lead, strict=True))
        stages = tuple(led.times(step, lead) for led, lead in zip(run.ledgers, run.lead, strict=True))
    else:
        step = max(led.free for led in run.ledgers)
        stages = tuple(led.times(step) for led in run.ledgers)
    return EngineResult(step_us=step, critical_stage=critical_of(stages), stages=stages, events=tuple(run.events))


def critical_of(times: Sequence[StageTimes]) -> int:
    """The stage (or rank) that bounds the step: the one that waited least for the others (its
    bubble; within a millionth of the step, the one that finishes last, then the first). Every
    stage's breakdown adds up to the step, and with a synchronizing optimizer step all of them end
    within the spread of their optimizer steps, so the last to finish says little: a pipeline
    whose first rank holds two light chunks (DualPipeV with the embedding and the head on rank 0)
    would report that rank's waiting as the step's bubble."""
    step = max(t.end_us for t in times)
    least = min(t.bubble_us for t in times)
    near = [i for i, t in enumerate(times) if t.bubble_us <= least + 1e-6 * step]
    return max(near, key=lambda i: (times[i].end_us, -i))
