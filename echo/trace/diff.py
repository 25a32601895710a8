"""What differs between two traced workloads (e.g. zero 1 vs zero 3): per role, op counts by
name and phase, FLOPs, and collectives by kind, op, phase and bytes. ``python -m echo diff A B``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from echo.io import read_parquet


def _profile(trace_dir: Path) -> dict[str, Counter]:
    roles = {r["rank"]: r["role"] for r in read_parquet(trace_dir / "ranks.parquet").to_pylist()}
    out: dict[str, Counter] = {}
    for r in read_parquet(trace_dir / "ops.parquet", columns=["rank", "name", "phase", "shapes"]).to_pylist():
        out.setdefault(roles[r["rank"]], Counter())[("op", r["phase"], r["name"], r["shapes"])] += 1
    comms = read_parquet(trace_dir / "comms.parquet",
                          columns=["rank", "op", "group_kind", "group_size", "phase", "bytes"]).to_pylist()
    for r in comms:
        key = ("collective", r["phase"], f'{r["op"]} {r["group_kind"]}{r["group_size"]}', str(r["bytes"]))
        out.setdefault(roles[r["rank"]], Counter())[key] += 1
    return out


def diff(a: Path, b: Path) -> list[dict]:
    """Rows (role, what, phase, name, detail, count_a, count_b) where the two traces differ."""
    pa_, pb = _profile(Path(a)), _profile(Path(b))
    rows = []
    for role in sorted(set(pa_) | set(pb)):
        ca, cb = pa_.get(role, Counter()), pb.get(role, Counter())
        for key in sorted(set(ca) | set(cb)):
            if ca[key] != cb[key]:
                what, phase, name, detail = key
                rows.append({"role": role, "what": what, "phase": phase, "name": name, "detail": detail,
                             "count_a": ca[key], "count_b": cb[key]})
    return rows
