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

Outputs in the search folder: ``layouts.parquet`` (every candidate, kept or dropped with why),
``ranking.parquet``, ``pareto.parquet``, ``verify.parquet`` and the two front figures.
"""

from __future__ import annotations

import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from echo.config.workload import Workload
from echo.errors import ConfigError
from echo.sweep.rank import RANKING, layouts_table
from echo.sweep.spec import AXES, Candidate, Expansion, expand, load_sweep

# the memory terms of a summary row, in the order a rank fills its device (echo.simulate.summary)
MEMORY_TERMS = ("state", "activations", "working", "fragmentation", "framework")
SEARCH_RANKING = pa.schema([*RANKING, ("gpus", pa.int64()), ("overflow", pa.string())])
PARETO = pa.schema([("front", pa.string()), ("layout", pa.string()), ("topology", pa.string()),
                    ("gpus", pa.int64()), ("step_time_s", pa.float64()), ("peak_mem_gib", pa.float64())])
VERIFY = pa.schema([("layout", pa.string()), ("rank", pa.int64()), ("ops", pa.int64()),
                    ("equal", pa.bool_()), ("difference", pa.string())])


class SearchError(RuntimeError):
    """A search that cannot be trusted (a composed graph differs from its full trace)."""


def refusal(w: Workload) -> str | None:
    """Why layer templates cannot stand for ``w``'s ranks (None: they can)."""
    from echo.trace.template import NotComposable, template_workload

    try:
        template_workload(w, 3)
    except NotComposable as exc:
        return f"{exc.key}: {exc}"
    return None


def expand_search(name: str, root: Path | None = None) -> Expansion:
    from echo.trace import check_traceable

    sweep, path = load_sweep(name, root)
    return expand(sweep, path, root, traceable=check_traceable)


def traced_in_full(exp: Expansion) -> dict[str, str]:
    """Kept layouts that templates cannot stand for -> why; refused past the spec's
    ``trace_in_full`` (each is traced rank by rank, as the workflow traces a sweep's layouts)."""
    out = {c.name: why for c in exp.kept if (why := refusal(c.workload))}
    if len(out) > exp.sweep.trace_in_full:
        first = next(iter(out.items()))
        raise ConfigError(exp.path, "trace_in_full",
                          f"{len(out)} layouts need full traces (layer templates cannot stand for them, e.g. "
                          f"{first[0]}: {first[1]}), more than trace_in_full = {exp.sweep.trace_in_full}; narrow "
                          "the axes or raise it (half a minute a traced rank on two cores)")
    return out


class _Progress:
    """One line on stderr now and then: layouts done, templates traced, time left."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.t0, self.last, self.templates = name, total, time.perf_counter(), 0.0, 0

    def start(self, done: int) -> None:
        """The layouts begin (``done`` of them finished in an earlier, killed run)."""
        self.t_layouts, self.done_before = time.perf_counter(), done

    def show(self, done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < 5.0:
            return
        self.last, spent = now, now - self.t0
        rate = (done - self.done_before) / max(now - self.t_layouts, 1e-9)  # layouts a second, this run
        left = (self.total - done) / rate if rate > 0 else float("nan")
        print(f"search {self.name}: {done}/{self.total} layouts, {self.templates} template jobs traced, "
              f"{spent:.0f} s so far, ~{left:.0f} s left", file=sys.stderr, flush=True)


_STATE: dict = {}  # what the forked workers read: set before the pool starts


def _batches(kept: list[Candidate], todo: list[int]) -> list[list[int]]:
    """``todo``'s layouts in batches of those with the same graph but for the ZeRO stage (which
    ``echo.trace.compose.compose_ranks`` composes once), batches with the same blocks next to
    each other, so that a worker's recent parts serve its next layouts."""
    from echo.trace.compose import signature

    batches: dict[tuple, list[int]] = {}
    for i in todo:
        w = kept[i].workload
        batches.setdefault((signature(w), w.model.layers, w.parallel.model_dump_json(exclude={"zero"})), []).append(i)
    return [batches[k] for k in sorted(batches)]


def _evaluate_batch(batch: list[int]) -> list[dict]:
    return [r for i in batch for r in _evaluate(i)]


def _evaluate(i: int) -> list[dict]:
    """Compose, group, cost and simulate kept layout ``i`` on every topology (in a worker)."""
    import warnings

    import pyarrow.parquet as pq

    from echo.artifacts import RANK_CLASSES
    from echo.dedup import rank_classes
    from echo.io import write_parquet
    from echo.profile import run_profile
    from echo.simulate import run_simulate
    from echo.trace import run_trace
    from echo.trace.compose import compose_trace

    warnings.filterwarnings("ignore", category=UserWarning)
    s = _STATE
    c: Candidate = s["kept"][i]
    w = c.workload
    with tempfile.TemporaryDirectory(prefix=".layout-", dir=s["work"]) as tmp:
        tmp = Path(tmp)
        if c.name in s["full"]:
            run_trace(w, tmp / "trace")  # every role, a worker process each, over this process's cores
        else:
            compose_trace(w, tmp / "trace", s["cache"])
        write_parquet(rank_classes(w, pq.read_table(tmp / "trace" / "ranks.parquet")), tmp / "classes.parquet",
                      RANK_CLASSES)
        run_profile(s["hardware"], tmp / "trace", tmp / "kernels.parquet")
        rows = []
        for topo in s["topologies"]:
            network, timer = s["timers"][topo.name]
            summary = run_simulate(w, s["hardware"], topo, tmp / "trace", tmp / "classes.parquet",
                                   tmp / "kernels.parquet", s["calib"][topo.name], tmp / "sim" / topo.name,
                                   network=network, timer=timer, summary_only=True)
            rows.append({**summary.to_pylist()[0], "layout": c.name})
    return rows


def _prepare(kept: list[Candidate], cache: Path, processes: int, progress: _Progress) -> dict[str, float]:
    """Trace the template jobs and the distinct tails of every layout of ``kept`` (those composed
    from templates), here, before forking: all template jobs of the search in one pool, so that
    the cores stay busy."""
    from echo.trace.compose import cached_pieces, signature, tail_jobs, tails
    from echo.trace.template import run_template_jobs, template_jobs
    from echo.training.layout import Layout

    todo: dict[Path, tuple] = {}
    for c in kept:
        for job in template_jobs(c.workload, Path(cache) / signature(c.workload)):
            todo.setdefault(job[0], job)
    progress.templates = len(todo)
    print(f"search {progress.name}: {len(kept)} layouts from {len({signature(c.workload) for c in kept})} "
          f"block signatures: tracing {len(todo)} template jobs ({sum(len(j[2]) for j in todo.values())} ranks)",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    run_template_jobs(list(todo.values()), processes)
    t1 = time.perf_counter()
    jobs = []
    for c in kept:
        w = c.workload
        jobs += tail_jobs(w, cached_pieces(w, cache), sorted(Layout(w.parallel).representatives().values()))
    tails(jobs, processes)
    t2 = time.perf_counter()
    print(f"search {progress.name}: template jobs traced in {t1 - t0:.0f} s, {len(jobs)} gradient-reduction tails "
          f"in {t2 - t1:.0f} s", file=sys.stderr, flush=True)
    return {"templates_s": t1 - t0, "tails_s": t2 - t1}


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
        import pyarrow.parquet as pq

        self.rows = [r for p in sorted(self.folder.glob("rows-*.parquet")) for r in pq.read_table(p).to_pylist()]
        self.pending: list[dict] = []

    @property
    def done(self) -> set[str]:
        return {r["layout"] for r in self.rows}

    def add(self, rows: list[dict], last: bool = False) -> None:
        from echo.io import write_parquet

        self.pending += rows
        if self.pending and (last or len(self.pending) >= self.EVERY):
            n = len(list(self.folder.glob("rows-*.parquet")))
            write_parquet(pa.Table.from_pylist(self.pending), self.folder / f"rows-{n:05d}.parquet")
            self.rows += self.pending
            self.pending = []


def _verify(kept: list[Candidate], cache: Path, count: int, work: Path, processes: int = 1) -> list[dict]:
    """One rank of ``count`` layouts spread over ``kept`` (the composed ones), traced in full
    (``processes`` at once, a worker process each) and compared with its composed graph."""
    from concurrent.futures import ThreadPoolExecutor

    from echo.trace.compose import cached_pieces, compose_ranks, differences
    from echo.trace.runner import trace_ranks
    from echo.training.layout import Layout

    picks = [kept[round(k * (len(kept) - 1) / max(1, count - 1))] for k in range(min(count, len(kept)))]
    checks = []
    for n, c in enumerate({c.name: c for c in picks}.values()):
        w = c.workload
        reps = sorted(Layout(w.parallel).representatives().values())
        rank = reps[n % len(reps)]  # first, then later stages: each kind of chunk gets checked
        checks.append((n, c, rank, compose_ranks(w, cached_pieces(w, cache), [rank])[rank]))
    with ThreadPoolExecutor(max(1, processes)) as pool:  # the traces run in worker processes
        traced = list(pool.map(lambda k: trace_ranks(k[1].workload, [k[2]], work / f"verify-{k[0]}", jobs=1), checks))
    out = []
    for (_, c, rank, composed), full in zip(checks, traced, strict=True):
        diff = differences(composed, full)
        out.append({"layout": c.name, "rank": rank, "ops": composed["ops"].num_rows, "equal": not diff,
                    "difference": diff[0] if diff else None})
        if diff:
            raise SearchError(f"{c.name}: rank {rank} composed from templates differs from its full trace: {diff[0]}")
    return out


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
    out.sort(key=lambda r: (not r["fits"], r["step_time_s"], r["layout"], r["topology"]))
    for i, r in enumerate(out):
        r["rank"] = i + 1 if r["fits"] else None
    return pa.Table.from_pylist(out, schema=SEARCH_RANKING)


def run_search(name: str, out_dir: Path, processes: int = 1, root: Path | None = None,
               cache_dir: Path | None = None, verify: int | None = None) -> dict:
    """Search ``config/sweeps/{name}.yaml``; write the tables and figures into ``out_dir``."""
    from echo.config import load_hardware, load_topology
    from echo.io import write_parquet
    from echo.network import NetworkModel, run_calibrate
    from echo.simulate.costing import CommTimer

    t0 = time.perf_counter()
    exp = expand_search(name, root)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_parquet(layouts_table(exp), out_dir / "layouts.parquet")
    if not exp.kept:
        raise ConfigError(exp.path, "axes", "no layout of the search is kept (layouts.parquet says why)")
    full = traced_in_full(exp)
    composed = [c for c in exp.kept if c.name not in full]
    hardware = load_hardware(exp.sweep.hardware, root)
    topologies = [load_topology(t, root) for t in exp.sweep.topologies]
    cache = Path(cache_dir or out_dir / "templates")
    work = out_dir / "work"
    work.mkdir(exist_ok=True)
    calib = {}
    for topo in topologies:
        calib[topo.name] = out_dir / "calibrate" / topo.name
        if not (calib[topo.name] / "collectives.parquet").is_file():
            run_calibrate(topo, calib[topo.name])
    progress = _Progress(name, len(exp.kept))
    phases = _prepare(composed, cache, processes, progress)
    # composition is checked before the layouts are simulated: a wrong graph fails in minutes
    t = time.perf_counter()
    checks = _verify(composed, cache, exp.sweep.verify if verify is None else verify, work, processes)
    t_prepared = time.perf_counter()
    phases["verify_s"] = t_prepared - t
    partial = _Partial(out_dir, exp)
    todo = [i for i, c in enumerate(exp.kept) if c.name not in partial.done]
    progress.start(len(exp.kept) - len(todo))
    # one network model and collective timer per topology: each worker's timer then prices a
    # collective once for all its layouts (they share most of their groups and sizes)
    timers = {}
    for topo in topologies:
        network = NetworkModel.load(calib[topo.name] / "network.json")
        timers[topo.name] = (network, CommTimer(network))
    _STATE.update(kept=exp.kept, cache=cache, hardware=hardware, topologies=topologies, calib=calib, work=work,
                  timers=timers, full=full)
    done = len(exp.kept) - len(todo)
    if full:
        print(f"search {name}: {len(full)} layouts traced in full (templates cannot stand for them: "
              f"{sorted(set(full.values()))[0]})", file=sys.stderr, flush=True)
    for i in [i for i in todo if exp.kept[i].name in full]:  # here: their traces use every core
        partial.add(_evaluate(i))
        done += 1
        progress.show(done)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(max(1, processes)) as pool:
        batches = _batches(exp.kept, [i for i in todo if exp.kept[i].name not in full])
        for result in pool.imap_unordered(_evaluate_batch, batches, chunksize=2):
            partial.add(result)
            done += len({r["layout"] for r in result})
            progress.show(done)
    partial.add([], last=True)
    progress.show(len(exp.kept), force=True)
    t_simulated = time.perf_counter()
    rows = partial.rows
    shutil.rmtree(work, ignore_errors=True)
    ranking = rank_rows(exp, rows, hardware.memory_gib, set(full))
    write_parquet(ranking, out_dir / "ranking.parquet", SEARCH_RANKING)
    ranked = ranking.to_pylist()
    fronts = [{**{k: r[k] for k in ("layout", "topology", "gpus", "step_time_s", "peak_mem_gib")}, "front": front}
              for front, x in (("memory", "peak_mem_gib"), ("gpus", "gpus")) for r in pareto(ranked, x)]
    write_parquet(pa.Table.from_pylist(fronts, schema=PARETO), out_dir / "pareto.parquet", PARETO)
    write_parquet(pa.Table.from_pylist(checks, schema=VERIFY), out_dir / "verify.parquet", VERIFY)
    from echo.report.fronts import search_fronts

    search_fronts(ranked, fronts, out_dir, title=f"{name}: {exp.sweep.description}")
    shutil.rmtree(partial.folder)  # everything is in ranking.parquet now
    return {"layouts": len(exp.candidates), "kept": len(exp.kept), "ranked": len(ranked), "traced": len(full),
            "fit": sum(1 for r in ranked if r["fits"]), "verified": len(checks),
            "prepare_s": t_prepared - t0, "simulate_s": t_simulated - t_prepared, **phases,
            "wall_s": time.perf_counter() - t0,
            "best": [r for r in ranked if r["rank"] is not None][:3]}
