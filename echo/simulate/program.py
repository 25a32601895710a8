"""Op level: a task's program (the op graph of a chunk's pass) and its replay on a device.

A rank's trace holds one forward and one backward per chunk (a per-micro-batch template), the
data-parallel gradient reduction (grad_sync) and the optimizer step. Each becomes a ``Program``
of ``Op``s, their durations already priced (costing.py), that both engines replay op by op on a
device (``gpu.Gpu``):

- compute and memcpy ops run one after another on the compute stream (kernel times from
  kernels.parquet), slowed while a transfer of the device is in flight (overlap slowdown);
- blocking collectives (TP) hold the compute stream for their network time; in the full engine
  they start when the last member of the group arrives;
- non-blocking collectives queue on the comm stream once issued, overlapping compute; the compute
  stream waits where an op consumes their result (deps.parquet) and at the end of the task, and
  that wait is the exposed part;
- a p2p recv holds the compute stream until its data has arrived; a p2p send is queued on the
  device's p2p stream of its direction and overlaps what follows.

- every op is first launched by the device's host thread (``Gpu.host``, its clock): the host
  spends ``host_us`` per op and runs ahead of the GPU, so an op cannot start before its launch;
  at a ``host_sync`` op the host first waits for the GPU to reach it (a device-to-host copy
  the host reads, such as an MoE dispatcher's token counts), which empties the queue.

Every microsecond the compute stream is not computing is attributed to what it waited for
(a collective kind, the host's launches: host, or the pipeline: pp if a transfer was in flight,
else bubble), so a task's end - start = compute + exposed + bubble holds exactly.

A program's replay on an idle device from time 0 with a host far ahead (``Program.cost``) is
computed once; the symmetric engine shifts it whenever nothing of the device overlaps the task
and the host keeps ahead of it up to the task's first host sync, and jumps over the rest of a
task from a point where the device is idle in both replays and no receive follows (on the same
host condition from there); the transfers of the part taken from the clean replay are put back
on the device as it made them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from echo.simulate.gpu import Flow, Gpu, max_min_share
from echo.simulate.kernel_runs import KernelRuns

COMPUTE_KINDS = ("compute", "memcpy")
COMPUTE, BLOCKING, ASYNC, SEND, RECV = range(5)


@dataclass(frozen=True)
class Op:
    """One recorded op, reduced to what the replay needs."""

    seq: int
    kind: str              # compute | memcpy | collective | p2p
    stream: str            # compute | comm | p2p_fwd | p2p_bwd (p2p: a send's queue)
    duration_us: float     # kernel time, or network time of a collective / transfer
    blocking: bool = False
    comm_kind: str = ""    # group kind of a collective (tp, dp, pp, cp, ep, world)
    flops: float = 0.0
    recompute: bool = False
    slowdown: float = 0.0  # s of a compute op's class: speed 1 / (1 + s) beside a transfer
    op: str = ""           # collective or p2p op (all_reduce, ..., send, recv)
    group: tuple[int, ...] = ()  # global ranks (p2p: the two ends)
    peer: int = -1         # p2p peer's global rank
    link: str = "nic"      # nic (group spans nodes) | nvlink
    nbytes: int = 0
    carry: bool = False    # a gradient bucket moved into the last backward: the task does not drain it
    latency_us: float = 0.0  # of duration_us, the part that uses no bandwidth (network model)
    loads: tuple[tuple[tuple, float], ...] = ()  # links it loads and how much (network model)
    op_class: str = ""     # a compute op's class (gemm, attention, ...: ops.op_class)
    slowed_us: float = 0.0  # of a compute op's duration_us, overlap slowdown already included (TP overlap)
    api: str = "c10d"      # a collective's calling API: c10d | functional (DTensor's; network model api_overheads)
    host_us: float = 0.0   # host time to launch it (Hardware.host.launch_us; 0: no launch model)
    host_sync: bool = False  # the host waits for the GPU to reach it before launching it

    @cached_property
    def flow(self) -> Flow:
        """The transfer as link sharing sees it; without the network model's figures it fills
        its device's link of its class (nic or nvlink)."""
        return Flow(self.latency_us, max(self.duration_us - self.latency_us, 0.0),
                    self.loads or (((self.link, "tx"), 1.0),))

    @cached_property
    def code(self) -> int:
        if self.kind in COMPUTE_KINDS:
            return COMPUTE
        if self.kind == "p2p":
            return RECV if self.op == "recv" else SEND
        return BLOCKING if self.blocking else ASYNC


@dataclass(frozen=True)
class TaskCost:
    """A task replayed on an idle device from time 0: what it costs its stage."""

    duration_us: float = 0.0
    compute_us: float = 0.0
    exposed_us: tuple[tuple[str, float], ...] = ()  # (group kind, us the compute stream waited on it)
    flops: float = 0.0              # matmul-class FLOPs executed, recomputation included
    recompute_flops: float = 0.0
    comm_us: tuple[float, ...] = ()  # non-blocking collectives' network times, in issue order
    slowdown_us: float = 0.0        # of compute_us, what the overlap slowdown added
    sends: tuple[tuple[float, float], ...] = ()  # p2p sends' (start, end)

    def exposed(self, kind: str) -> float:
        return sum(us for k, us in self.exposed_us if k == kind)


@dataclass
class Run:
    """One replay of a program on a device."""

    start: float
    end: float = 0.0
    begin: float = -1.0     # when the task got past its leading recvs (its first other op)
    compute_us: float = 0.0
    slowdown_us: float = 0.0
    bubble_us: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    sends: list[tuple[float, float, Op]] = field(default_factory=list)
    flows: list[tuple[float, float, Op]] = field(default_factory=list)   # non-blocking collectives
    colls: list[tuple[float, float, Op]] = field(default_factory=list)   # blocking collectives (full mode)

    def expose(self, kind: str, us: float) -> None:
        if us > 0:
            self.exposed[kind] = self.exposed.get(kind, 0.0) + us


class Program:
    """One task's ops, compiled for replay, with its clean replay (idle device, time 0)."""

    __slots__ = ("ops", "waits", "steps", "recvs", "recv_first", "_cost", "_at", "_jump", "_jump_plain", "_cum", "_kinds",
                 "flops", "recompute_flops", "send_ops", "_send_at", "hosted", "_ch", "_host_ok",
                 "_host_room", "_synced", "_host_end", "runs", "_xfers")

    def __init__(self, ops: Iterable[Op] = (), waits: Mapping[int, Sequence[int]] | None = None):
        self.ops = tuple(ops)
        seqs = {op.seq for op in self.ops if op.code == ASYNC}
        self.waits = {dst: tuple(s for s in srcs if s in seqs) for dst, srcs in (waits or {}).items()
                      if any(s in seqs for s in srcs)}
        self.steps = [(op.code, op.duration_us, op.slowdown, op, op.flow if op.code in (ASYNC, SEND) else None)
                      for op in self.ops]
        codes = [s[0] for s in self.steps]
        self.recvs = codes.count(RECV)
        first_other = next((i for i, c in enumerate(codes) if c != RECV), len(codes))
        self.recv_first = RECV not in codes[first_other:]
        self.send_ops = tuple(op for op in self.ops if op.code == SEND)
        self._send_at = tuple(i for i, c in enumerate(codes) if c == SEND)
        self.hosted = any(op.host_us > 0 or op.host_sync for op in self.ops)
        ch = [0.0]
        for op in self.ops:
            ch.append(ch[-1] + op.host_us)
        self._ch = ch  # host time of the ops before each index
        self.runs = KernelRuns.of(self.steps, self.waits, ch, COMPUTE)
        self.flops = sum(op.flops for op in self.ops)
        self.recompute_flops = sum(op.flops for op in self.ops if op.recompute)
        self._cost: TaskCost | None = None  # the clean replay, made on first use (``clean``)

    @property
    def cost(self) -> TaskCost:
        """The task replayed on an idle device from time 0 (what it costs its stage)."""
        return self.clean()

    def clean(self) -> TaskCost:
        """The clean replay, computed once on first use: many programs built (a class's, before it
        is relabelled to the stages it spans) are never replayed."""
        if self._cost is None:
            self._clean()
        return self._cost

    def _clean(self) -> None:
        """Replay on an idle device; keep, per op, its start and whether the suffix from it can be
        jumped over (device idle there, no recv or non-blocking collective from there on)."""
        n = len(self.steps)
        gpu = Gpu()
        gpu.host = float("-inf")  # the host far ahead: it waits for nothing until a sync
        at, idle = [0.0] * (n + 1), [False] * (n + 1)
        kinds = sorted({op.comm_kind for op in self.ops if op.code in (BLOCKING, ASYNC)} |
                       ({"host"} if self.hosted else set()))
        cum = {k: [0.0] * (n + 1) for k in ("compute", "slowdown", *kinds)}
        probe: list = []
        run = _replay(self, gpu, 0.0, [(0.0, 0.0)] * self.recvs, probe=probe)
        hosts = [p[5] for p in probe] + [gpu.host]
        for i, (t, was_idle, compute, slow, exposed, _) in enumerate(probe):
            at[i], idle[i] = t, was_idle
            cum["compute"][i], cum["slowdown"][i] = compute, slow
            for k in kinds:
                cum[k][i] = exposed.get(k, 0.0)
        at[n], idle[n] = run.end, True
        cum["compute"][n], cum["slowdown"][n] = run.compute_us, run.slowdown_us
        for k in kinds:
            cum[k][n] = run.exposed.get(k, 0.0)
        no_recv, plain = [True] * (n + 1), [True] * (n + 1)
        for i in range(n - 1, -1, -1):
            no_recv[i] = no_recv[i + 1] and self.steps[i][0] != RECV
            plain[i] = plain[i + 1] and self.steps[i][0] not in (RECV, ASYNC)
        self._at, self._cum, self._kinds = at, cum, kinds
        # where the rest can be taken from the clean replay: idle there, no recv after (its
        # transfers put back as the clean replay made them: ``_jump``); ``_jump_plain``: nor a
        # non-blocking collective after, for a device sharing its links otherwise (sends re-shared)
        self._jump = [idle[i] and no_recv[i] for i in range(n + 1)]
        self._jump_plain = [idle[i] and plain[i] for i in range(n + 1)]
        self._host_end = gpu.host
        self._host_clean(at, hosts, cum.get("host"))
        # the transfers it issued, in issue order ((op index, start, end, op, stream, whether a
        # send)): what a shifted clean replay puts on the device (``replay``, ``_jump``)
        where = {id(op): i for i, op in enumerate(self.ops)}
        self._xfers = tuple(sorted([(where[id(op)], a, b, op, "comm", False) for a, b, op in run.flows] +
                                   [(where[id(op)], a, b, op, op.stream, True) for a, b, op in run.sends]))
        self._cost = TaskCost(duration_us=run.end, compute_us=run.compute_us,
                             exposed_us=tuple(sorted(run.exposed.items())), flops=self.flops,
                             recompute_flops=self.recompute_flops,
                             comm_us=tuple(op.duration_us for op in self.ops if op.code == ASYNC),
                             slowdown_us=run.slowdown_us, sends=tuple((a, b) for a, b, _ in run.sends))

    def _host_clean(self, at: list[float], hosts: list[float], waited: list[float] | None) -> None:
        """When the clean replay from op i holds for a host at a given clock (``host_fits``): the
        host launches every op from i up to the next sync no later than the shifted clean replay
        starts it, and the clean replay itself waited for no launch there (so both run alike up to
        the sync, where the host catches up with the GPU in both)."""
        n, ch = len(self.steps), self._ch
        room, ok, synced = [float("inf")] * (n + 1), [True] * (n + 1), [False] * (n + 1)
        for i in range(n - 1, -1, -1):
            op = self.steps[i][3]
            if op.host_sync:
                room[i], ok[i], synced[i] = at[i] - ch[i], hosts[i] <= at[i], True
            else:
                room[i] = min(at[i] - ch[i + 1], room[i + 1])
                ok[i] = ok[i + 1] and (waited is None or waited[i + 1] <= waited[i])
                synced[i] = synced[i + 1]
        self._host_room, self._host_ok, self._synced = room, ok, synced

    def host_fits(self, i: int, host: float, shift: float) -> bool:
        """Whether the clean replay from op i, shifted by ``shift``, is the replay with the host's
        clock at ``host`` there (see ``_host_clean``)."""
        return not self.hosted or (self._host_ok[i] and host - shift - self._ch[i] <= self._host_room[i])

    def host_after(self, i: int, host: float, shift: float) -> float:
        """The host's clock at the end of the shifted clean replay from op i (``host_fits``)."""
        if not self.hosted:
            return host
        return self._host_end + shift if self._synced[i] else host + self._ch[-1] - self._ch[i]

    def __len__(self) -> int:
        return len(self.ops)


def _replay(prog: Program, gpu: Gpu, start: float, recvs: Sequence[tuple[float, float]],
            probe: list | None = None, drain: tuple[str, str] | None = None) -> Run:
    """Replay ``prog`` on ``gpu`` from ``start`` in symmetric mode: every member of a collective
    is alike, so it starts when this device is ready. ``recvs``: (transfer start, arrival) of each
    recv in order. ``drain``: (stream, kind) the task also waits for at its end (the comm stream,
    when gradient buckets were carried out of the last backward). ``probe``: filled with the
    state before each op (the clean replay)."""
    gen = replay_steps(prog, gpu, start, recvs=recvs, probe=probe, drain=drain)
    try:
        request = next(gen)
    except StopIteration as done:
        return done.value
    raise RuntimeError(f"symmetric replay cannot serve {request[0]}")  # pragma: no cover


def replay_steps(prog: Program, gpu: Gpu, start: float, *, recvs: Sequence[tuple[float, float]] | None = None,
                 probe: list | None = None, drain: tuple[str, str] | None = None):
    """The op semantics of both engines, as a generator returning the ``Run``.

    With ``recvs`` given (symmetric mode) it never yields. Without (full mode) it yields, and
    expects back: ``("coll", op, arrive)`` -> the collective's start (the last member's arrival);
    ``("async", op, ready)`` -> (start, end), the engine having recorded the transfer on every
    member's device; ``("send", op, (start, end))`` -> None; ``("recv", op)`` -> (transfer start,
    arrival) of the matching send."""
    full = recvs is None
    run = Run(start)
    t = start
    ends: dict[int, tuple[float, str]] = {}
    drain_end, drain_kind = start, ""
    ri = 0
    waits = prog.waits
    steps = prog.steps
    jump = None
    if probe is None and not full:  # the jump reads the clean replay, made with max-min sharing
        prog.clean()
        jump = prog._jump if gpu.sharing is max_min_share else prog._jump_plain
    runs = prog.runs if probe is None else None  # the clean replay probes every op
    n = len(steps)
    i = 0
    hosted = prog.hosted
    while i < n:
        if jump is not None and jump[i] and t >= drain_end and gpu.idle_after(t) and \
                prog.host_fits(i, gpu.host, t - prog._at[i]):
            _jump(prog, run, gpu, i, t)
            return _finish(run, gpu, drain)
        if runs is not None and (j := runs.end[i]) > i + 1 and (not hosted or gpu.host - t <= runs.room[i]):
            t = _kernel_run(prog, run, gpu, i, j, t)
            i = j
            continue
        code, dur, s, op, flow = steps[i]
        if run.begin < 0 and code != RECV:
            run.begin = t
        if probe is not None:
            probe.append((t, gpu.idle_after(t), run.compute_us, run.slowdown_us, dict(run.exposed), gpu.host))
        i += 1
        if hosted:
            t = _launch(gpu, op, t, run)
        if op.seq in waits:
            ready, why = max((ends.get(src, (0.0, "")) for src in waits[op.seq]), key=lambda e: e[0])
            if ready > t:
                run.expose(why, ready - t)
                t = ready
        if code == COMPUTE:
            end = gpu.stretch(t, dur, s)
            run.compute_us += end - t
            if end - t > dur:
                run.slowdown_us += end - t - dur
            if op.slowed_us:
                run.slowdown_us += op.slowed_us
            t = end
        elif code == BLOCKING:
            if op.stream == "comm":
                free = gpu.stream_free.get("comm", 0.0)
                if free > t:
                    run.expose(op.comm_kind, free - t)
                    t = free
            begin = (yield ("coll", op, t)) if full else t
            run.expose(op.comm_kind, begin + dur - t)  # waiting for the last member, then the transfer
            if full:
                run.colls.append((begin, begin + dur, op))
            t = begin + dur
            if op.stream == "comm":
                gpu.stream_free["comm"] = t
        elif code == ASYNC:
            if full:
                a, b = yield ("async", op, gpu.ready("comm", t))
            else:
                a, b = gpu.transfer("comm", flow, t)
            ends[op.seq] = (b, op.comm_kind)
            run.flows.append((a, b, op))
            if not op.carry and b > drain_end:
                drain_end, drain_kind = b, op.comm_kind
        elif code == SEND:
            a, b = gpu.transfer(op.stream, flow, t)
            run.sends.append((a, b, op))
            if full:
                yield ("send", op, (a, b))
        else:  # RECV
            if full:
                sent, arrive = yield ("recv", op)
            else:
                sent, arrive = recvs[ri] if ri < len(recvs) else (t, t)
            ri += 1
            if arrive > t:
                pp = arrive - max(t, sent)
                run.expose("pp", pp)
                run.bubble_us += arrive - t - pp
                t = arrive
        gpu.prune(t)
    if drain_end > t:
        run.expose(drain_kind, drain_end - t)
        t = drain_end
    run.end = t
    return _finish(run, gpu, drain)


def _kernel_run(prog: Program, run: Run, gpu: Gpu, i: int, j: int, t: float) -> float:
    """Ops i..j-1, a run of kernels the host keeps ahead of, replayed at once from ``t``
    (``echo.simulate.kernel_runs``); returns the compute stream's time after them."""
    runs = prog.runs
    if run.begin < 0:
        run.begin = t
    end = gpu.stretch_run(t, runs.work, runs.slow, i, j)
    run.compute_us += end - t
    run.slowdown_us += max(end - t - (runs.work[j] - runs.work[i]), 0.0) + runs.slowed[j] - runs.slowed[i]
    if prog.hosted:
        gpu.host += prog._ch[j] - prog._ch[i]
    gpu.prune(end)
    return end


def _launch(gpu: Gpu, op: Op, t: float, run: Run) -> float:
    """The host launches ``op`` (after waiting for the GPU to reach it, at a sync); returns when the
    compute stream may go on with it, the wait charged to host."""
    gpu.host = (max(gpu.host, t) if op.host_sync else gpu.host) + op.host_us
    if gpu.host > t:
        run.expose("host", gpu.host - t)
        return gpu.host
    return t


def _jump(prog: Program, run: Run, gpu: Gpu, i: int, t: float) -> None:
    """The rest of the task from op i, taken from the clean replay (the device is idle at t and
    was idle there in the clean replay; no recv follows, nor a non-blocking collective unless the
    device shares its links max-min as the clean replay did). Idle in both, every transfer issued
    before i has ended in both, so what follows waits for none of them."""
    at, cum = prog._at, prog._cum
    shift = t - at[i]
    gpu.host = prog.host_after(i, gpu.host, shift)
    if run.begin < 0:
        run.begin = t
    run.compute_us += cum["compute"][-1] - cum["compute"][i]
    run.slowdown_us += cum["slowdown"][-1] - cum["slowdown"][i]
    for k in prog._kinds:
        run.expose(k, cum[k][-1] - cum[k][i])
    if gpu.sharing is max_min_share:  # as the clean replay shared them: the device was idle at i in both
        _put_back(prog, run, gpu, i, shift)
    else:  # _jump_plain: sends only, shared under the device's own policy
        for j in prog._send_at:
            if j >= i:
                op, flow = prog.steps[j][3], prog.steps[j][4]
                a, b = gpu.transfer(op.stream, flow, at[j] + shift)
                run.sends.append((a, b, op))
    run.end = at[-1] + shift


def _put_back(prog: Program, run: Run, gpu: Gpu, i: int, shift: float) -> None:
    """The transfers of the clean replay from op i on, shifted, on the device and in the run."""
    xfers = [(stream, op.flow, a + shift, b + shift, op, send) for j, a, b, op, stream, send in prog._xfers if j >= i]
    gpu.occupy_all([x[:4] for x in xfers])
    for _, _, a, b, op, send in xfers:
        (run.sends if send else run.flows).append((a, b, op))


def _finish(run: Run, gpu: Gpu, drain: tuple[str, str] | None) -> Run:
    if run.begin < 0:
        run.begin = run.end
    if drain is not None:
        stream, kind = drain
        free = gpu.stream_free.get(stream, 0.0)
        if free > run.end:
            run.expose(kind, free - run.end)
            run.end = free
    gpu.prune(run.end)
    return run


def replay(prog: Program, gpu: Gpu, start: float, recvs: Sequence[tuple[float, float]] = (),
           drain: tuple[str, str] | None = None) -> Run:
    """Run ``prog`` on ``gpu`` from ``start``; ``recvs``: (transfer start, arrival) of each of its
    recvs in order. Shifts the clean replay when nothing of the device overlaps the task: its
    transfers then share their links only with one another, as in the clean replay, which shared
    them max-min (a device with another sharing policy replays them)."""
    c = prog.clean() if drain is None and prog.recv_first else None
    if c is not None and (gpu.sharing is max_min_share or not prog._xfers):
        run = Run(start)
        t, host = start, gpu.host
        for j, (sent, arrive) in enumerate(recvs[:prog.recvs]):
            if prog.hosted:  # as replay_steps: the recv is launched, then its data awaited
                t = _launch(gpu, prog.steps[j][3], t, run)
            if arrive > t:
                pp = arrive - max(t, sent)
                run.expose("pp", pp)
                run.bubble_us += arrive - t - pp
                t = arrive
        first = prog.recvs  # the clean replay got past its recvs at 0
        if gpu.idle_after(t) and prog.host_fits(first, gpu.host, t - prog._at[first]):
            gpu.host = prog.host_after(first, gpu.host, t - prog._at[first])
            run.begin = t
            run.compute_us, run.slowdown_us = c.compute_us, c.slowdown_us
            for k, us in c.exposed_us:
                run.expose(k, us)
            shift = t - prog._at[first]
            _put_back(prog, run, gpu, 0, shift)
            run.end = c.duration_us + shift
            gpu.prune(run.end)
            return run
        gpu.host = host
    return _replay(prog, gpu, start, recvs, drain=drain)


def simulate_ops(ops: Iterable[Op], waits: Mapping[int, Sequence[int]] | None = None) -> TaskCost:
    """One task's ops (in seq order) replayed on an idle device from time 0."""
    return Program(ops, waits).cost


@dataclass(frozen=True)
class RankCosts:
    """One rank's (or one pipeline stage's) task programs, ready for the engines."""

    forward: tuple[Program, ...]           # per chunk
    backward: tuple[Program, ...]          # per chunk, recomputation included (B and W back to back)
    grad_sync: Program = Program()
    optimizer: Program = Program()
    input_grad: tuple[Program, ...] = ()   # per chunk, the backward without its W ops (B; (): not split)
    weight_grad: tuple[Program, ...] = ()  # per chunk, the weight-gradient ops (W; costing.split_backward)
    w_pending_bytes: tuple[float, ...] = ()  # per chunk, what a W reads that its B leaves behind

    @property
    def chunks(self) -> int:
        return len(self.forward)

    def program(self, kind: str, chunk: int, split: bool = False) -> Program:
        """The program of a task: F, B (the whole backward, or its input-gradient part when the
        order has W tasks: ``split``) or W."""
        if kind == "F":
            return self.forward[chunk]
        if not split:
            if kind == "W":
                raise ValueError("a W task needs an order that splits the backward (zero-bubble schedules)")
            return self.backward[chunk]
        if not self.weight_grad:
            raise ValueError("this trace's backwards were not split into B and W (no data dependencies)")
        return (self.input_grad if kind == "B" else self.weight_grad)[chunk]

    def tasks(self) -> tuple[Program, ...]:
        return (*self.forward, *self.backward, self.grad_sync, self.optimizer)

    def map_programs(self, fn) -> RankCosts:
        """The same costs with every program replaced by ``fn(program)``."""
        return dataclasses.replace(
            self, forward=tuple(fn(p) for p in self.forward), backward=tuple(fn(p) for p in self.backward),
            grad_sync=fn(self.grad_sync), optimizer=fn(self.optimizer),
            input_grad=tuple(fn(p) for p in self.input_grad), weight_grad=tuple(fn(p) for p in self.weight_grad))

    def map_ops(self, op_of) -> RankCosts:
        """The same programs with every op replaced by ``op_of(op)`` (dependencies kept)."""
        return self.map_programs(lambda p: Program((op_of(op) for op in p.ops), p.waits))


def scale_compute(costs: RankCosts, factor: float) -> RankCosts:
    """``costs`` with every compute op ``factor`` times as long (a slower GPU: its kernels, not
    its transfers)."""
    if factor == 1.0:
        return costs
    cache: dict[int, Op] = {}

    def op_of(op: Op) -> Op:
        if id(op) not in cache:
            cache[id(op)] = dataclasses.replace(op, duration_us=op.duration_us * factor) if op.code == COMPUTE else op
        return cache[id(op)]

    return costs.map_ops(op_of)


def slowest(costs: Sequence[RankCosts]) -> RankCosts:
    """The stage's programs when several classes share it: each task the program of its slowest
    class (their TP collectives keep them in lockstep, so the stage moves at the slowest pace)."""
    if len(costs) == 1:
        return costs[0]
    if len({c.chunks for c in costs}) != 1:
        raise ValueError(f"classes of one stage disagree on chunk count: {[c.chunks for c in costs]}")

    def pick(progs: Iterable[Program]) -> Program:
        return max(progs, key=lambda p: p.cost.duration_us)

    n = costs[0].chunks
    split = all(c.weight_grad for c in costs)
    return RankCosts(forward=tuple(pick(c.forward[i] for c in costs) for i in range(n)),
                     backward=tuple(pick(c.backward[i] for c in costs) for i in range(n)),
                     grad_sync=pick(c.grad_sync for c in costs), optimizer=pick(c.optimizer for c in costs),
                     input_grad=tuple(pick(c.input_grad[i] for c in costs) for i in range(n)) if split else (),
                     weight_grad=tuple(pick(c.weight_grad[i] for c in costs) for i in range(n)) if split else (),
                     w_pending_bytes=tuple(max(c.w_pending_bytes[i] for c in costs) for i in range(n))
                     if all(c.w_pending_bytes for c in costs) else ())
