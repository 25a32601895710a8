"""The measure stage: run the real multi-process training of a workload on this machine and time it.

``run_measure(workload, out_dir)`` starts one process per rank (``python -m echo.training.run``,
torch.distributed over gloo on 127.0.0.1, one intra-op thread each, as the profile stage times
kernels), warms up, times ``iters`` steps and profiles one more. It writes

- ``measured.parquet`` (MEASURED): one row per timed step, ``step_time_s`` = from the first
  rank leaving the step's start barrier to the last rank finishing its optimizer step, and the
  median of the samples;
- ``phases.parquet`` (PHASES): per rank and phase (forward, backward, recv, send_wait,
  zero_grad, grad_sync, optimizer), the median wall time per step and, from the profiled step,
  the time in operators and in collectives;
- ``events.parquet``: every timed interval of every rank (the measured timeline).

Workloads too big for this machine are refused before any process starts (``check_measurable``),
naming the workload file and what does not fit.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

from echo import launch
from echo.config.workload import Workload
from echo.errors import ConfigError
from echo.io import write_parquet
from echo.training.layout import Layout
from echo.training.schedule import SPLIT_BACKWARD

log = logging.getLogger(__name__)

PROCESS_OVERHEAD_BYTES = 450 << 20  # torch + gloo + the interpreter, per rank process
MEMORY_HEADROOM = 0.7               # use at most this fraction of the available memory
ASSUMED_CPU_GFLOPS = 15.0           # one core, fp32 GEMM-dominated step (a cautious guess)
MAX_STEP_S = 60.0                   # refuse workloads whose step would take longer than this
MAX_RANKS_PER_CORE = 4              # beyond this the run measures the scheduler, not the job
PRIORITY = "rt"                     # rank processes run ahead of other work where permitted (echo.launch.prioritize)
CLEAN_DELAY = 0.01                  # a step whose ranks waited for a CPU less than this fraction is clean
MIN_CLEAN = 5                       # the headline median needs this many clean steps, else all count

MEASURED = pa.schema([
    ("workload", pa.string()),
    ("iteration", pa.int32()),
    ("step_time_s", pa.float64()),         # one sample
    ("median_step_time_s", pa.float64()),  # median of the clean samples (all when fewer than MIN_CLEAN)
    ("run_delay_s", pa.float64()),         # ranks' main threads waiting for a CPU during the step, summed
    ("clean", pa.bool_()),                 # run_delay_s below CLEAN_DELAY of the step: no rank was
                                           # kept off its core (e.g. real-time throttling, other jobs)
    ("median_all_step_time_s", pa.float64()),  # median of every sample
    ("world_size", pa.int32()),
    ("cores", pa.int32()),                 # CPUs this process may run on
    ("oversubscribed", pa.bool_()),        # more ranks than cores: ranks time-share cores
    ("threads_per_rank", pa.int32()),
    ("warmup", pa.int32()),
    ("loadavg_before", pa.float64()),      # 1-minute load average when the run started
    ("loadavg_after", pa.float64()),
    ("busy_cores", pa.float64()),          # cores busy machine-wide during the step (/proc/stat)
    ("rank_cores", pa.float64()),          # of which the ranks' processes (their CPU time / wall)
    ("foreign_cores", pa.float64()),       # the rest: other processes on the machine
    ("compute_cpu_fraction", pa.float64()),  # main-thread CPU time / wall in compute-only spans
    ("scheduling", pa.string()),           # how the ranks were scheduled: rt | nice | none (see echo.launch.prioritize)
    ("loss_first", pa.float64()),          # mean loss of the first and last step: the job trains
    ("loss_last", pa.float64()),
    ("torch_version", pa.string()),
    ("host", pa.string()),
])

PHASES = pa.schema([
    ("workload", pa.string()),
    ("rank", pa.int32()),
    ("pp_rank", pa.int32()),
    ("tp_rank", pa.int32()),
    ("dp_rank", pa.int32()),
    ("phase", pa.string()),        # forward | backward | recv | send_wait | zero_grad | grad_sync | optimizer | step
    ("wall_s", pa.float64()),      # median over timed steps of the phase's total per step
    ("op_s", pa.float64()),        # profiled step: top-level operators inside the phase
    ("comm_s", pa.float64()),      # profiled step: collectives (and p2p) inside the phase
    ("profiled_wall_s", pa.float64()),  # the phase's wall time in the profiled step itself
])


class MeasureRefused(ConfigError):
    """The workload cannot be run for real on this machine."""


# --- what fits ------------------------------------------------------------------------------


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (whole machine), else total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def rank_layers(w: Workload) -> int:
    """Layers of the pipeline rank holding the most (its chunks' share of ``layers_of``)."""
    p = w.parallel
    split = p.layers_of(w.model.layers)
    return max(sum(split[c * p.pp + s] for c in range(p.virtual_stages)) for s in range(p.pp))


def rank_params(w: Workload) -> float:
    """Parameters of the largest rank (a first or last stage: embedding or head on top of its layers)."""
    m, p = w.model, w.parallel
    layer = 4 * m.hidden * m.hidden + 2 * m.hidden * m.ffn + 9 * m.hidden + m.ffn
    return rank_layers(w) * layer / p.tp + (m.vocab * m.hidden) / p.tp + m.seq_len * m.hidden


def estimate_rank_bytes(w: Workload) -> float:
    """Peak bytes of one rank process: parameters, fp32 gradients, AdamW state, the activations of
    the micro-batches in flight (Korthikanti et al.'s per-layer count, fp32 scaled) and logits."""
    m, p, t = w.model, w.parallel, w.training
    dbytes = {"fp32": 4, "bf16": 2, "fp16": 2}[t.dtype]
    n = rank_params(w)
    state = n * (dbytes + 4 + 8 + (4 if dbytes != 4 else 0))
    b, s, h = t.micro_batch, m.seq_len, m.hidden
    per_layer = b * s * h * (34 + 5 * m.heads * s / h) * dbytes / 2 / p.tp
    if t.recompute == "full":
        per_layer = b * s * h * dbytes
    in_flight = w.micro_batches if p.schedule == "gpipe" else min(w.micro_batches, p.pp) * p.virtual_stages
    logits = 3 * b * s * m.vocab / p.tp * 4
    chunk_layers = max(p.layers_of(m.layers))
    return state + in_flight * per_layer * chunk_layers + logits + PROCESS_OVERHEAD_BYTES


def estimate_step_s(w: Workload, cores: int) -> float:
    """Rough seconds per step on this CPU: 6 x params x tokens (8 x with full recompute)."""
    m, t = w.model, w.training
    per_param = 8 if t.recompute == "full" else 6
    params = m.layers * (4 * m.hidden ** 2 + 2 * m.hidden * m.ffn) + 2 * m.vocab * m.hidden
    attn = 6 * m.layers * m.seq_len * m.hidden * 2  # QK^T and AV, forward + backward, per token
    flops = (per_param * params + attn) * t.global_batch * m.seq_len
    return flops / (min(cores, w.world_size) * ASSUMED_CPU_GFLOPS * 1e9)


def check_measurable(w: Workload, *, memory_bytes: int | None = None, cores: int | None = None,
                     max_step_s: float = MAX_STEP_S) -> None:
    """Refuse (MeasureRefused naming the workload file, key and reason) a workload this machine
    cannot train for real: unsupported features, too much memory, too many ranks, too slow."""
    path = f"config/workloads/{w.name}.yaml"
    m, p = w.model, w.parallel
    unsupported = [
        (m.arch != "gpt", "model.arch", f"the measure stage runs the gpt reference model, not {m.arch}"),
        (m.experts > 0, "model.experts", "mixture-of-experts training is not run by the measure stage yet"),
        (p.cp > 1, "parallel.cp", "context parallelism is not run by the measure stage yet"),
        (p.zero == 3, "parallel.zero", "ZeRO 3 / FSDP is not run by the measure stage yet"),
        (p.sequence_parallel, "parallel.sequence_parallel", "sequence parallelism is not run by the measure stage yet"),
        (p.schedule in SPLIT_BACKWARD, "parallel.schedule",
         f"{p.schedule} splits each backward into B and W, which the measure stage does not run yet"),
    ]
    for bad, key, reason in unsupported:
        if bad:
            raise MeasureRefused(path, key, reason)
    memory_bytes = memory_bytes if memory_bytes is not None else available_memory_bytes()
    cores = cores or machine_cores()
    need = estimate_rank_bytes(w) * w.world_size
    if need > MEMORY_HEADROOM * memory_bytes:
        raise MeasureRefused(path, "model", f"too big to train here: about {need / 2**30:.1f} GiB for "
                             f"{w.world_size} ranks, this machine has {memory_bytes / 2**30:.1f} GiB available "
                             f"(at most {MEMORY_HEADROOM:.0%} is used)")
    if w.world_size > MAX_RANKS_PER_CORE * cores:
        raise MeasureRefused(path, "parallel", f"world size {w.world_size} is more than {MAX_RANKS_PER_CORE} "
                             f"processes per core on this {cores}-core machine")
    step = estimate_step_s(w, cores)
    if step > max_step_s:
        raise MeasureRefused(path, "model", f"too slow to train here: one step would take about {step:.0f} s on "
                             f"{min(cores, w.world_size)} cores (limit {max_step_s:.0f} s)")


# --- running it ------------------------------------------------------------------------------


class CpuMonitor:
    """Samples the machine's busy CPU time (/proc/stat) in a thread, so that each step can be
    told how many cores other processes used while it ran."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []  # (perf_counter, busy seconds of all cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy_s(self) -> float | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        v = [int(x) for x in fields]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        busy = sum(v[:8]) - idle                   # user nice system idle iowait irq softirq steal
        return busy / self._tick

    def _run(self) -> None:
        while not self._stop.is_set():
            b = self._busy_s()
            if b is not None:
                self.samples.append((time.perf_counter(), b))
            self._stop.wait(self.period_s)

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def busy_cores(self, t0: float, t1: float) -> float | None:
        """Average cores busy (all processes) over [t0, t1], from the samples around it."""
        before = [s for s in self.samples if s[0] <= t0]
        after = [s for s in self.samples if s[0] >= t1]
        if not before or not after:
            return None
        (ta, ba), (tb, bb) = before[-1], after[0]
        return (bb - ba) / (tb - ta) if tb > ta else None


def _read_arrow(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def run_measure(workload: Workload, out_dir: Path, *, warmup: int = 3, iters: int = 10, profile: bool = True,
                priority: str = PRIORITY, timeout_s: float | None = None) -> pa.Table:
    """Train ``workload`` for real on this machine; write measured.parquet, phases.parquet and
    events.parquet into ``out_dir``; return the measured table."""
    from echo.trace.runner import check_traceable

    check_traceable(workload)  # the same job the tracer records, or none
    check_measurable(workload)
    if iters < 1 or warmup < 0:
        raise ValueError(f"measure needs iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cores, world = machine_cores(), workload.world_size
    est = estimate_step_s(workload, cores)
    timeout_s = timeout_s or 120.0 + 10.0 * est * (warmup + iters + 2)
    log.info("measure %s: %d ranks on %d cores, %d warm-up + %d timed steps (estimate %.2f s each)",
             workload.name, world, cores, warmup, iters, est)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=".measure-", dir=out_dir) as tmp_name:
        tmp = Path(tmp_name)
        spec = {"workload": workload.model_dump(mode="json"), "port": launch.free_port(), "warmup": warmup,
                "iters": iters, "profile": profile, "out_dir": str(tmp)}
        t0 = time.perf_counter()
        with CpuMonitor() as monitor:
            launch.wait(launch.launch("echo.training.run", spec, world, tmp, priority=priority), tmp, timeout_s,
                        "measure")
        log.info("measure %s: ran in %.1f s", workload.name, time.perf_counter() - t0)
        events = pa.concat_tables([_read_arrow(tmp / f"events{r}.arrow") for r in range(world)])
        profiles = pa.concat_tables([_read_arrow(tmp / f"profile{r}.arrow") for r in range(world)])
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
    load_after = os.getloadavg()[0]
    check_replicas(workload, ranks)
    measured = measured_table(workload, events, ranks, cores=cores, warmup=warmup,
                              loads=(load_before, load_after), monitor=monitor)
    write_parquet(measured, out_dir / "measured.parquet", MEASURED)
    counted = {r["iteration"] for r in measured.to_pylist() if r["clean"]}
    if len(counted) < MIN_CLEAN:
        counted = set(measured["iteration"].to_pylist())
    write_parquet(phases_table(workload, events, profiles, counted), out_dir / "phases.parquet", PHASES)
    write_parquet(events, out_dir / "events.parquet")
    med = measured["median_step_time_s"][0].as_py()
    spread = [measured["step_time_s"][i].as_py() / med for i in range(measured.num_rows)]
    n_clean = sum(measured["clean"].to_pylist())
    log.info("measure %s: median step %.4f s (%d of %d samples clean; all samples %.3f x to %.3f x it)",
             workload.name, med, n_clean, measured.num_rows, min(spread), max(spread))
    if n_clean < MIN_CLEAN:
        log.warning("measure %s: only %d clean steps (ranks kept off their cores): the median of all %d "
                    "samples is reported", workload.name, n_clean, measured.num_rows)
    return measured


def check_replicas(w: Workload, ranks: list[dict]) -> None:
    """Data-parallel replicas must end with the same parameters (their gradients were reduced
    and, under ZeRO 1/2, their shards gathered): a real run, not p independent ones."""
    layout = Layout(w.parallel)
    by_slot: dict[tuple[int, int, int], list[tuple[int, float]]] = {}
    for r in ranks:
        c = layout.coords(r["rank"])
        by_slot.setdefault((c.pp, c.tp, c.cp), []).append((r["rank"], r["param_checksum"]))
    for replicas in by_slot.values():
        first_rank, first = replicas[0]
        for rank, value in replicas[1:]:
            if abs(value - first) > 1e-6 * max(1.0, abs(first)):
                raise RuntimeError(f"measure {w.name}: data-parallel ranks {first_rank} and {rank} ended the run with "
                                   f"different parameters ({first!r} vs {value!r})")


def step_windows(events: pa.Table, profiled: bool = False) -> dict[int, tuple[float, float, float]]:
    """iteration -> (start, end, ranks' CPU seconds): from the first rank starting the step to the
    last rank ending it, and the CPU time all rank processes spent in it."""
    out: dict[int, list[float]] = {}
    for row in events.to_pylist():
        if row["kind"] != "step" or row["profiled"] != profiled or row["iteration"] < 0:
            continue
        w = out.setdefault(row["iteration"], [float("inf"), float("-inf"), 0.0])
        w[0], w[1] = min(w[0], row["start_s"]), max(w[1], row["end_s"])
        w[2] += row["process_cpu_s"]
    return {i: (w[0], w[1], w[2]) for i, w in sorted(out.items())}


def step_times(events: pa.Table, profiled: bool = False) -> dict[int, float]:
    """iteration -> step time in seconds (see step_windows)."""
    return {i: end - start for i, (start, end, _) in step_windows(events, profiled).items()}


def step_delays(events: pa.Table) -> dict[int, float]:
    """iteration -> seconds the ranks' threads waited for a CPU during the step, all ranks summed."""
    out: dict[int, float] = {}
    for row in events.to_pylist():
        if row["kind"] == "step" and not row["profiled"] and row["iteration"] >= 0 and row["run_delay_s"] is not None:
            out[row["iteration"]] = out.get(row["iteration"], 0.0) + row["run_delay_s"]
    return out


def compute_cpu_fraction(events: pa.Table) -> dict[int, float]:
    """iteration -> main-thread CPU time / wall time over the ranks' forward and backward spans:
    about 1 when the ranks had their cores to themselves (lower with blocking TP collectives
    inside the spans, or when other processes took the cores)."""
    cpu: dict[int, float] = {}
    wall: dict[int, float] = {}
    for row in events.to_pylist():
        if row["kind"] in ("forward", "backward") and not row["profiled"] and row["iteration"] >= 0:
            i = row["iteration"]
            cpu[i] = cpu.get(i, 0.0) + row["cpu_s"]
            wall[i] = wall.get(i, 0.0) + row["end_s"] - row["start_s"]
    return {i: cpu[i] / wall[i] for i in cpu if wall[i] > 0}


def measured_table(w: Workload, events: pa.Table, ranks: list[dict], *, cores: int, warmup: int,
                   loads: tuple[float, float], monitor: CpuMonitor | None = None) -> pa.Table:
    windows = step_windows(events)
    if not windows:
        raise RuntimeError(f"measure {w.name}: no timed step was recorded")
    samples = {i: end - start for i, (start, end, _) in windows.items()}
    med = statistics.median(samples.values())
    fractions = compute_cpu_fraction(events)
    steps_run = warmup + len(samples) + 1  # + the profiled step
    losses = [r["losses"] for r in ranks if r["losses"]]
    per_step = max(1, len(losses[0]) // steps_run) if losses else 1

    def mean_loss(step: int) -> float | None:
        vals = [sum(ls[step * per_step:(step + 1) * per_step]) / per_step for ls in losses if len(ls) >= per_step]
        return sum(vals) / len(vals) if vals else None

    delays = step_delays(events)
    clean = {i: delays.get(i) is not None and delays[i] < CLEAN_DELAY * samples[i] for i in samples}
    clean_samples = [samples[i] for i in samples if clean[i]]
    headline = statistics.median(clean_samples) if len(clean_samples) >= MIN_CLEAN else med
    rows = []
    for i, (start, end, cpu) in windows.items():
        busy = monitor.busy_cores(start, end) if monitor else None
        mine = cpu / (end - start)
        rows.append({
            "workload": w.name, "iteration": i, "step_time_s": samples[i], "median_step_time_s": headline,
            "run_delay_s": delays.get(i), "clean": clean[i], "median_all_step_time_s": med,
            "world_size": w.world_size, "cores": cores, "oversubscribed": w.world_size > cores,
            "threads_per_rank": ranks[0]["threads"], "warmup": warmup, "loadavg_before": loads[0],
            "loadavg_after": loads[1], "busy_cores": busy, "rank_cores": mine,
            "foreign_cores": max(0.0, busy - mine) if busy is not None else None,
            "compute_cpu_fraction": fractions.get(i), "scheduling": ranks[0].get("scheduling", "none"),
            "loss_first": mean_loss(0), "loss_last": mean_loss(steps_run - 1) if losses else None,
            "torch_version": _torch_version(), "host": platform.node(),
        })
    return pa.Table.from_pylist(rows, schema=MEASURED)


def _torch_version() -> str:
    import torch  # here, not at the top: the workflow reads this module while building the DAG

    return torch.__version__


def phases_table(w: Workload, events: pa.Table, profiles: pa.Table, iterations: set[int] | None = None) -> pa.Table:
    """Per rank and phase: median wall per timed step (of ``iterations``, default all), and the
    profiled step's op/comm split."""
    layout = Layout(w.parallel)
    totals: dict[tuple[int, str], dict[int, float]] = {}
    profiled_wall: dict[tuple[int, str], float] = {}
    for row in events.to_pylist():
        key = (row["rank"], row["kind"])
        dur = row["end_s"] - row["start_s"]
        if row["profiled"]:
            profiled_wall[key] = profiled_wall.get(key, 0.0) + dur
        elif row["iteration"] >= 0 and (iterations is None or row["iteration"] in iterations):
            per_iter = totals.setdefault(key, {})
            per_iter[row["iteration"]] = per_iter.get(row["iteration"], 0.0) + dur
    prof: dict[tuple[int, str, str], float] = {}
    for row in profiles.to_pylist():
        prof[(row["rank"], row["phase"], row["category"])] = row["time_s"]
    counted = sorted({i for per in totals.values() for i in per})
    rows = []
    for (rank, phase), per_iter in sorted(totals.items()):
        c = layout.coords(rank)
        rows.append({
            "workload": w.name, "rank": rank, "pp_rank": c.pp, "tp_rank": c.tp, "dp_rank": c.dp, "phase": phase,
            "wall_s": statistics.median(per_iter.get(i, 0.0) for i in counted),
            "op_s": prof.get((rank, phase, "op")), "comm_s": prof.get((rank, phase, "comm")),
            "profiled_wall_s": profiled_wall.get((rank, phase)),
        })
    return pa.Table.from_pylist(rows, schema=PHASES)
