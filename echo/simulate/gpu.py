"""One device's physics, shared by both engines: streams, overlap slowdown, link sharing.

- Streams: ``comm`` (non-blocking collectives: gradient buckets, prefetches), ``p2p_fwd`` and
  ``p2p_bwd`` (pipeline sends, one queue per direction). Work on a stream runs in issue order.
- Overlap slowdown: while any transfer this device issued is in flight (a collective on the comm
  stream or a pipeline send), a compute kernel of class c runs at ``1 / (1 + s_c)`` of its
  speed, so a kernel of ``T0`` of which a fraction ``r`` of the work overlaps takes
  ``(1 - r) T0 + r T0 (1 + s)`` (``echo.overlap``). Blocking collectives (the compute stream
  waits for them) overlap no compute. The receiving side of a pipeline transfer is not counted:
  its kernel mostly runs while the receiver waits for the data.
- Contention: a transfer is a flow (``Flow``): a latency, then ``work_us`` of data at full speed
  during which it loads links (each GPU's NVLink port and NIC, per direction) by a fraction of
  their capacity. The network model says which links and how much (``echo.network.contention``'s
  ``flow_of``); without it a transfer fills its device's ``nic`` or ``nvlink``. Transfers that
  overlap share their links max-min fairly (``echo.network.contention.max_min_rates``).

Everything is causal: a device's state only changes at or after the time its compute stream has
reached, so the schedule-level engine (one device per pipeline stage) and the full engine (one
per rank) can both advance devices one task at a time. For the same reason sharing is decided
when a transfer starts: it gets its max-min share beside the transfers in flight, which keep
the ends they were given (a causal engine cannot move an end another stage has already waited
on). While they overlap the links then carry up to (n + 1) / n of their capacity: that errs on
the fast side by at most the overlap; FIFO (the other causal choice) would make a pipeline send
queue behind whole gradient buckets.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from echo.network.contention import max_min_rates


@dataclass(frozen=True)
class Flow:
    """One transfer as link sharing sees it."""

    latency_us: float
    work_us: float                         # data at full (standalone) speed
    loads: tuple[tuple[tuple, float], ...]  # (link, fraction of its capacity used at full speed)

    @property
    def solo_us(self) -> float:
        return self.latency_us + self.work_us

    @cached_property
    def load_map(self) -> Mapping[tuple, float]:
        """``loads`` as a mapping, built once (an all-to-all loads hundreds of links); never mutated."""
        return dict(self.loads)


class InFlight(NamedTuple):
    """A transfer in flight (a named tuple: a step makes tens of thousands)."""

    start: float
    data_start: float
    end: float
    loads: Mapping[tuple, float]


# (transfers in flight, start, flow) -> end of the flow. The hook for other sharing policies.
LinkSharing = Callable[[Sequence[InFlight], float, Flow], float]


def max_min_share(inflight: Sequence[InFlight], start: float, flow: Flow) -> float:
    """End of ``flow`` started at ``start``: its latency, then its data at the max-min fair rate
    it gets beside the transfers in flight (recomputed whenever one of them starts or ends its
    data phase); see the module docstring."""
    t = start + flow.latency_us
    left = flow.work_us
    if left <= 0:
        return t
    loads = flow.load_map
    others = [f for f in inflight if f.end > t]
    while True:
        active = [f for f in others if f.data_start <= t < f.end]
        nxt = min((p for f in others for p in (f.data_start, f.end) if p > t), default=None)
        rate = max_min_rates([f.loads for f in active] + [loads])[-1] if active else 1.0
        if rate > 0 and (nxt is None or t + left / rate <= nxt):
            return t + left / rate
        if nxt is None:
            raise RuntimeError("link sharing: a transfer cannot progress (a link with no capacity?)")
        left -= rate * (nxt - t)
        t = nxt


def no_sharing(inflight: Sequence[InFlight], start: float, flow: Flow) -> float:
    """Links of unlimited capacity: every transfer takes its standalone time."""
    return start + flow.solo_us


def fair_share(flows: Sequence[tuple[float, float]], start: float, solo_us: float) -> float:
    """``max_min_share`` for transfers that each fill one link: (start, end) of those in flight."""
    return max_min_share([InFlight(a, a, b, {"link": 1.0}) for a, b in flows], start,
                         Flow(0.0, solo_us, (("link", 1.0),)))


def _end(interval: tuple[float, float]) -> float:
    return interval[1]


class Gpu:
    """State of one device (symmetric mode: one pipeline stage, shared by its ranks)."""

    __slots__ = ("stream_free", "flows", "busy", "busy_until", "sharing", "host")

    def __init__(self, sharing: LinkSharing = max_min_share):
        self.stream_free: dict[str, float] = {}
        self.flows: list[InFlight] = []  # transfers in flight, for link sharing
        self.busy: list[tuple[float, float]] = []  # the same, for the overlap slowdown
        self.busy_until = 0.0            # max end over busy
        self.sharing = sharing
        self.host = 0.0                  # the launching host's clock (program.py): synced at the step's start

    def idle_after(self, t: float) -> bool:
        """No transfer of this device is in flight at or after ``t``, and no stream is behind it."""
        return self.busy_until <= t and all(f <= t for f in self.stream_free.values())

    def prune(self, now: float) -> None:
        """Forget transfers that ended by ``now`` (the compute stream's time: nothing issued
        later can start before it)."""
        if self.busy and self.busy[0][1] <= now:
            del self.busy[:bisect_right(self.busy, now, key=_end)]
            self.flows = [f for f in self.flows if f.end > now]

    # --- transfers ----------------------------------------------------------------------------
    def ready(self, stream: str, t: float) -> float:
        """Earliest start of work issued on ``stream`` at ``t``."""
        return max(t, self.stream_free.get(stream, 0.0))

    def share(self, start: float, flow: Flow) -> float:
        return self.sharing(self.flows, start, flow)

    def occupy(self, stream: str, flow: Flow, start: float, end: float) -> None:
        """Record a transfer on ``stream`` during [start, end]."""
        self.stream_free[stream] = max(self.stream_free.get(stream, 0.0), end)
        if end > start:
            self.flows.append(InFlight(start, min(start + flow.latency_us, end), end, flow.load_map))
            insort(self.busy, (start, end), key=_end)
            self.busy_until = max(self.busy_until, end)

    def occupy_all(self, transfers: Sequence[tuple[str, Flow, float, float]]) -> None:
        """``occupy`` of each (stream, flow, start, end) in turn, the busy list sorted once (a
        shifted clean replay puts dozens back at a time)."""
        added = []
        for stream, flow, start, end in transfers:
            if self.stream_free.get(stream, 0.0) < end:
                self.stream_free[stream] = end
            if end > start:
                self.flows.append(InFlight(start, min(start + flow.latency_us, end), end, flow.load_map))
                added.append((start, end))
                self.busy_until = max(self.busy_until, end)
        if added:
            self.busy += added
            self.busy.sort(key=_end)  # stable: as inserting each after its equals

    def transfer(self, stream: str, flow: Flow, t: float) -> tuple[float, float]:
        """Issue a transfer at ``t``: queued on its stream, sharing its links. Returns (start, end)."""
        start = self.ready(stream, t)
        end = self.share(start, flow)
        self.occupy(stream, flow, start, end)
        return start, end

    # --- compute ------------------------------------------------------------------------------
    def _edge(self, t: float) -> tuple[bool, float | None]:
        """Where the slowdown next changes after ``t``: (True, when the transfers in flight at ``t``
        have all ended) or (False, when the next one starts; None if none does)."""
        cover = max((b for a, b in self.busy if a <= t < b), default=None)
        if cover is not None:
            return True, cover
        return False, min((a for a, b in self.busy if a > t), default=None)

    def stretch(self, t: float, work_us: float, s: float) -> float:
        """End of a kernel of ``work_us`` started at ``t`` that runs at 1 / (1 + s) of its speed
        while any transfer of this device is in flight."""
        if s <= 0.0 or self.busy_until <= t or work_us <= 0.0:
            return t + work_us
        rate = 1.0 + s
        left = work_us
        while left > 0.0:
            covered, edge = self._edge(t)
            if covered:
                if left * rate <= edge - t:
                    return t + left * rate
                left -= (edge - t) / rate
                t = edge
            else:  # edge: the next transfer's start
                if edge is None or t + left <= edge:
                    return t + left
                left -= edge - t
                t = edge
        return t

    def stretch_run(self, t: float, work: Sequence[float], slow: Sequence[float], lo: int, hi: int) -> float:
        """End of kernels lo..hi-1 run back to back from ``t``: ``stretch`` of each in turn, with
        no transfer starting meanwhile (``echo.simulate.kernel_runs``). ``work`` and ``slow``: prefix
        sums of their durations alone and beside a transfer ((1 + s) x each). Walks the busy
        intervals, converting progress between the two sums, not the kernels."""
        w, w_end = work[lo], work[hi]
        if self.busy_until <= t:
            return t + (w_end - w)
        x, x_end = slow[lo], slow[hi]
        while True:
            covered, edge = self._edge(t)
            if covered:
                if x_end - x <= edge - t:
                    return t + (x_end - x)
                x += edge - t
                w = _along(slow, work, x, lo, hi)
                t = edge
            else:  # edge: the next transfer's start
                if edge is None or w_end - w <= edge - t:
                    return t + (w_end - w)
                w += edge - t
                x = _along(work, slow, w, lo, hi)
                t = edge


def _along(src: Sequence[float], dst: Sequence[float], v: float, lo: int, hi: int) -> float:
    """The point of prefix sums ``dst`` that corresponds to ``v`` on prefix sums ``src`` (both
    piecewise linear in the same ops lo..hi-1)."""
    k = bisect_right(src, v, lo, hi + 1) - 1  # the op v falls in: the last boundary at or before it
    if k >= hi:
        return dst[hi]
    return dst[k] + (v - src[k]) * (dst[k + 1] - dst[k]) / (src[k + 1] - src[k])
