"""Time kernels on this CPU: rebuild each call, run it single-threaded, keep the fastest sample.

One thread and the minimum of many samples: on the project's shared 2-core machines timings with
2 threads varied up to 20x at p90, single-threaded minima of single calls were stable to about
1.6x (docs/DESIGN.md, "Timing on a shared machine"). A few more things bring repeated profiles within 10% per kernel:

- the clock is the timing thread's CPU time (``CLOCK_THREAD_CPUTIME_ID``), not wall time: with one
  intra-op thread the op runs entirely on this thread, and when other jobs share the cores the time
  it spends preempted does not count (on a machine with a load of 12 on 2 cores, wall-clock minima
  of millisecond kernels still varied by 12%);
- batching: a sample runs the call ``n`` times back to back and counts ``elapsed / n``, with ``n``
  chosen so that a sample lasts about ``SAMPLE_S``. A 3 us kernel timed one call at a time is
  dominated by timer and interpreter jitter; a batch of a hundred is not. A sample stays short
  (0.5 ms) so that most samples run within one scheduler time slice when other jobs share the
  cores: a preempted sample resumes with caches another process has cooled (2 ms samples left
  12% between repeated profiles at a load of 15 on 2 cores, 0.5 ms ones under 8%).
- warm-up until the call has run for ``WARMUP_S`` (allocator growth, lazy init, cold caches, and
  the CPU clock ramping up), not a single call.
- passes: every kernel is timed in ``PASSES`` short windows spread over the whole run (all kernels
  once, then all again, ...), and keeps its best. A neighbour busy on the other core for a few
  seconds then inflates one window of a kernel, not all of them. A kernel whose best window is not
  confirmed by another within 3% (memory-bound kernels while a neighbour streams memory) gets more
  windows, up to ``EXTRA_PASSES``.

In-place ops (optimizer steps, copies, index writes, ...) update the same inputs call after call:
their speed does not depend on the values, and denormals are flushed to zero while timing so that
drifting values cannot hit the slow path. (Fresh copies per call were tried: for microsecond ops
the copies' allocation and cache traffic made repeated profiles differ by 12-16%.)

Results are cached by kernel key (see ``cache.py``) so a second workload times only the kernels
it does not share. A kernel that cannot be rebuilt or is too large to run here falls back to the
roofline model with this CPU's nominal figures, marked ``source = model``.

Timed alone, a kernel runs faster than inside a training step. Given the trace, the measured
durations are therefore scaled per op class by the in-loop factor of ``inloop`` (the trace's
tasks replayed in order; those timings cached by kernel key too), keeping the isolated timing
beside it (``Result.isolated_us``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from echo.config import Hardware
from echo.profile import cache, inloop, rebuild, roofline
from echo.profile.kernel import Kernel, Result

log = logging.getLogger(__name__)

MEASURE_THREADS = 1     # see module docstring
CLOCK = time.thread_time  # this thread's CPU time, seconds (see module docstring)
# Identifies how timings are taken; cached timings of another method are not reused.
METHOD = "thread-cpu-time/batched/min-of-windows/v1"
WARMUP_S = 0.02         # warm-up time per kernel (at least one call)
SAMPLE_S = 0.0005       # target length of one timed sample (a batch of calls)
MAX_BATCH = 512         # calls per sample, at most
MIN_SAMPLES = 5         # per window; a minimum of fewer samples is still mostly noise
MAX_SAMPLES = 100       # per window
PASSES = 4              # windows per kernel, spread over the run
BUDGET_S = 0.05         # per window, past MIN_SAMPLES (cost: benchmarks/bench_profile.py)
PATIENCE = 10           # a window ends once this many samples in a row did not lower its minimum by 0.5%
CONFIRM = 0.03          # a kernel's best window needs a second one this close ...
EXTRA_PASSES = 6        # ... or it gets up to this many more windows
# Kernels moving more than this are not run here (the machine has 24 GiB); they are modelled instead.
MAX_BYTES = 4 * 2**30


@dataclass(frozen=True)
class Timing:
    duration_us: float
    repeats: int      # calls timed (samples x batch)
    threads: int
    batch: int = 1    # calls per sample
    windows: int = 1  # timing windows it got (see time_kernels)


@contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with ``n`` intra-op threads, restoring the previous setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def time_kernels(kernels: list[Kernel], passes: int = PASSES, on_kernel=None) -> dict[str, Timing | rebuild.Unbuildable]:
    """kernel_key -> the best Timing over its windows, or the Unbuildable that stopped it.

    Pass 1 times every kernel once; each later pass times them all again (a kernel that failed is
    not retried). After ``passes`` passes, a kernel whose best window is not confirmed by a second
    one within ``CONFIRM`` (contention was heavy while it ran) gets up to ``EXTRA_PASSES`` more
    windows, in passes over the unconfirmed kernels only. ``on_kernel(k)`` is called before each
    window (progress)."""
    out: dict[str, Timing | rebuild.Unbuildable] = {}
    windows: dict[str, list[float]] = {}
    todo = list(kernels)
    for i in range(max(1, passes) + EXTRA_PASSES):
        if i >= passes:
            todo = [k for k in todo if k.kernel_key in windows and not _confirmed(windows[k.kernel_key])]
            if not todo:
                break
        for k in todo:
            prev = out.get(k.kernel_key)
            if isinstance(prev, rebuild.Unbuildable):
                continue
            if on_kernel:
                on_kernel(k)
            try:
                t = time_kernel(k)
            except rebuild.Unbuildable as exc:
                out[k.kernel_key] = exc
                continue
            windows.setdefault(k.kernel_key, []).append(t.duration_us)
            if prev is None:
                out[k.kernel_key] = t
            else:
                best = t if t.duration_us < prev.duration_us else prev
                out[k.kernel_key] = Timing(best.duration_us, prev.repeats + t.repeats, t.threads, best.batch,
                                           len(windows[k.kernel_key]))
    return out


def _confirmed(mins: list[float]) -> bool:
    """The two best window minima agree within CONFIRM."""
    if len(mins) < 2:
        return False
    a, b = sorted(mins)[:2]
    return b <= a * (1 + CONFIRM)


def time_kernel(k: Kernel) -> Timing:
    """Minimum per-call CPU time of the rebuilt call over one window of batched samples (raises
    rebuild.Unbuildable when the call cannot be rebuilt or run here)."""
    if k.bytes > MAX_BYTES:
        raise rebuild.Unbuildable(f"moves {k.bytes / 2**30:.1f} GiB, above {MAX_BYTES / 2**30:.0f} GiB")
    call = rebuild.build(k.name, k.args)
    if call.input_bytes > MAX_BYTES:
        raise rebuild.Unbuildable(f"inputs of {call.input_bytes / 2**30:.1f} GiB")
    with torch_threads(MEASURE_THREADS) as threads, torch.no_grad(), _flush_denormal():
        best, calls, batch = _min_time(call)
    return Timing(best * 1e6, calls, threads, batch)


@contextmanager
def _flush_denormal() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _min_time(call: rebuild.Call) -> tuple[float, int, int]:
    """(best seconds per call, calls timed, batch size)."""
    args = call.make_args()
    t0 = CLOCK()
    try:
        call(args)
    except Exception as exc:  # the op rejects the rebuilt inputs: not timeable as encoded
        raise rebuild.Unbuildable(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    first = CLOCK() - t0
    batch = max(1, min(MAX_BATCH, int(SAMPLE_S / max(first, 1e-7))))
    sample = _sampler(call, args, batch)
    warm_until = time.perf_counter() + WARMUP_S
    while time.perf_counter() < warm_until:
        sample()
    # re-size the batch from a warm sample (the first call paid for the cold start)
    per_call = sample() / batch
    new = max(1, min(MAX_BATCH, int(SAMPLE_S / max(per_call, 1e-7))))
    if new != batch:
        batch, sample = new, _sampler(call, args, new)
        sample()
    best, n, since, start = float("inf"), 0, 0, time.perf_counter()
    while n < MAX_SAMPLES and (n < MIN_SAMPLES or (time.perf_counter() - start < BUDGET_S and since < PATIENCE)):
        t = sample() / batch
        since = 0 if t < best * 0.995 else since + 1
        best = min(best, t)
        n += 1
    return best, n * batch, batch


def _sampler(call: rebuild.Call, args: rebuild.Args, batch: int):
    """A function that runs ``batch`` calls and returns their elapsed CPU seconds."""
    def run() -> float:
        t0 = CLOCK()
        for _ in range(batch):
            call(args)
        return CLOCK() - t0
    return run


def measure_kernels(kernels: list[Kernel], hardware: Hardware, cache_dir: Path | None = None,
                    stats: dict | None = None, trace_dir: Path | None = None) -> dict[str, Result]:
    """kernel_key -> Result for every kernel: cached, timed here, or modelled as a fallback;
    with ``trace_dir`` (the trace the kernels come from) measured ones are scaled to their
    in-loop time (``inloop``). ``stats`` (when given) receives what was cached, timed and
    modelled, the timing cost, and the in-loop factors."""
    t0 = time.perf_counter()
    cached = cache.load(cache_dir, MEASURE_THREADS, METHOD) if cache_dir else {}
    todo = [k for k in kernels if k.kernel_key not in cached]
    log.info("profile: %d kernels, %d cached, %d to time (%d thread)",
             len(kernels), len(kernels) - len(todo), len(todo), MEASURE_THREADS)
    results = {k.kernel_key: Result(cached[k.kernel_key], "measured", MEASURE_THREADS, None)
               for k in kernels if k.kernel_key in cached}
    new, fallbacks = _time_all(todo, hardware, results)
    if cache_dir and new:
        cache.store(cache_dir, new, MEASURE_THREADS, METHOD)
    _log_fallbacks(fallbacks, len(kernels))
    loop_stats = in_loop(kernels, results, Path(trace_dir), cache_dir) if trace_dir is not None else None
    if stats is not None:
        elapsed = time.perf_counter() - t0
        stats.update(cached=len(kernels) - len(todo), timed=len(new), modelled=sum(fallbacks.values()),
                     threads=MEASURE_THREADS, timing_s=elapsed,
                     kernels_per_s=len(new) / elapsed if new and elapsed > 0 else None,
                     cache=str(cache_dir) if cache_dir else None)
        if loop_stats is not None:
            stats["inloop"] = loop_stats
    return results


def in_loop(kernels: list[Kernel], results: dict[str, Result], trace_dir: Path, cache_dir: Path | None) -> dict:
    """Scale the measured ``results`` in place by their op class's in-loop factor: replayed
    timings come from the cache (``cache.INLOOP_FILE``) or from replaying the tasks of
    ``trace_dir`` that hold the others. Returns what was done (the profile note's ``inloop``)."""
    t0 = time.perf_counter()
    isolated = {k: r.duration_us for k, r in results.items() if r.source == "measured"}
    names = {k.kernel_key: k.name for k in kernels}
    replayed = cache.load(cache_dir, MEASURE_THREADS, inloop.METHOD, cache.INLOOP_FILE) if cache_dir else {}
    replayed = {k: v for k, v in replayed.items() if k in isolated}
    wanted = set(isolated) - set(replayed)
    new: dict[str, float] = {}
    if wanted:
        new = inloop.replay_in_processes(trace_dir, wanted)
        replayed.update(new)
        if cache_dir and new:
            cache.store(cache_dir, {k: (names[k], us) for k, us in new.items()}, MEASURE_THREADS, inloop.METHOD,
                        cache.INLOOP_FILE)
    factors = inloop.inloop_factors(kernels, isolated, replayed)
    for k in kernels:
        if k.kernel_key in isolated:
            f = factors.get(k.op_class, factors["*"])
            r = results[k.kernel_key]
            results[k.kernel_key] = replace(r, duration_us=r.duration_us * f, isolated_us=r.duration_us,
                                            inloop_factor=f)
    log.info("profile: in-loop factors %s (%d kernels replayed now, %d cached)",
             ", ".join(f"{c} {f:.2f}" for c, f in sorted(factors.items())), len(new), len(replayed) - len(new))
    return {"method": inloop.METHOD, "factors": factors, "replayed": len(new), "cached": len(replayed) - len(new),
            "not_replayed": len(set(isolated) - set(replayed)), "timing_s": time.perf_counter() - t0}


def _time_all(todo: list[Kernel], hardware: Hardware, results: dict[str, Result]) -> tuple[dict, Counter]:
    """Time ``todo`` into ``results``; returns (key -> (name, us) of new timings, fallbacks by op)."""
    new: dict[str, tuple[str, float]] = {}
    fallbacks: Counter = Counter()
    with _progress() as bar:
        task = bar.add_task("timing kernels", total=len(todo) * PASSES)

        def step(k: Kernel) -> None:
            bar.update(task, description=k.name, advance=1)

        timings = time_kernels(todo, PASSES, step)
    for k in todo:
        t = timings[k.kernel_key]
        if isinstance(t, rebuild.Unbuildable):
            log.info("profile: %s (%s) falls back to the model: %s", k.name, k.kernel_key, t)
            est = roofline.estimate(hardware, k)
            results[k.kernel_key] = Result(est.duration_us, "model", 0, est.bound)
            fallbacks[k.name] += 1
        else:
            results[k.kernel_key] = Result(t.duration_us, "measured", t.threads, None)
            new[k.kernel_key] = (k.name, t.duration_us)
    return new, fallbacks


def _progress() -> Progress:
    """A progress bar on stderr, silent when stderr is not a terminal (Snakemake logs, CI)."""
    return Progress(TextColumn("{task.description:<48.48}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), disable=not sys.stderr.isatty())


def _log_fallbacks(fallbacks: Counter, total: int) -> None:
    if fallbacks:
        top = ", ".join(f"{name} x{n}" for name, n in fallbacks.most_common(8))
        log.warning("profile: %d of %d kernels could not be timed here and were modelled: %s",
                    sum(fallbacks.values()), total, top)
