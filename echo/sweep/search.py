"""Design-space search: every layout of a sweep file ranked, each rank composed from layer templates.

A sweep (``echo.sweep.spec``) traces each layout's ranks through the workflow, half a minute a
rank on two cores; a search answers the same question for thousands of layouts in one job:

1. expand the spec, dropping with key and reason what cannot work (``spec.expand``), before any
   tracing; layouts that layer templates cannot stand for yet (``echo.trace.template.NotComposable``:
   FSDP, FP8, Hugging Face models) are traced in full instead, rank by rank, up to the spec's
   ``trace_in_full`` (more is refused with the reason, before any tracing);
2. trace each distinct template job once (``echo.trace.compose.cached_pieces``, shared by every
   layout with the same block signature) and each distinct gradient-reduction tail once;
3. per layout, in worker processes: compose its ranks (``compose_trace``), group them
   (``echo.dedup``), cost their kernels (``echo.profile``), simulate every topology
   (``echo.simulate``) and keep the summary rows; the layout's files are deleted after;
4. check composition (before step 3, so that a wrong graph fails in minutes): for ``verify``
   layouts spread over the search, one rank each is traced
   in full and compared op by op with its composed graph; a difference fails the search and
   names the layout;
5. rank: those that fit by step time, those that do not with the memory term that overflows,
   and the Pareto fronts of step time against memory and against GPU count.

The steps are jobs of their own (``echo.sweep.search_jobs``: a plan, template jobs, checks,
layout shards), which ``run_search`` runs in one process and the Snakemake rules as jobs.

Outputs in the search folder: ``layouts.parquet`` (every candidate, kept or dropped with why),
``ranking.parquet``, ``pareto.parquet``, ``verify.parquet`` and the two front figures.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa

from echo.sweep.rank import RANKING, layouts_table
from echo.sweep.search_jobs import (  # noqa: F401 (the search's API: echo.cli, workflow/scripts, tests)
    Plan,
    SearchError,
    _Progress,
    evaluate,
    expand_search,
    make_plan,
    refusal,
    rows_table,
    shard_templates,
    trace_templates,
    traced_in_full,
    verify_composition,
)
from echo.sweep.spec import AXES, Expansion

# the memory terms of a summary row, in the order a rank fills its device (echo.simulate.summary)
MEMORY_TERMS = ("state", "activations", "working", "fragmentation", "framework")
SEARCH_RANKING = pa.schema([*RANKING, ("gpus", pa.int64()), ("overflow", pa.string())])
PARETO = pa.schema([("front", pa.string()), ("layout", pa.string()), ("topology", pa.string()),
                    ("gpus", pa.int64()), ("step_time_s", pa.float64()), ("peak_mem_gib", pa.float64())])
VERIFY = pa.schema([("layout", pa.string()), ("rank", pa.int64()), ("ops", pa.int64()),
                    ("equal", pa.bool_()), ("difference", pa.string())])


def _source_digest() -> str:
    """A hash of the echo package's sources: partial results of another version are not reused."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


class _Partial:
    """Finished layouts' summary rows, kept in ``{out}/partial/`` as they come, so that a search
    killed half-way resumes where it was (for the same spec and code) instead of starting over."""

    EVERY = 32

    def __init__(self, out_dir: Path, exp: Expansion):
        import json

        self.folder = Path(out_dir) / "partial"
        key = json.dumps({"spec": exp.sweep.model_dump(), "code": _source_digest()}, sort_keys=True, default=str)
        if (self.folder / "key.json").is_file() and (self.folder / "key.json").read_text() != key:
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "key.json").write_text(key)
        from echo.io import read_parquet

        self.rows = [r for p in sorted(self.folder.glob("rows-*.parquet")) for r in read_parquet(p).to_pylist()]
        self.pending: list[dict] = []

    @property
    def done(self) -> set[str]:
        return {r["layout"] for r in self.rows}

    def add(self, rows: list[dict], last: bool = False) -> None:
        from echo.io import write_parquet

        self.pending += rows
        if self.pending and (last or len(self.pending) >= self.EVERY):
            n = len(list(self.folder.glob("rows-*.parquet")))
            write_parquet(rows_table(self.pending), self.folder / f"rows-{n:05d}.parquet")
            self.rows += self.pending
            self.pending = []


def overflow(row: dict, capacity_gib: float) -> str | None:
    """The memory term at which a rank that does not fit passes the device's capacity."""
    if row["fits"]:
        return None
    total = 0.0
    for term in MEMORY_TERMS:
        total += row.get(f"mem_{term}_gib") or 0.0
        if total > capacity_gib:
            return f"{term} ({total:.1f} GiB with the terms before it, of {capacity_gib:.0f})"
    return f"device memory ({row.get('device_mem_gib', 0.0):.1f} GiB of {capacity_gib:.0f})"


def pareto(rows: list[dict], x: str) -> list[dict]:
    """The fitting rows no other fitting row beats in both step time and ``x``."""
    fit = sorted((r for r in rows if r["fits"]), key=lambda r: (r[x], r["step_time_s"]))
    out, best = [], float("inf")
    for r in fit:
        if r["step_time_s"] < best:
            out.append(r)
            best = r["step_time_s"]
    return out


def rank_rows(exp: Expansion, rows: list[dict], capacity_gib: float, full: set[str] = frozenset()) -> pa.Table:
    """The ranking table; ``full``: the layouts traced in full (the others were composed)."""
    kept = {c.name: c for c in exp.kept}
    out = []
    for r in rows:
        c = kept[r["layout"]]
        out.append({"layout": c.name, "tokens": c.name.split("--", 1)[1], "hardware": r["hardware"],
                    "topology": r["topology"], **{a: c.values.get(a) for a in AXES},
                    **{f.name: r.get(f.name) for f in RANKING if f.name in r and f.name not in ("rank", "layout")},
                    "bubble_fraction": r.get("bubble_fraction"), "trace": "traced" if c.name in full else "composed",
                    "gpus": r["world_size"], "overflow": overflow(r, capacity_gib)})
    # those that fit by step time; those that do not by the memory they need (most were not simulated)
    out.sort(key=lambda r: (not r["fits"], r["step_time_s"] if r["fits"] else r["peak_mem_gib"], r["layout"],
                            r["topology"]))
    for i, r in enumerate(out):
        r["rank"] = i + 1 if r["fits"] else None
    return pa.Table.from_pylist(out, schema=SEARCH_RANKING)


def finish(plan: Plan, rows: list[dict], checks: list[dict], capacity_gib: float, out_dir: Path) -> dict:
    """The ranking, the fronts, the checks and the two figures into ``out_dir``; returns the
    figures a caller prints."""
    from echo.io import write_parquet
    from echo.report.fronts import search_fronts

    exp = plan.exp
    out_dir = Path(out_dir)
    write_parquet(layouts_table(exp), out_dir / "layouts.parquet")
    ranking = rank_rows(exp, rows, capacity_gib, set(plan.full))
    write_parquet(ranking, out_dir / "ranking.parquet", SEARCH_RANKING)
    ranked = ranking.to_pylist()
    fronts = [{**{k: r[k] for k in ("layout", "topology", "gpus", "step_time_s", "peak_mem_gib")}, "front": front}
              for front, x in (("memory", "peak_mem_gib"), ("gpus", "gpus")) for r in pareto(ranked, x)]
    write_parquet(pa.Table.from_pylist(fronts, schema=PARETO), out_dir / "pareto.parquet", PARETO)
    write_parquet(pa.Table.from_pylist(checks, schema=VERIFY), out_dir / "verify.parquet", VERIFY)
    search_fronts(ranked, fronts, out_dir, title=f"{plan.name}: {exp.sweep.description}")
    return {"layouts": len(exp.candidates), "kept": len(exp.kept), "ranked": len(ranked), "traced": len(plan.full),
            "fit": sum(1 for r in ranked if r["fits"]), "verified": len(checks),
            "best": [r for r in ranked if r["rank"] is not None][:3]}


def run_search(name: str, out_dir: Path, processes: int = 1, root: Path | None = None,
               cache_dir: Path | None = None, verify: int | None = None, calibrate_dir: Path | None = None) -> dict:
    """Search ``config/sweeps/{name}.yaml`` (or the spec file ``name``) in this process
    (``processes`` at once); write the tables and figures into ``out_dir``. Each topology is
    calibrated into ``calibrate_dir`` (default ``out_dir/calibrate``) unless it is there."""
    from echo.config import load_hardware, load_topology
    from echo.network import run_calibrate

    t0 = time.perf_counter()
    plan = make_plan(name, root, shards=1)
    exp = plan.exp
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hardware = load_hardware(exp.sweep.hardware, root)
    topologies = [load_topology(t, root) for t in exp.sweep.topologies]
    cache = Path(cache_dir or out_dir / "templates")
    calib = {}
    for topo in topologies:
        calib[topo.name] = Path(calibrate_dir or out_dir / "calibrate") / topo.name
        if not (calib[topo.name] / "collectives.parquet").is_file():
            run_calibrate(topo, calib[topo.name])
    progress = _Progress(name, len(exp.kept))
    print(f"search {name}: {len(exp.kept)} layouts, {len(plan.templates)} template jobs"
          + (f", {len(plan.full)} layouts traced in full (templates cannot stand for them: "
             f"{sorted(set(plan.full.values()))[0]})" if plan.full else ""), file=sys.stderr, flush=True)
    t = time.perf_counter()
    progress.templates = trace_templates(plan, cache, processes)
    phases = {"templates_s": time.perf_counter() - t}
    # composition is checked before the layouts are simulated: a wrong graph fails in minutes
    t = time.perf_counter()
    checks = verify_composition(plan.composed, cache, exp.sweep.verify if verify is None else verify,
                                out_dir / "work", processes)
    phases["verify_s"] = time.perf_counter() - t
    print(f"search {name}: {progress.templates} template jobs traced in {phases['templates_s']:.0f} s, "
          f"{len(checks)} checks in {phases['verify_s']:.0f} s", file=sys.stderr, flush=True)
    partial = _Partial(out_dir, exp)
    todo = [i for i, c in enumerate(exp.kept) if c.name not in partial.done]
    progress.start(len(exp.kept) - len(todo))
    done = len(exp.kept) - len(todo)

    def took(rows: list[dict]) -> None:
        nonlocal done
        partial.add(rows)
        done += len({r["layout"] for r in rows})
        progress.show(done)

    t = time.perf_counter()
    phases.update(evaluate(plan, todo, cache, hardware, topologies, calib, out_dir / "work", processes, took))
    partial.add([], last=True)
    progress.show(len(exp.kept), force=True)
    t_simulated = time.perf_counter()
    shutil.rmtree(out_dir / "work", ignore_errors=True)
    res = finish(plan, partial.rows, checks, hardware.memory_gib, out_dir)
    shutil.rmtree(partial.folder)  # everything is in ranking.parquet now
    return {**res, **phases, "prepare_s": t - t0, "simulate_s": t_simulated - t, "wall_s": time.perf_counter() - t0}
