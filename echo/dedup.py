"""dedup: collapse symmetric ranks into classes, so cost follows distinct ranks, not world size.

Every rank of the world gets the class of its role's traced representative (ranks of one role
differ only in which peers their groups hold, which the canonical hash ignores). Distinct roles
whose graphs hash equal (e.g. the middle pipeline stages) share a class. ``workload.verify``
extra ranks, sampled deterministically among the untraced ones, are traced and must hash like
their class, or dedup fails loudly.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pyarrow as pa

from echo.artifacts import RANK_CLASSES, TRACED_RANKS
from echo.config.workload import Workload
from echo.io import read_parquet, write_parquet
from echo.trace import trace_ranks
from echo.training.layout import Layout

log = logging.getLogger(__name__)


class AsymmetryError(RuntimeError):
    """A sampled rank's graph differs from its class's: deduplication would be wrong."""


def classes(traced: pa.Table) -> dict[str, tuple[int, int, str]]:
    """role -> (class_id, representative rank, graph hash); class ids in order of first hash."""
    ids: dict[str, tuple[int, int]] = {}
    out = {}
    for row in sorted(traced.to_pylist(), key=lambda r: r["rank"]):
        cid, rep = ids.setdefault(row["graph_hash"], (len(ids), row["rank"]))
        out[row["role"]] = (cid, rep, row["graph_hash"])
    return out


def rank_classes(w: Workload, traced: pa.Table) -> pa.Table:
    """One row per rank of the world."""
    layout, by_role = Layout(w.parallel), classes(traced)
    cols: dict[str, list] = {f.name: [] for f in RANK_CLASSES}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        cid, rep, digest = by_role[layout.role_of(rank)]
        for k, v in (("rank", rank), ("class_id", cid), ("representative", rep), ("graph_hash", digest),
                     ("pp_rank", c.pp), ("tp_rank", c.tp), ("dp_rank", c.dp), ("cp_rank", c.cp), ("node", -1)):
            cols[k].append(v)
    return pa.table(cols, schema=RANK_CLASSES)


def sample_ranks(w: Workload, traced: pa.Table, k: int, seed: int = 0) -> list[int]:
    done = set(traced.column("rank").to_pylist())
    pool = [r for r in range(w.world_size) if r not in done]
    return sorted(random.Random(seed).sample(pool, min(k, len(pool))))


def verify(w: Workload, table: pa.Table, trace_dir: Path, k: int) -> list[int]:
    """Trace ``k`` sampled ranks and check each hashes like its class; returns the ranks checked."""
    ranks = sample_ranks(w, read_parquet(trace_dir / "ranks.parquet", TRACED_RANKS), k)
    if not ranks:
        return []
    got = trace_ranks(w, ranks, trace_dir)["ranks"]
    expected = dict(zip(table.column("rank").to_pylist(), table.column("graph_hash").to_pylist(), strict=True))
    for rank, digest in zip(got.column("rank").to_pylist(), got.column("graph_hash").to_pylist(), strict=True):
        if digest != expected[rank]:
            raise AsymmetryError(f"rank {rank} of {w.name} hashes {digest}, its class {expected[rank]}: "
                                 "ranks of one role do not run the same graph")
    log.info("verified ranks %s against their classes", ranks)
    return ranks


def run_dedup(workload: Workload, trace_dir: Path, out_path: Path) -> None:
    trace_dir = Path(trace_dir)
    table = rank_classes(workload, read_parquet(trace_dir / "ranks.parquet", TRACED_RANKS))
    verify(workload, table, trace_dir, workload.verify)
    write_parquet(table, out_path, RANK_CLASSES)
