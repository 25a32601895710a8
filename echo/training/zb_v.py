"""ZB-V (Qi et al., ICLR 2024, section 6) built the way its authors' runtime builds it.

Each pipeline rank holds two chunks in a V (rank s: virtual stages s and 2p - 1 - s), and the
order of every rank's passes comes from a heuristic that the zero-bubble runtime
(sail-sg/zero-bubble-pipeline-parallelism, ``scheduler/zbv.py``) runs over the mean profiled pass
times: it lays the passes out one by one on a pass-level clock, each rank bounded by 1F1B's peak
activations, and fills each rank's waits with the weight-gradient passes (W) it owes. That order
is what the paper's ZB-V rows ran, so Echo uses it: on the paper's own pass times (its Table 9,
scaled to each setting's chunks) it gives the ZB-V bubble rates of the paper's Table 8 within a
point (``tests/test_zero_bubble.py``); a greedy list schedule of Echo's own, used before, left
3-5 points more bubble on the same times, which is why Echo under-predicted every ZB-V row.

The heuristic, in the runtime's order:

1. warm-up: every rank runs its first chunk's forward of micro-batch 0; then, from the last rank
   back to the first, a rank runs more first-chunk forwards (together with the ranks before it)
   while they end before its second chunk's input can arrive and its memory allows, then its
   second chunk's forward; then ranks catch up with the forwards of the rank before them;
2. steady state, 2m rounds of: a backward (B) per rank (the second chunk's, nearer the loss,
   where its input has arrived), then a forward per rank (the second chunk's where its input has
   arrived, else the first's). Before either, a rank runs the Ws it owes while they end before
   the pass' input arrives, and one more where its wait would exceed the largest bubble any rank
   has taken so far (always before a first-chunk B; before the others when the variant says so);
3. the Ws still owed.

Four variants (fill before second-chunk Bs or not, before forwards or not) are built and each is
rebuilt while the ranks' bubbles can be balanced further (each rank allowed the bubble the worst
rank took); the smallest worst bubble wins. The runtime counts memory per pass with one figure
for every chunk (a forward adds a micro-batch's activations, its B frees all but what the W
reads, the W the rest); Echo gives that share from the trace (``PassTimes.w_share``, the mean over
chunks) where the runtime estimates it as 32h / (34h + 5as); the bound, 1F1B's peak (2p chunks'
activations), is the same, and on the paper's settings it does not bind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from echo.training.zb_auto import PassTimes, pass_plan

F, B, W = 0, 1, 2
KINDS = "FBW"


class _VLayout:
    """One build of the heuristic (see the module docstring) for ``p`` ranks and ``m`` micro-batches.

    Inside, chunk 0 of F runs down the V (rank 0 to p - 1) and chunk 1 back up; B runs the other
    way: its chunk 0 is the backward of the second forward chunk (from rank 0, where the loss is),
    its chunk 1 that of the first. A W carries its B's chunk."""

    def __init__(self, p: int, m: int, cost: tuple[float, float, float], comm: float,
                 mem: tuple[float, float, float], limit: float, fill_f: bool, fill_b: bool,
                 allowed: Sequence[float] | None = None):
        self.p, self.m, self.cost, self.comm, self.mem, self.limit = p, m, cost, comm, mem, limit
        self.fill_f, self.fill_b = fill_f, fill_b
        self.allowed = list(allowed) if allowed is not None else [-1.0] * p  # a rank's bubble, by an earlier build
        self.count = [[0] * 6 for _ in range(p)]  # passes done, by kind * 2 + chunk
        self.end: dict[tuple[int, int, int, int], float] = {}  # (kind, chunk, rank, micro-batch) -> end
        self.clock = [0.0] * p
        self.held = [0.0] * p
        self.bubble = [0.0] * p
        self.owed: list[deque[int]] = [deque() for _ in range(p)]
        self.orders: list[list[tuple[int, int, int]]] = [[] for _ in range(p)]

    def worst(self, rank: int = -1) -> float:
        """The largest bubble any rank has taken; for ``rank``, at least what the earlier build
        allowed it beyond its own."""
        b = max(self.bubble)
        return max(b, max(self.allowed) - self.allowed[rank]) if rank >= 0 else b

    def source(self, kind: int, chunk: int, rank: int, mb: int) -> tuple[int, int, int, int] | None:
        """The pass on the neighbouring rank whose output this one needs (None: W, and the V's turns)."""
        if kind == W:
            return None
        if chunk == 1 and rank < self.p - 1:
            return kind, chunk, rank + 1, mb
        if chunk == 0 and rank > 0:
            return kind, chunk, rank - 1, mb
        return None

    def done(self, kind: int, chunk: int, rank: int, mb: int) -> bool:
        return (kind, chunk, rank, mb) in self.end

    def put(self, kind: int, chunk: int, rank: int) -> None:
        mb = self.count[rank][kind * 2 + chunk]
        if mb >= self.m or self.held[rank] + self.mem[kind] > self.limit + 1e-9:
            raise RuntimeError(f"ZB-V build: {KINDS[kind]}{chunk} of micro-batch {mb} on rank {rank} "
                               f"exceeds the micro-batches or the memory bound")
        free = self.clock[rank] + self.cost[kind]
        t = free
        src = self.source(kind, chunk, rank, mb)
        if src is not None:
            t = max(t, self.end[src] + self.comm + self.cost[kind])
        if self.count[rank][0] > 0:  # a rank's wait for its very first input is not a bubble
            self.bubble[rank] += t - free
        self.end[(kind, chunk, rank, mb)] = self.clock[rank] = t
        self.held[rank] += self.mem[kind]
        self.orders[rank].append((kind, chunk, mb))
        if kind == B:
            self.owed[rank].append(chunk)
        self.count[rank][kind * 2 + chunk] += 1

    def put_w(self, rank: int) -> None:
        self.put(W, self.owed[rank].popleft(), rank)

    def fill(self, rank: int, src: tuple | None, extra: bool) -> None:
        """Before a pass that waits on ``src``: the Ws owed that end before its input arrives,
        and one more (``extra``) where the wait would be larger than the worst bubble allows."""
        arrives = self.end[src] + self.comm if src is not None and src in self.end else None
        while self.owed[rank] and arrives is not None and arrives >= self.clock[rank] + self.cost[W]:
            self.put_w(rank)
        if self.owed[rank] and extra and arrives is not None and \
                arrives - self.clock[rank] > self.worst(rank) - self.bubble[rank]:
            self.put_w(rank)

    def warm_up(self) -> None:
        p, count = self.p, self.count
        for i in range(p):
            self.put(F, 0, i)
        for i in range(p - 1, -1, -1):
            if i < p - 1:
                turn = self.end[(F, 1, i + 1, 0)] + self.comm
                # first-chunk forwards that end before the second chunk's input can arrive (the
                # ranks before keep ahead), within what the V between them may hold
                while self.held[i] + self.mem[F] * (2 + 2 * i) <= self.limit and \
                        self.clock[i] + self.cost[F] <= turn and count[i][0] < self.m:
                    for j in range(i + 1):
                        self.put(F, 0, j)
            self.put(F, 1, i)
        chunk = 0
        for i in range(1, p):  # each rank catches up with the forwards of the rank before it
            while count[i][0] + count[i][1] < count[i - 1][0] + count[i - 1][1] or \
                    count[i][1] <= count[i - 1][1] < self.m:
                for j in range(p - 1, i - 1, -1):
                    if count[j][chunk] < self.m:
                        self.put(F, chunk, j)
                chunk = 1 - chunk

    def steady(self) -> None:
        p, count = self.p, self.count
        for _ in range(2 * self.m):
            for i in range(p):
                while self.held[i] + self.mem[B] > self.limit:
                    self.put_w(i)
            near, far = [], []  # ranks whose next B is the first chunk's / the second chunk's
            for i in range(p):
                if count[i][3] < count[i][2] and (i == p - 1 or self.done(B, 1, i + 1, count[i][3])
                                                   or count[i][2] >= self.m):
                    near.append(i)
                else:
                    far.append(i)
            for i, chunk in [(i, 1) for i in reversed(near)] + [(i, 0) for i in far]:
                self.fill(i, self.source(B, chunk, i, count[i][2 + chunk]), chunk == 1 or self.fill_b)
                self.put(B, chunk, i)
            for i in range(p):
                chunk = self._next_forward(i)
                if chunk is None:
                    continue
                while self.held[i] + self.mem[F] > self.limit:
                    self.put_w(i)
                self.fill(i, self.source(F, chunk, i, count[i][chunk]), self.fill_f)
                self.put(F, chunk, i)

    def _next_forward(self, i: int) -> int | None:
        """The chunk whose forward rank ``i`` runs next (the second's when its input is there),
        or None."""
        count = self.count[i]
        if count[1] >= self.m:
            return None
        if count[1] >= count[0]:
            return 0
        if i == self.p - 1 or self.done(F, 1, i + 1, count[1]):
            return 1
        if count[0] < self.m and (i == 0 or self.done(F, 0, i - 1, count[0])):
            return 0
        return None

    def build(self) -> _VLayout:
        self.warm_up()
        self.steady()
        for i in range(self.p):
            while self.owed[i]:
                self.put_w(i)
        return self


def _balanced(p, m, cost, comm, mem, limit, fill_f, fill_b) -> _VLayout:
    """A variant rebuilt while giving each rank the bubble of the worst one lowers the worst."""
    best = _VLayout(p, m, cost, comm, mem, limit, fill_f, fill_b).build()
    while True:
        again = _VLayout(p, m, cost, comm, mem, limit, fill_f, fill_b, best.bubble).build()
        if again.worst() >= best.worst():
            return best
        best = again


def v_orders(times: Sequence[Sequence[PassTimes]], micro_batches: int) -> list[list[tuple[str, int, int]]]:
    """Every rank's ZB-V order as (kind, micro-batch, chunk) triples, chunk 0 being virtual stage
    s of rank s and chunk 1 virtual stage 2p - 1 - s; ``times[s][c]``: rank s's chunk c passes (the
    heuristic uses their means, as the runtime does with its profile)."""
    p, m = len(times), micro_batches
    if p < 2 or m < 1 or any(len(t) != 2 for t in times):
        raise ValueError(f"ZB-V needs two chunks on each of two or more ranks and a micro-batch, got {p} ranks, "
                         f"{m} micro-batches")
    flat = [t for per in times for t in per]
    mean = lambda f: sum(f(t) for t in flat) / len(flat)  # noqa: E731
    cost = (mean(lambda t: t.forward), mean(lambda t: t.input_grad), mean(lambda t: t.weight_grad))
    share = mean(lambda t: t.w_share)
    # a forward holds a micro-batch's chunk activations; its B frees all but what the W reads
    mem = (1.0, share - 1.0, -share)
    builds = [_balanced(p, m, cost, mean(lambda t: t.send), mem, 2.0 * p, fill_f, fill_b)
              for fill_b in (True, False) for fill_f in (True, False)]
    best = min(builds, key=lambda b: b.worst())  # the first of equals, as the runtime keeps it
    # inside, B and W count chunks from the loss; outside, chunk 0 is virtual stage s
    return [[(KINDS[k], mb, c if k == F else 1 - c) for k, c, mb in order] for order in best.orders]


def v_bubble_rate(times: Sequence[Sequence[PassTimes]], orders: Sequence[Sequence[tuple[str, int, int]]]) -> float:
    """1 - (work of the busiest rank) / (the longest rank's span from its first pass to its last),
    the orders replayed at the pass level (``zb_auto.pass_plan``: each pass after its input and its
    rank's previous pass; no optimizer synchronization): the paper's bubble rate."""
    plan = pass_plan(orders, times, "v")
    work = max(sum({"F": t.forward, "B": t.input_grad, "W": t.weight_grad}[kind]
                   for kind, _, c in o for t in (times[s][c],)) for s, o in enumerate(orders))
    return 1.0 - work / max(plan[(s, len(o) - 1)][1] - plan[(s, 0)][0] for s, o in enumerate(orders))
