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
    activation: float = 1.0  # a chunk's activations against its stage's mean chunk (memory units; ZB-V)

    def __post_init__(self) -> None:
        if min(self.forward, self.input_grad, self.weight_grad, self.send, self.w_share, self.activation) < 0:
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


def greedy_v_orders(times: Sequence[Sequence[PassTimes]], micro_batches: int,
                    limit: Sequence[float]) -> list[list[tuple[str, int, int]]]:
    """ZB-V's orders (Qi et al., section 6) as (kind, micro-batch, chunk) triples: two chunks per
    stage in a V (stage s holds virtual stages s and 2p - 1 - s; ``times[s][c]`` their passes),
    by the rules of the module docstring at chunk level: B first (the one whose input came first,
    the second chunk's on a tie: it is nearer the loss), then F while the activations held stay
    within ``limit[s]`` chunk-micro-batches (each chunk counting its ``activation``: the first
    stage's embedding-only chunk next to nothing; the second chunk's first, which brings the next B
    sooner; the first chunk at most 2 (p - s) - 1 micro-batches ahead of the second, what the V
    between them holds), then the oldest W owed."""
    p, m = len(times), micro_batches
    if len(limit) != p or min(limit) < 1:
        raise ValueError(f"one activation limit >= 1 per stage needed, got {list(limit)} for {p} stages")
    last = 2 * p - 1

    def place(k: int) -> tuple[int, int]:  # virtual stage -> (stage, chunk)
        return (k, 0) if k < p else (last - k, 1)

    def vstage(s: int, c: int) -> int:
        return virtual_stage("v", p, c, s)

    free = [0.0] * p
    nf = [[0, 0] for _ in range(p)]
    nb = [[0, 0] for _ in range(p)]
    owed: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (chunk, micro-batch) whose W is owed
    held = [0.0] * p
    f_end: dict[tuple[int, int], float] = {}  # (virtual stage, micro-batch) -> end
    b_end: dict[tuple[int, int], float] = {}
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]

    def arrival(done: dict, k: int, mb: int, s: int) -> float | None:
        end = done.get((k, mb))
        if end is None:
            return None
        src = place(k)[0]
        return end + (0.0 if src == s else times[src][place(k)[1]].send)

    def options(s: int, relax: bool = False) -> list[tuple[float, int, int, str, int]]:
        out = []  # (start, priority, tie, kind, chunk)
        for c in (1, 0):
            k, mb = vstage(s, c), nb[s][c]
            if mb < nf[s][c]:
                ready = f_end.get((k, mb)) if k == last else arrival(b_end, k + 1, mb, s)
                if ready is not None:
                    out.append((max(free[s], ready), 0, 1 - c, "B", c))
        for c in (1, 0):
            k, mb = vstage(s, c), nf[s][c]
            # the first chunk runs ahead of the second by no more than the V between them holds
            # (2 (p - s) - 1 virtual stages): more only fills memory the second chunk then lacks
            ahead = c == 1 or nf[s][0] - nf[s][1] < 2 * (p - s) - 1
            if mb < m and ahead and (relax or held[s] + times[s][c].activation <= limit[s] + 1e-9):
                ready = 0.0 if k == 0 else arrival(f_end, k - 1, mb, s)
                if ready is not None:
                    out.append((max(free[s], ready), 1, 1 - c, "F", c))
        if owed[s]:
            out.append((free[s], 2, 0, "W", owed[s][0][0]))
        return out

    def pick(relax: bool):
        best = None
        for s in range(p):
            opts = options(s, relax)
            if not opts:
                continue
            now = [o for o in opts if o[0] <= free[s]]
            o = min(now, key=lambda o: o[1:3]) if now else min(opts)
            if best is None or (o[0], o[1], s) < (best[0][0], best[0][1], best[1]):
                best = (o, s)
        return best

    for _ in range(6 * m * p):
        # every stage at its limit and waiting on another: the earliest forward goes over it
        best = pick(False) or pick(True)
        if best is None:
            raise RuntimeError("greedy ZB-V schedule stuck: no stage can run")
        (start, _, _, kind, c), s = best
        t = times[s][c]
        if kind == "F":
            mb = nf[s][c]
            f_end[(vstage(s, c), mb)] = free[s] = start + t.forward
            nf[s][c] += 1
            held[s] += t.activation
        elif kind == "B":
            mb = nb[s][c]
            b_end[(vstage(s, c), mb)] = free[s] = start + t.input_grad
            nb[s][c] += 1
            held[s] += t.activation * (t.w_share - 1)
            owed[s].append((c, mb))
        else:
            c, mb = owed[s].pop(0)
            free[s] = start + times[s][c].weight_grad
            held[s] -= times[s][c].activation * times[s][c].w_share
        orders[s].append((kind, mb, c))
    return orders


def spans(times: Sequence[PassTimes], orders: Sequence[Sequence[tuple[str, int]]]) -> list[float]:
    """Each stage's span, from its first pass to its last, the orders replayed at the pass level
    (no optimizer synchronization: post-validation)."""
    p = len(times)
    free, first = [0.0] * p, [0.0] * p
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    pos = [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, k = orders[s][pos[s]]
                t = times[s]
                if kind == "F":
                    ready = 0.0 if s == 0 else f_end.get((s - 1, k))
                    ready = None if ready is None else ready + (0.0 if s == 0 else times[s - 1].send)
                elif kind == "B":
                    ready = f_end.get((s, k)) if s == p - 1 else b_end.get((s + 1, k))
                    ready = None if ready is None else ready + (0.0 if s == p - 1 else times[s + 1].send)
                else:
                    ready = free[s]
                if ready is None:
                    break
                start = max(free[s], ready)
                if pos[s] == 0:
                    first[s] = start
                free[s] = start + {"F": t.forward, "B": t.input_grad, "W": t.weight_grad}[kind]
                if kind == "F":
                    f_end[(s, k)] = free[s]
                elif kind == "B":
                    b_end[(s, k)] = free[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("orders deadlock")
    return [free[s] - first[s] for s in range(p)]


def bubble_rate(times: Sequence[PassTimes], orders: Sequence[Sequence[tuple[str, int]]]) -> float:
    """1 - (work of the busiest stage) / (the longest stage span), at the pass level."""
    work = max(len(o) / 3 * (t.forward + t.input_grad + t.weight_grad) for o, t in zip(orders, times, strict=True))
    return 1.0 - work / max(spans(times, orders))
