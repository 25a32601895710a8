"""Runs of back-to-back kernels, replayed at once.

Most of a task's ops are kernels issued one after another with nothing between them the compute
stream waits for. A *run* is such a stretch of a program: compute ops with no collective, p2p
transfer, dependency wait or host sync among them. While a run executes the device starts no
transfer, so its busy intervals (the transfers in flight that slow compute: ``gpu.Gpu``) are
fixed, and the run's end follows from two prefix sums of its kernels, their durations alone and
stretched by their overlap slowdown, by walking the busy intervals (``Gpu.stretch_run``) instead
of stretching kernel after kernel. That is the per-kernel replay exactly (up to rounding) as long
as no kernel waits for its launch: the host must stay ahead of the GPU through the run (``room``);
a run the host may fall behind on is replayed kernel by kernel.

This is what keeps schedules whose tasks overlap communication with hundreds of kernels (DualPipe's
paired MoE chunks) as fast to simulate as those replayed from their clean replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelRuns:
    """A program's runs of kernels, as prefix sums over its ops (index i: before op i)."""

    end: tuple[int, ...]
    """Per op: the end (exclusive) of the run it starts; itself when the op is not in a run."""
    work: tuple[float, ...]
    """Prefix sums of the ops' kernel times (0 for anything but a kernel)."""
    slow: tuple[float, ...]
    """Prefix sums of the kernel times beside a transfer, (1 + s) x each."""
    slowed: tuple[float, ...]
    """Prefix sums of the slowdown already inside kernel times (``Op.slowed_us``)."""
    room: tuple[float, ...]
    """Per op: how far the host's clock may be ahead of the GPU's at it (host minus GPU time)
    with no kernel of the run from it waiting for its launch (the GPU is assumed no faster
    than its kernels alone, so this is a safe bound)."""

    def __post_init__(self):
        n = len(self.end)
        if not len(self.work) == len(self.slow) == len(self.slowed) == n + 1 or len(self.room) != n:
            raise ValueError(f"kernel runs of {n} ops with prefix sums of other lengths")

    @classmethod
    def of(cls, steps: Sequence[tuple], waits: Mapping[int, Sequence[int]], host_before: Sequence[float],
           compute: int) -> KernelRuns:
        """The runs of a program's compiled ``steps`` ((code, duration, s, op, flow) per op);
        ``waits``: the ops that wait for a transfer; ``host_before``: host time of the ops before
        each index; ``compute``: the code of a kernel."""
        n = len(steps)
        work, slow, slowed = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1)
        in_run = [False] * n
        for i, (code, dur, s, op, _) in enumerate(steps):
            kernel = code == compute
            in_run[i] = kernel and op.seq not in waits and not op.host_sync
            work[i + 1] = work[i] + (dur if kernel else 0.0)
            slow[i + 1] = slow[i] + ((1.0 + max(s, 0.0)) * dur if kernel else 0.0)
            slowed[i + 1] = slowed[i] + (op.slowed_us if kernel else 0.0)
        end, room = list(range(n)), [0.0] * n
        lowest = float("inf")  # min over the run's later ops k of work[k] - host_before[k + 1]
        for i in range(n - 1, -1, -1):
            if not in_run[i]:
                lowest = float("inf")
                continue
            end[i] = end[i + 1] if i + 1 < n and in_run[i + 1] else i + 1
            # op k of the run is launched at host + (host_before[k+1] - host_before[i]) and
            # reached by the GPU no sooner than t + (work[k] - work[i])
            lowest = min(lowest, work[i] - host_before[i + 1])
            room[i] = lowest - (work[i] - host_before[i])
        return cls(tuple(end), tuple(work), tuple(slow), tuple(slowed), tuple(room))
