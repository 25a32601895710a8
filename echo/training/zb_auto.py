"""The zero-bubble paper's automatic schedule (Qi et al., ICLR 2024, section 3.2) as a greedy list
schedule over the stages' own pass times.

ZB-H1 and ZB-H2 (``schedule.py``) are drawn for equal pass times. With real ones (a W that takes
half a forward, the first and last stages heavier) the paper searches each stage's order for the
times profiled: ZB-2p is its schedule under twice 1F1B's peak activation memory. Echo builds such
an order by simulating the pipeline at the pass level with the times given (``PassTimes``, from
the stage programs' clean replays) and letting every stage, each time it is free, start the
first of:

1. the B whose input gradient has arrived (it is on the critical path: the stages before wait
   for it);
2. else the next F whose activation has arrived, while the activations held stay within
   ``limit[s]`` micro-batches (a forward done and its B not yet counts one; a B done and its W
   not yet counts ``w_share``, what the W's GEMMs still read);
3. else the oldest W still owed (it fills what would be a bubble);
4. else nothing: it waits for the earliest input to arrive.

A stage never idles while it owes a W. Should every stage wait on another at its limit, the
earliest forward runs over it (a limit too tight for the pipeline is exceeded, not deadlocked). ``schedule.stage_orders("zb-2p")`` keeps the better (by
``spans``) of this order at a limit of 2 x stages on every stage and ZB-H2's, which keeps within
the same limit. With no bound on the W held back (``w_share`` 0, forwards under 2 (stages - s))
and the paper's profiled times (its Table 9) the greedy gives the bubble rates of the paper's
ZB-2p rows in its Table 5 (tests); counted at what a W really keeps (Echo's traces: about 0.94 of
a micro-batch's activations under flash attention, the paper's own model 32h / (34h + 5as)) the
bound costs part of that, and Echo's zb-2p lies between the paper's ZB-H2 and ZB-2p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo.config.workload import virtual_stage


@dataclass(frozen=True)
class PassTimes:
    """One pipeline stage's pass times, microseconds (any unit, used consistently)."""

    forward: float       # F: the chunk's forward
    input_grad: float    # B: the backward without its weight gradients
    weight_grad: float   # W: the weight-gradient GEMMs
    send: float = 0.0    # a p2p transfer to the neighbouring stage (activation or gradient)
    w_share: float = 0.0  # of a micro-batch's activations, what a W still owed keeps (its GEMMs' inputs)

    def __post_init__(self) -> None:
        if min(self.forward, self.input_grad, self.weight_grad, self.send, self.w_share) < 0:
            raise ValueError(f"pass times must be >= 0, got {self}")


def greedy_orders(times: Sequence[PassTimes], micro_batches: int, limit: Sequence[float]) -> list[list[tuple[str, int]]]:
    """Each stage's order as (kind, micro-batch) pairs, by the rules of the module docstring;
    ``limit[s]``: the activations stage s may hold, in micro-batches (a W owed counts its
    ``w_share``)."""
    p, m = len(times), micro_batches
    if len(limit) != p or min(limit) < 1:
        raise ValueError(f"one activation limit >= 1 per stage needed, got {list(limit)} for {p} stages")
    free = [0.0] * p                       # when each stage is next free
    nf, nb, nw = [0] * p, [0] * p, [0] * p  # passes started per stage
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    orders: list[list[tuple[str, int]]] = [[] for _ in range(p)]

    def options(s: int, relax: bool = False) -> list[tuple[float, int, str]]:
        """(earliest start, priority, kind) of what stage s could run next (``relax``: a forward
        over the activation limit too)."""
        out = []
        if nb[s] < nf[s]:
            k = nb[s]
            ready = f_end[(s, k)] if s == p - 1 else b_end.get((s + 1, k))
            if ready is not None:
                out.append((max(free[s], ready + (0.0 if s == p - 1 else times[s + 1].send)), 0, "B"))
        held = nf[s] - nb[s] + times[s].w_share * (nb[s] - nw[s])
        if nf[s] < m and (relax or held + 1 <= limit[s] + 1e-9):
            k = nf[s]
            ready = 0.0 if s == 0 else f_end.get((s - 1, k))
            if ready is not None:
                out.append((max(free[s], ready + (0.0 if s == 0 else times[s - 1].send)), 1, "F"))
        if nw[s] < nb[s]:
            out.append((free[s], 2, "W"))
        return out

    def pick(relax: bool) -> tuple[float, int, int, str] | None:
        best: tuple[float, int, int, str] | None = None  # (start, priority, stage, kind)
        for s in range(p):
            opts = options(s, relax)
            if not opts:
                continue
            now = [o for o in opts if o[0] <= free[s]]  # what can start at once, by priority
            start, prio, kind = min(now, key=lambda o: o[1]) if now else min(opts)
            if best is None or (start, prio, s) < best[:3]:
                best = (start, prio, s, kind)
        return best

    for _ in range(3 * m * p):
        # every stage at its limit and waiting on another: the earliest forward goes over it
        best = pick(False) or pick(True)
        if best is None:
            raise RuntimeError("greedy schedule stuck: no stage can run (an activation limit below 1?)")
        start, _, s, kind = best
        t = times[s]
        if kind == "F":
            f_end[(s, nf[s])] = free[s] = start + t.forward
            orders[s].append(("F", nf[s]))
            nf[s] += 1
        elif kind == "B":
            b_end[(s, nb[s])] = free[s] = start + t.input_grad
            orders[s].append(("B", nb[s]))
            nb[s] += 1
        else:
            free[s] = start + t.weight_grad
            orders[s].append(("W", nw[s]))
            nw[s] += 1
    return orders


def pass_plan(orders: Sequence[Sequence[tuple[str, int, int]]], times: Sequence[Sequence[PassTimes]],
              placement: str = "interleaved") -> dict[tuple[int, int], tuple[float, float]]:
    """(stage, position) -> (start, end) of every pass of ``orders`` ((kind, micro-batch, chunk)
    per stage) replayed at the pass level: after its input (plus the producing stage's transfer
    time when it comes from another stage) and after its stage's previous pass; no optimizer
    synchronization. The zero-bubble runtime's plan (``zb_comm``), the clock of the paper's bubble rates (``spans``,
    ``zb_v.v_bubble_rate``)."""
    p, chunks = len(orders), len(times[0])
    last = p * chunks - 1
    where = {virtual_stage(placement, p, c, s): (s, c) for s in range(p) for c in range(chunks)}
    end: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    out: dict[tuple[int, int], tuple[float, float]] = {}
    free, pos = [0.0] * p, [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, mb, chunk = orders[s][pos[s]]
                k = virtual_stage(placement, p, chunk, s)
                src = _source(kind, k, mb, last)
                if src is not None and src not in end:
                    break
                ready = 0.0
                if src is not None:
                    rank, c = where[src[1]]
                    ready = end[src] + (times[rank][c].send if rank != s else 0.0)
                start = max(free[s], ready)
                t = times[s][chunk]
                free[s] = end[(kind, k, mb)] = start + {"F": t.forward, "B": t.input_grad, "W": t.weight_grad}[kind]
                out[(s, pos[s])] = (start, free[s])
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline orders deadlock at the pass level")
    return out


def _source(kind: str, k: int, mb: int, last: int) -> tuple[str, int, int] | None:
    """The pass whose output ``kind`` of micro-batch ``mb`` at virtual stage ``k`` takes."""
    if kind == "F":
        return ("F", k - 1, mb) if k > 0 else None
    if kind == "B":
        return ("F", k, mb) if k == last else ("B", k + 1, mb)
    return ("B", k, mb)  # W: its own B, on its own stage


def spans(times: Sequence[PassTimes], orders: Sequence[Sequence[tuple[str, int]]]) -> list[float]:
    """Each stage's span, from its first pass to its last, the orders replayed at the pass level
    (``pass_plan``; no optimizer synchronization: post-validation)."""
    plan = pass_plan([[(kind, mb, 0) for kind, mb in o] for o in orders], [[t] for t in times])
    return [plan[(s, len(o) - 1)][1] - plan[(s, 0)][0] for s, o in enumerate(orders)]


def bubble_rate(times: Sequence[PassTimes], orders: Sequence[Sequence[tuple[str, int]]]) -> float:
    """1 - (work of the busiest stage) / (the longest stage span), at the pass level."""
    work = max(len(o) / 3 * (t.forward + t.input_grad + t.weight_grad) for o, t in zip(orders, times, strict=True))
    return 1.0 - work / max(spans(times, orders))
