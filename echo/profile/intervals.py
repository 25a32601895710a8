"""Time intervals of a GPU timeline: merged, measured and intersected (the imported traces'
streams, concurrency and exposed communication)."""

from __future__ import annotations

Interval = tuple[float, float]


def merge(intervals: list[Interval]) -> list[Interval]:
    """Sorted disjoint intervals covering ``intervals``."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(merged: list[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in merged)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
