"""Schedule level: micro-batch tasks across pipeline stages, with p2p and data-parallel traffic.

Symmetric mode: one timeline per pipeline stage, shared by every rank of that stage (data-parallel
replicas and TP peers run the same tasks at the same times), so the cost is
O(stages x chunks x micro-batches) whatever the world size.

Each stage runs its schedule order (schedule.py) on its compute stream. A forward of virtual
stage k waits for the activation of virtual stage k - 1 (its end plus the p2p transfer, queued
on the sender's p2p stream); a backward waits for the gradient from virtual stage k + 1, or for
its own forward on the last virtual stage. After its last backward a stage reduces gradients
(grad_sync, comm stream) and then steps the optimizer, which needs the reduced gradients.

Every gap on a stage's compute stream is classified: waiting for a p2p transfer in flight is
exposed pp communication, waiting for grad_sync is exposed dp communication, the rest (waiting
for another stage to compute, or for the slowest stage to finish the step) is bubble. With the
task-level split from chunk.py, compute + exposed comm + bubble = step time on every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from echo.simulate.chunk import RankCosts, TaskCost
from echo.simulate.schedule import Task

_Key = tuple[str, int, int]  # (kind of the producing task, micro-batch, its virtual stage)


@dataclass(frozen=True)
class EngineOptions:
    """Modelling choices of the schedule level."""

    # Launch grad_sync's buckets while the last backward still runs (Megatron-LM's
    # overlap_grad_reduce, PyTorch DDP): bucket i of n is taken as ready after (i + 1) / n of that
    # backward. Off: the reduction starts after the last backward, as the trace records it.
    overlap_grad_reduce: bool = False


@dataclass(frozen=True)
class Event:
    """One interval on one stage's stream."""

    stage: int
    stream: str      # compute | comm | p2p_fwd | p2p_bwd
    name: str
    kind: str        # forward | backward | optimizer | send | collective
    microbatch: int  # -1 for once-per-step tasks
    chunk: int
    start_us: float
    end_us: float


@dataclass(frozen=True)
class StageTimes:
    """Where one stage's step went: compute_us + sum(exposed_us) + bubble_us = the step time."""

    end_us: float                                # when its optimizer step finishes
    compute_us: float                            # kernels busy on the compute stream
    exposed_us: tuple[tuple[str, float], ...]    # (group kind, us the compute stream waited on it)
    bubble_us: float                             # idle, waiting for other stages

    def exposed(self, kind: str) -> float:
        return sum(us for k, us in self.exposed_us if k == kind)


@dataclass(frozen=True)
class EngineResult:
    """The simulated step."""

    step_us: float
    critical_stage: int          # the stage that finishes last
    stages: tuple[StageTimes, ...]
    events: tuple[Event, ...]


@dataclass
class _Ledger:
    """Running account of one stage's compute stream."""

    free: float = 0.0
    compute: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    bubble: float = 0.0
    last_backward: tuple[float, float] = (0.0, 0.0)

    def add_exposed(self, kind: str, us: float) -> None:
        if us > 0:
            self.exposed[kind] = self.exposed.get(kind, 0.0) + us

    def run(self, start: float, cost: TaskCost) -> float:
        """Run a task from ``start``; the gap before it must already be accounted."""
        self.compute += cost.compute_us
        for kind, us in cost.exposed_us:
            self.add_exposed(kind, us)
        self.free = start + cost.duration_us
        return self.free


class _Pipeline:
    """State of one simulation: ledgers, transfers in flight, events."""

    def __init__(self, costs: Sequence[RankCosts], options: EngineOptions):
        self.costs, self.options = costs, options
        self.p, self.v = len(costs), costs[0].chunks
        self.ledgers = [_Ledger() for _ in costs]
        self.p2p_free = [{"fwd": 0.0, "bwd": 0.0} for _ in costs]
        self.arrivals: dict[_Key, tuple[float, float]] = {}  # -> (transfer start, arrival)
        self.events: list[Event] = []

    def needs(self, task: Task, k: int) -> _Key | None:
        """What ``task`` (on virtual stage k) waits for, besides its own stage being free."""
        if task.kind == "F":
            return None if k == 0 else ("F", task.microbatch, k - 1)
        return ("F", task.microbatch, k) if k == self.p * self.v - 1 else ("B", task.microbatch, k + 1)

    def try_run(self, s: int, task: Task) -> bool:
        """Run ``task`` on stage s if its input has been produced; False if not yet."""
        k = task.chunk * self.p + s
        need = self.needs(task, k)
        if need is not None and need not in self.arrivals:
            return False
        sent, arrive = self.arrivals.pop(need) if need is not None else (0.0, 0.0)
        led = self.ledgers[s]
        start = max(led.free, arrive)
        pp_wait = max(0.0, arrive - max(led.free, sent)) if arrive > led.free else 0.0
        led.add_exposed("pp", pp_wait)
        led.bubble += start - led.free - pp_wait
        cost = (self.costs[s].forward if task.kind == "F" else self.costs[s].backward)[task.chunk]
        end = led.run(start, cost)
        if task.kind == "B":
            led.last_backward = (start, end)
        self._event(s, "compute", task, start, end)
        self._deliver(s, task, k, end)
        return True

    def _deliver(self, s: int, task: Task, k: int, end: float) -> None:
        """Ship a finished task's output to the stage that consumes it."""
        last = self.p * self.v - 1
        if task.kind == "F" and k == last:
            self.arrivals[("F", task.microbatch, k)] = (end, end)  # the loss' gradient stays here
            return
        if task.kind == "B" and k == 0:
            return
        direction, dest = ("fwd", k + 1) if task.kind == "F" else ("bwd", k - 1)
        us = (self.costs[s].send_forward_us if task.kind == "F" else self.costs[s].send_backward_us)[task.chunk]
        if dest % self.p == s or us <= 0:
            self.arrivals[(task.kind, task.microbatch, k)] = (end, end)
            return
        start = max(end, self.p2p_free[s][direction])
        self.p2p_free[s][direction] = start + us
        self.arrivals[(task.kind, task.microbatch, k)] = (start, start + us)
        self.events.append(Event(s, f"p2p_{direction}", f"send {self._label(task)}", "send",
                                 task.microbatch, task.chunk, start, start + us))

    def _label(self, task: Task) -> str:
        return f"{task.kind}{task.microbatch}" + (f".c{task.chunk}" if self.v > 1 else "")

    def _event(self, s: int, stream: str, task: Task, start: float, end: float) -> None:
        kind = "forward" if task.kind == "F" else "backward"
        self.events.append(Event(s, stream, self._label(task), kind, task.microbatch, task.chunk, start, end))

    def finish_step(self, s: int) -> None:
        """grad_sync on the comm stream, then the optimizer once the gradients are reduced."""
        led, costs = self.ledgers[s], self.costs[s]
        sync_end = self._grad_sync(s, costs.grad_sync, led)
        start = max(led.free, sync_end)
        led.add_exposed("dp", start - led.free)  # grad_sync is the data-parallel reduction
        end = led.run(start, costs.optimizer)
        self.events.append(Event(s, "compute", "optimizer", "optimizer", -1, -1, start, end))

    def _grad_sync(self, s: int, cost: TaskCost, led: _Ledger) -> float:
        if cost.duration_us <= 0:
            return led.free
        if self.options.overlap_grad_reduce and cost.comm_us:
            b_start, b_end = led.last_backward
            n, t = len(cost.comm_us), b_start
            for i, us in enumerate(cost.comm_us):
                t = max(t, b_start + (b_end - b_start) * (i + 1) / n) + us
            first = b_start + (b_end - b_start) / n
        else:
            first, t = led.free, led.free + cost.duration_us
        self.events.append(Event(s, "comm", "grad_sync", "collective", -1, -1, first, t))
        return t


def simulate(costs: Sequence[RankCosts], orders: Sequence[Sequence[Task]],
             options: EngineOptions = EngineOptions()) -> EngineResult:
    """Run every stage's task order (``orders[s]``) with the stage's task costs (``costs[s]``)."""
    if len(costs) != len(orders) or not costs:
        raise ValueError(f"{len(costs)} stage costs for {len(orders)} stage orders")
    if len({c.chunks for c in costs}) != 1:
        raise ValueError(f"stages disagree on chunks per stage: {[c.chunks for c in costs]}")
    run = _Pipeline(costs, options)
    pos = [0] * len(orders)
    progress = True
    while progress:  # each pass runs every task whose input has arrived; orders fix the rest
        progress = False
        for s, order in enumerate(orders):
            while pos[s] < len(order) and run.try_run(s, order[pos[s]]):
                pos[s] += 1
                progress = True
    stuck = [(s, order[pos[s]]) for s, order in enumerate(orders) if pos[s] < len(order)]
    if stuck:
        raise RuntimeError(f"schedule deadlocks: stage {stuck[0][0]} waits forever at {stuck[0][1]}")
    for s in range(len(costs)):
        run.finish_step(s)
    return _result(run)


def _result(run: _Pipeline) -> EngineResult:
    step = max(led.free for led in run.ledgers)
    stages = tuple(StageTimes(end_us=led.free, compute_us=led.compute,
                              exposed_us=tuple(sorted(led.exposed.items())),
                              bubble_us=led.bubble + step - led.free)  # waiting for the slowest stage
                   for led in run.ledgers)
    critical = max(range(len(stages)), key=lambda s: (stages[s].end_us, -s))
    return EngineResult(step_us=step, critical_stage=critical, stages=stages, events=tuple(run.events))
