"""Pipeline schedules as per-stage task orders.

A schedule says, for every pipeline stage, in which order it runs the forward (F) and backward
(B) passes of each micro-batch and model chunk; the zero-bubble schedules (Qi et al., ICLR 2024)
split each backward into its input-gradient part (B) and its weight-gradient part (W: the
weight-gradient GEMMs, ``echo.simulate.costing.split_backward``) and place W later, in what would
otherwise be bubbles. The other schedules run B and W back to back as one backward. It says nothing about time: the engine turns the
orders into a timeline, so one definition serves every workload and the bubble is an outcome,
not an input. Chunk ``c`` on stage ``s`` is virtual stage ``c * stages + s`` (Megatron-LM's
interleaved layout), so activations leave the last stage for stage 0 of the next chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from echo.config.workload import ParallelConfig
from echo.training.zb_auto import PassTimes, greedy_orders, spans
from echo.training.zb_v import v_orders

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-2p", "zb-v", "dualpipev", "dualpipe")
# the schedules whose orders hold W tasks (a backward split into input- and weight-gradient parts)
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-2p", "zb-v", "dualpipev", "dualpipe")
# the schedules whose orders depend on the stages' pass times (echo.training.zb_auto, zb_v)
TIMED = ("zb-2p", "zb-v")
# orders as the zero-bubble runtime runs them: it batches each pass' sends with the transfers
# planned next to them (echo.training.zb_comm; EngineOptions.batched_sends)
BATCHED_SENDS = ("zb-h1", "zb-h2", "zb-2p", "zb-v")


@dataclass(frozen=True)
class Task:
    """One pass of one micro-batch through one model chunk on one pipeline stage."""

    kind: str        # "F" (forward) | "B" (backward, recomputation included; the input-gradient
                     # part alone in a schedule with W tasks) | "W" (weight-gradient part)
    microbatch: int
    chunk: int
    combined: bool = False  # a forward that runs together with the backward after it (combined 1F1B)
    whole: bool = False     # in an order with W tasks, a backward run with its W in one program
                            # (DualPipe's full backward chunk: its gradient leaves after both)


def stage_orders(schedule: str, stages: int, micro_batches: int, chunks: int = 1,
                 extra_warmup: int = 0, times: Sequence | None = None) -> list[list[Task]]:
    """Every stage's task order for ``schedule``; refuses combinations the schedule cannot run.
    ``extra_warmup``: forwards each stage of a 1F1B schedule runs before its steady state beyond
    the schedule's own warm-up (combined 1F1B: see ``orders_of``). ``times``: each stage's pass
    times (``PassTimes``; zb-v: a list of them per stage, one per chunk), which a ``TIMED``
    schedule is built for (None: equal F, B and W times, no transfer, a W owed keeping all of its
    micro-batch's activations)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule '{schedule}'; known: {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError(f"stages ({stages}), micro-batches ({micro_batches}) and chunks ({chunks}) must be >= 1")
    if extra_warmup and schedule in SPLIT_BACKWARD:
        raise ValueError(f"{schedule} has no combined 1F1B warm-up (ep_comm_overlap)")
    if schedule == "zb-v":
        if chunks != 2 or stages < 2:
            raise ValueError(f"zb-v holds two chunks per stage in a V over two or more stages, got {chunks} "
                             f"chunks and {stages} stages")
        unit = [PassTimes(1.0, 1.0, 1.0, 0.0, 1.0)] * 2
        vt = [list(t) for t in times] if times is not None else [unit] * stages
        if len(vt) != stages or any(len(t) != 2 for t in vt):
            raise ValueError(f"zb-v: pass times of two chunks for each of {stages} stages needed")
        # the zero-bubble runtime's own V heuristic, under 1F1B's peak activations (echo.training.zb_v)
        return [[Task(kind, mb, c) for kind, mb, c in o] for o in v_orders(vt, micro_batches)]
    if schedule == "dualpipev":
        if chunks != 2 or stages < 2 or micro_batches < 2 * stages:
            raise ValueError(f"dualpipev holds two chunks per stage in a V over two or more stages and needs at least "
                             f"2 x stages micro-batches, got {chunks} chunks, {stages} stages, {micro_batches} "
                             "micro-batches")
        return [_dualpipev(s, stages, micro_batches) for s in range(stages)]
    if schedule == "dualpipe":
        if chunks != 2 or stages < 2 or stages % 2 or micro_batches < 2 * stages or micro_batches % 2:
            raise ValueError(f"dualpipe feeds the pipeline from both ends, one chunk a way: two chunks per stage, an "
                             f"even number of stages and an even number of at least 2 x stages micro-batches, got "
                             f"{chunks} chunks, {stages} stages, {micro_batches} micro-batches")
        return [_dualpipe(s, stages, micro_batches) for s in range(stages)]
    if schedule != "interleaved" and chunks != 1:
        raise ValueError(f"schedule {schedule} runs one chunk per stage, got {chunks} (use interleaved)")
    if schedule == "interleaved" and micro_batches % stages:
        raise ValueError(f"interleaved needs micro-batches ({micro_batches}) divisible by stages ({stages})")
    if extra_warmup and schedule == "gpipe":
        raise ValueError("gpipe has no warm-up to extend")
    if schedule in TIMED:
        times = list(times) if times is not None else [PassTimes(1.0, 1.0, 1.0, 0.0, 1.0)] * stages
        if len(times) != stages:
            raise ValueError(f"{schedule}: {len(times)} stages' pass times for {stages} stages")
        # ZB-2p: at most twice 1F1B's peak activations (stage 0's: stages micro-batches) on every
        # stage, a W owed counting what it keeps; the better of the greedy order and ZB-H2 (which
        # keeps within the same limit) at the pass level, as the paper keeps its best heuristic
        limit = [2.0 * stages] * stages
        greedy = greedy_orders(times, micro_batches, limit)
        hand = [[(t.kind, t.microbatch) for t in _zb_h2(s, stages, micro_batches, 1)] for s in range(stages)]
        best = min((greedy, hand), key=lambda o: max(spans(times, o)))
        return [[Task(kind, mb, 0) for kind, mb in o] for o in best]
    build: Callable[[int, int, int, int, int], list[Task]] = _BUILDERS[schedule]
    return [build(s, stages, micro_batches, chunks, extra_warmup) for s in range(stages)]


def orders_of(p: ParallelConfig, micro_batches: int, times: Sequence[PassTimes] | None = None) -> list[list[Task]]:
    """The task orders a workload's layout runs (``times``: the stages' pass times, for a
    ``TIMED`` schedule). With ``ep_comm_overlap`` (Megatron-Core's combined
    1F1B) each stage warms up one micro-batch more: a steady-state pair (forward k, backward j) then
    holds two independent passes. Without it the last stage would pair a micro-batch's forward with
    its own backward, which needs that forward's loss."""
    if p.schedule in ("dualpipev", "dualpipe"):  # pair their steady state themselves
        return stage_orders(p.schedule, p.pp, micro_batches, p.virtual_stages)
    orders = stage_orders(p.schedule, p.pp, micro_batches, p.virtual_stages, int(p.ep_comm_overlap), times)
    return [combine_steady_state(o) for o in orders] if p.ep_comm_overlap else orders


def combine_steady_state(order: list[Task]) -> list[Task]:
    """``order`` with each steady-state forward that a backward follows marked ``combined``."""
    out = list(order)
    i = next((i for i, t in enumerate(out) if t.kind == "B"), len(out)) - 1
    while i >= 0 and i + 1 < len(out) and out[i].kind == "F" and out[i + 1].kind == "B":
        out[i] = Task("F", out[i].microbatch, out[i].chunk, combined=True)
        i += 2
    return out


def _gpipe(stage: int, stages: int, m: int, chunks: int, extra: int = 0) -> list[Task]:
    """All forwards, then all backwards (torch.distributed.pipelining's ScheduleGPipe order)."""
    return [Task("F", i, 0) for i in range(m)] + [Task("B", i, 0) for i in range(m)]


def _one_f_one_b(stage: int, stages: int, m: int, chunks: int, extra: int = 0) -> list[Task]:
    """PipeDream-flush 1F1B: stages - stage - 1 warm-up forwards, then one forward and one
    backward in turn, then the cool-down backwards. A stage never holds more than
    stages - stage micro-batches of activations."""
    warmup = min(stages - stage - 1 + extra, m)
    order = [Task("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Task("F", warmup + i, 0), Task("B", i, 0)]
    return order + [Task("B", i, 0) for i in range(m - warmup, m)]


def _interleaved(stage: int, stages: int, m: int, chunks: int, extra: int = 0) -> list[Task]:
    """Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving): virtual
    micro-batches walk the chunks in groups of ``stages`` micro-batches; the warm-up is
    2 * (stages - stage - 1) + (chunks - 1) * stages virtual micro-batches."""
    total = m * chunks
    warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages + extra, total)

    def task(k: int, kind: str) -> Task:
        in_group = k % (stages * chunks)
        chunk = in_group // stages
        if kind == "B":
            chunk = chunks - chunk - 1  # backward walks the chunks in reverse
        microbatch = (k // (stages * chunks)) * stages + k % stages
        return Task(kind, microbatch, chunk)

    order = [task(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        order += [task(warmup + i, "F"), task(i, "B")]
    return order + [task(k, "B") for k in range(total - warmup, total)]


def _zb_h1(stage: int, stages: int, m: int, chunks: int, extra: int = 0) -> list[Task]:
    """ZB-H1 (Qi et al., section 3.1; the paper's exact semantics): 1F1B's warm-up, then stage i
    runs its first i steady-state pairs as F, B with their W held back, then F, B, W, the
    cool-down as B, W, and the i held-back W last, where 1F1B's stage i idles at the end. The
    in-flight micro-batches are 1F1B's (stages - stage); the bubble is
    (stages - 1) x (T_F + T_B - T_W) against 1F1B's (stages - 1) x (T_F + T_B + T_W)."""
    f = min(stages - stage - 1, m)
    order, b, w = [Task("F", i, 0) for i in range(f)], 0, 0
    for _ in range(stage):
        if f == m:
            break
        order += [Task("F", f, 0), Task("B", b, 0)]
        f, b = f + 1, b + 1
    while f < m:
        order += [Task("F", f, 0), Task("B", b, 0), Task("W", w, 0)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:
        order += [Task("B", b, 0), Task("W", w, 0)]
        b, w = b + 1, w + 1
    return order + [Task("W", i, 0) for i in range(w, m)]


def _zb_h2(stage: int, stages: int, m: int, chunks: int, extra: int = 0) -> list[Task]:
    """ZB-H2 (Qi et al., section 3.1): the warm-up fills the bubble before the first B with
    forwards, 2 (stages - stage) - 1 on stage i (the first B reaches stage i after that many
    forward times when T_F = T_B = T_W); then each B is followed by the next F, and stage i holds
    back 2 i + 1 W (the last stage the most: it receives its forwards last), running the oldest
    held-back W before each further B and the rest after the last B. With equal pass times every
    stage is then busy from its first forward to its last W, a parallelogram: zero bubble once
    the optimizer step no longer synchronizes the stages (``post_validation``). This is the
    fixed point of a unit-time greedy list schedule (B first, F while under 2 (stages - i) - 1
    micro-batches of activations, W when at most 2 i + 1 are held back). It holds about twice
    1F1B's activations on the first stage."""
    f, w = min(2 * (stages - stage) - 1, m), 0
    hold = 2 * stage + 1
    order = [Task("F", i, 0) for i in range(f)]
    for b in range(m):
        if b - w >= hold:
            order.append(Task("W", w, 0))
            w += 1
        order.append(Task("B", b, 0))
        if f < m:
            order.append(Task("F", f, 0))
            f += 1
    return order + [Task("W", i, 0) for i in range(w, m)]


def _dualpipev(stage: int, stages: int, m: int) -> list[Task]:
    """DualPipeV (DeepSeek's DualPipe cut in half by Sea AI Lab; deepseek-ai/DualPipe,
    dualpipev.py, ``DualPipeV.step``) on rank ``stage`` of ``stages``, ``m`` >= 2 x stages
    micro-batches, chunk 0 the V's way down (virtual stage ``stage``) and chunk 1 its way back
    (2 stages - 1 - stage, the loss on rank 0): ``_eight_steps`` with phase c = chunk c, every
    micro-batch through both chunks, h = r, rest = n - r - 1, m - 2n + r + 1 steady-state rounds,
    the last rank (the V's turn) running its first pair unpaired."""
    n, r = stages, stage
    return _eight_steps(h=r, rest=n - r - 1, rounds=m - 2 * n + r + 1, turn=r == n - 1,
                        chunk_of=(0, 1), first_mb=(0, 0), per_chunk=m)


def _dualpipe(stage: int, stages: int, m: int) -> list[Task]:
    """DualPipe (DeepSeek-V3 report; deepseek-ai/DualPipe, dualpipe.py, ``DualPipe.step``) on rank
    ``stage`` of an even number ``stages``, ``m`` micro-batches, half fed at rank 0 (micro-batches
    0 .. m/2 - 1, each through chunk 0 of every rank, stage s on rank s) and half at the last rank
    (m/2 .. m - 1, through chunk 1, stage s on rank stages - 1 - s): ``_eight_steps`` with phase 0
    the way on which the rank sits in the first half of the pipeline (chunk 0 on ranks below
    stages / 2, chunk 1 on the others), h = min(r, n - 1 - r), rest = n/2 - h - 1, m/2 - n + h + 1
    steady-state rounds, the two middle ranks (where the ways cross) running their first pair
    unpaired."""
    n, r = stages, stage
    h, second = min(r, n - 1 - r), int(r >= n // 2)
    return _eight_steps(h=h, rest=n // 2 - h - 1, rounds=m // 2 - n + h + 1, turn=h == n // 2 - 1,
                        chunk_of=(second, 1 - second), first_mb=(0, m // 2), per_chunk=m // 2)


def _eight_steps(*, h: int, rest: int, rounds: int, turn: bool, chunk_of: tuple[int, int],
                 first_mb: tuple[int, int], per_chunk: int) -> list[Task]:
    """The eight steps DualPipe and DualPipeV run on a rank (their ``step``), over its two phases
    (``chunk_of[p]``: the chunk phase p runs; ``first_mb[c]``: chunk c's first micro-batch):

    1. 2 rest phase-0 forwards; 2. h + 1 times a phase-0 and a phase-1 forward;
    3. rest times a phase-1 backward, its W at once, a phase-1 forward;
    4. ``rounds`` times two overlapped pairs (phase-0 forward with phase-1 backward, then phase-1
       forward with phase-0 backward; at the ``turn`` the first pair runs unpaired, to keep the
       bubble small);
    5. rest times a phase-1 backward and a pair (phase-1 forward, phase-0 backward);
    6. h + 1 times a phase-1 and a phase-0 backward, from the middle on with their W deferred;
    7. rest times an owed W and a phase-0 backward with its W deferred; 8. the h + 1 owed Ws.

    A pair is a forward marked ``combined`` and the backward after it (the engine runs them as one
    program, ``overlaps.combined``: interleaved at their expert-parallel all-to-alls, both inputs
    received before and both outputs sent after, as DualPipe's overlapped chunk does); a backward
    whose W is not deferred is ``whole`` (DualPipe's full backward chunk: B and W in one program,
    its gradient sent after both). Deferred Ws run oldest first (DualPipe's WeightGradStore queue)."""
    out: list[Task] = []
    fwd, bwd, owed = [0, 0], [0, 0], []

    def forward(phase: int, combined: bool = False) -> None:
        c = chunk_of[phase]
        out.append(Task("F", first_mb[c] + fwd[c], c, combined))
        fwd[c] += 1

    def backward(phase: int, defer: bool = False) -> None:
        c = chunk_of[phase]
        out.append(Task("B", first_mb[c] + bwd[c], c, whole=not defer))
        if defer:
            owed.append((first_mb[c] + bwd[c], c))
        bwd[c] += 1

    def weight() -> None:
        mb, c = owed.pop(0)
        out.append(Task("W", mb, c))

    def pair(f: int, b: int) -> None:
        forward(f, combined=True)
        backward(b)

    for _ in range(2 * rest):
        forward(0)
    for _ in range(h + 1):
        forward(0)
        forward(1)
    for _ in range(rest):
        backward(1, defer=True)
        weight()
        forward(1)
    for i in range(rounds):
        if i == 0 and turn:
            forward(0)
            backward(1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(rest):
        backward(1)
        pair(1, 0)
    defer = False
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            defer = True
        backward(1, defer)
        if i == (h + 1) // 2 and h % 2 == 0:
            defer = True
        backward(0, defer)
    for _ in range(rest):
        weight()
        backward(0, defer=True)
    for _ in range(h + 1):
        weight()
    assert not owed and fwd == bwd == [per_chunk, per_chunk], "dualpipe: every pass once"
    return out


_BUILDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1,
             "zb-h2": _zb_h2}


def in_flight(order: list[Task]) -> int:
    """Most chunk-micro-batches whose activations a stage holds at once (forward done, backward
    not yet): the activation-memory multiplier of the schedule, read off the order itself."""
    held = peak = 0
    for task in memory_order(order):
        if task.kind != "W":
            held += 1 if task.kind == "F" else -1
        peak = max(peak, held)
    return peak


def w_pending(order: list[Task]) -> int:
    """Most micro-batches whose W a stage still owes at once (B done, W not yet): each holds
    what its weight-gradient GEMMs read (the layers' inputs and output gradients)."""
    held = peak = 0
    for task in order:
        held += {"B": 0 if task.whole else 1, "W": -1}.get(task.kind, 0)
        peak = max(peak, held)
    return peak if splits_backward(order) else 0


def splits_backward(order: list[Task]) -> bool:
    """Whether ``order`` runs its backwards split into B and W tasks."""
    return any(t.kind == "W" for t in order)


def memory_order(order: list[Task]) -> list[Task]:
    """``order`` as its activations come and go: a combined forward after the backward it runs
    with, since that backward frees its layers while the forward fills its own (layer by layer,
    cut at their all-to-alls), so the pair holds about what it held before (up to a layer)."""
    out = list(order)
    for i in range(len(out) - 1):
        if out[i].combined and out[i + 1].kind == "B":
            out[i], out[i + 1] = out[i + 1], out[i]
    return out
