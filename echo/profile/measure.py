"""Time kernels on this CPU: rebuild each call, run it single-threaded, keep the fastest repeat.

One thread and the minimum of several repeats: on the project's shared 2-core machines timings
with 2 threads varied up to 20x at p90, single-threaded minima were stable to about 1.6x
(TRACING-NOTES). Results are cached by kernel key (see ``cache.py``) so a second workload times
only the kernels it does not share. A kernel that cannot be rebuilt or is too large to run here
falls back to the roofline model with this CPU's nominal figures, marked ``source = model``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from echo.config import Hardware
from echo.profile import cache, rebuild, roofline
from echo.profile.kernel import Kernel, Result

log = logging.getLogger(__name__)

MEASURE_THREADS = 1     # see module docstring
WARMUP = 1              # first call pays allocator growth, lazy init and cold caches
MIN_REPEATS = 3         # a minimum of fewer runs is still mostly noise
MAX_REPEATS = 25        # enough for microsecond kernels, whose runs are nearly free
BUDGET_S = 0.25         # per kernel, past MIN_REPEATS: ~200 keys in about a minute
# Kernels moving more than this are not run here (the machine has 24 GiB and mutating ops need
# fresh copies); they are modelled instead.
MAX_BYTES = 4 * 2**30


@dataclass(frozen=True)
class Timing:
    duration_us: float
    repeats: int
    threads: int


@contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with ``n`` intra-op threads, restoring the previous setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def time_kernel(k: Kernel) -> Timing:
    """Minimum wall time of the rebuilt call over repeats (raises rebuild.Unbuildable)."""
    if k.bytes > MAX_BYTES:
        raise rebuild.Unbuildable(f"moves {k.bytes / 2**30:.1f} GiB, above {MAX_BYTES / 2**30:.0f} GiB")
    call = rebuild.build(k.name, k.args)
    if call.input_bytes > MAX_BYTES:
        raise rebuild.Unbuildable(f"inputs of {call.input_bytes / 2**30:.1f} GiB")
    with torch_threads(MEASURE_THREADS) as threads, torch.no_grad():
        best, n = _min_time(call)
    return Timing(best * 1e6, n, threads)


def _min_time(call: rebuild.Call) -> tuple[float, int]:
    args = call.make_args()
    try:
        for _ in range(WARMUP):
            call(args)
    except Exception as exc:  # the op rejects the rebuilt inputs: not timeable as encoded
        raise rebuild.Unbuildable(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
    best, n, start = float("inf"), 0, time.perf_counter()
    while n < MAX_REPEATS and (n < MIN_REPEATS or time.perf_counter() - start < BUDGET_S):
        if call.mutates:
            args = call.make_args()  # in-place updates run on fresh inputs, like the traced step
        t0 = time.perf_counter()
        call(args)
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best, n


def measure_kernels(kernels: list[Kernel], hardware: Hardware, cache_dir: Path | None = None) -> dict[str, Result]:
    """kernel_key -> Result for every kernel: cached, timed here, or modelled as a fallback."""
    cached = cache.load(cache_dir, MEASURE_THREADS) if cache_dir else {}
    todo = [k for k in kernels if k.kernel_key not in cached]
    log.info("profile: %d kernels, %d cached, %d to time (%d thread)",
             len(kernels), len(kernels) - len(todo), len(todo), MEASURE_THREADS)
    results = {k.kernel_key: Result(cached[k.kernel_key], "measured", MEASURE_THREADS, None)
               for k in kernels if k.kernel_key in cached}
    new, fallbacks = _time_all(todo, hardware, results)
    if cache_dir and new:
        cache.store(cache_dir, new, MEASURE_THREADS)
    _log_fallbacks(fallbacks, len(kernels))
    return results


def _time_all(todo: list[Kernel], hardware: Hardware, results: dict[str, Result]) -> tuple[dict, Counter]:
    """Time ``todo`` into ``results``; returns (key -> (name, us) of new timings, fallbacks by op)."""
    new: dict[str, tuple[str, float]] = {}
    fallbacks: Counter = Counter()
    with _progress() as bar:
        task = bar.add_task("timing kernels", total=len(todo))
        for k in todo:
            bar.update(task, description=k.name)
            try:
                t = time_kernel(k)
            except rebuild.Unbuildable as exc:
                log.info("profile: %s (%s) falls back to the model: %s", k.name, k.kernel_key, exc)
                est = roofline.estimate(hardware, k)
                results[k.kernel_key] = Result(est.duration_us, "model", 0, est.bound)
                fallbacks[k.name] += 1
            else:
                results[k.kernel_key] = Result(t.duration_us, "measured", t.threads, None)
                new[k.kernel_key] = (k.name, t.duration_us)
            bar.advance(task)
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
