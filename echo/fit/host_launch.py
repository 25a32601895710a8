"""The host's launch pace (``Hardware.host.launch_us``) from real Kineto traces of GPU jobs.

A training step's host thread puts each op on the GPU through a runtime call (cudaLaunchKernel,
cudaMemcpyAsync, cudaMemsetAsync); between two calls it runs the framework (Python, the
dispatcher, the allocator). While it does not wait for the GPU, the interval between its
consecutive calls is the host time per launched op, whatever the GPU is doing: the queue
decouples the two. Waits show up as long intervals (a synchronizing copy, a barrier, the data
loader), so a thread's pace is the median interval of its runs of calls, ignoring intervals of
``BURST_GAP_US`` or more.

The reference folder's ``kineto/`` traces (HolisticTraceAnalysis's test data, A100 jobs) give one
pace per launching thread (the forward thread and autograd's backward thread); they differ by
job, from about 20 us to 110 us, with the framework code each op runs. ``launch_pace_us`` takes
the fastest job's threads: the least host time per op seen in an eager PyTorch step on those
hosts, so the host model errs on the side of a host that keeps up.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from echo.profile.kineto import load_document
from echo.reference import reference_root

# The runtime calls that put one op on a GPU stream.
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaMemcpyAsync", "cudaMemsetAsync"})
BURST_GAP_US = 1000.0  # an interval this long is the host waiting, not launching
MIN_LAUNCHES = 50      # a thread with fewer intervals says little about a pace


def thread_paces(path: Path) -> dict[int, tuple[int, float]]:
    """Per launching thread of the trace at ``path``: (intervals used, median interval in us)."""
    starts: dict[int, list[float]] = defaultdict(list)
    for ev in load_document(path)["traceEvents"]:
        if ev.get("cat") == "cuda_runtime" and ev.get("name") in LAUNCH_CALLS:
            starts[ev["tid"]].append(float(ev["ts"]))
    out = {}
    for tid, ts in starts.items():
        ts.sort()
        gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b - a < BURST_GAP_US]
        if len(gaps) >= MIN_LAUNCHES:
            out[tid] = (len(gaps), statistics.median(gaps))
    return out


def job_paces(reference: Path | None = None) -> dict[str, float]:
    """Per trace of the reference folder's kineto/: the mean over its launching threads of their
    median interval (us)."""
    folder = reference_root(reference) / "kineto"
    paths = sorted(folder.glob("*.json.gz")) + sorted(folder.glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"{folder}: no Kineto traces (*.json.gz) to derive the host launch pace from")
    out = {}
    for p in paths:
        paces = thread_paces(p)
        if paces:
            out[p.name] = statistics.mean(m for _, m in paces.values())
    return out


def launch_pace_us(reference: Path | None = None) -> tuple[float, str]:
    """(the host launch pace in us, the sentence saying where it comes from): the fastest job's."""
    paces = job_paces(reference)
    name = min(paces, key=paces.get)
    others = ", ".join(f"{n} {v:.0f}" for n, v in sorted(paces.items()) if n != name)
    return paces[name], (f"median interval between a launching thread's consecutive runtime launch calls "
                         f"(intervals under {BURST_GAP_US:.0f} us), mean over the threads of {name}, the fastest "
                         f"of the reference folder's Kineto traces (echo.fit.host_launch; the others, us: {others})")
