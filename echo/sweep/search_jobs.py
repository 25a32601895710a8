"""A search cut into jobs: its plan, the template jobs, the composition checks and the layout
shards (echo.sweep.search runs them in one process; workflow/rules/search.smk as Snakemake jobs,
which spread over ``--cores N`` and over SLURM nodes alike).

The plan (``make_plan``) follows from the spec alone, so that every job, on any node, computes the
same one: the kept layouts, those that layer templates cannot stand for (traced in full instead,
``traced_in_full``), each template job ``"{signature}/{stages}x{depth}"`` (its template workload
and ranks), and the layouts cut into shards of whole batches (layouts that differ only in the
ZeRO stage, composed once) with the same block signatures next to each other.
"""

from __future__ import annotations

import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from echo.config.workload import Workload
from echo.errors import ConfigError
from echo.sweep.spec import Candidate, Expansion, expand, load_sweep


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


def _batches(kept: list[Candidate], todo: list[int], signatures: dict[int, str]) -> list[list[int]]:
    """``todo``'s layouts in batches of those with the same graph but for the ZeRO stage (which
    ``echo.trace.compose.compose_ranks`` composes once), batches with the same blocks
    (``signatures``: kept index -> block signature) next to each other, so that a worker's
    recent parts serve its next layouts."""
    batches: dict[tuple, list[int]] = {}
    for i in todo:
        w = kept[i].workload
        batches.setdefault((signatures[i], w.model.layers, w.parallel.model_dump_json(exclude={"zero"})), []).append(i)
    return [batches[k] for k in sorted(batches)]


def rows_table(rows: list[dict]):
    """Summary rows as one Arrow table over every key any row has (a layout dropped for memory has
    no step-time columns; pyarrow would otherwise take the first row's keys for all)."""
    import pyarrow as pa

    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def _evaluate_batch(batch: list[int]) -> list[dict]:
    return [r for i in batch for r in _evaluate(i)]


def _evaluate(i: int) -> list[dict]:
    """Compose, group, cost and simulate kept layout ``i`` on every topology (in a worker)."""
    import warnings

    from echo.artifacts import RANK_CLASSES, TRACED_RANKS
    from echo.dedup import rank_classes
    from echo.io import read_parquet, write_parquet
    from echo.profile import run_profile
    from echo.simulate import run_simulate
    from echo.simulate.stage import memory_floor
    from echo.simulate.summary import memory_columns
    from echo.trace import run_trace
    from echo.trace.compose import compose_trace

    warnings.filterwarnings("ignore", category=UserWarning)
    s = _STATE
    c: Candidate = s["kept"][i]
    w = c.workload
    with tempfile.TemporaryDirectory(prefix=".layout-", dir=s["work"]) as tmp:
        tmp = Path(tmp)
        trace = tmp / "trace"
        if c.name in s["full"]:
            # layouts that differ only in what the tracer does not read share one trace, as in a sweep
            trace = Path(s["work"]) / "full" / c.trace
            if not (trace / "ranks.parquet").is_file():
                run_trace(s["traces"][c.trace], trace)  # every role, a worker process each, over this process's cores
        else:
            compose_trace(w, trace, s["cache"])
        write_parquet(rank_classes(w, read_parquet(trace / "ranks.parquet", TRACED_RANKS)), tmp / "classes.parquet",
                      RANK_CLASSES)
        # what cannot fit is dropped with its memory, without costing or replaying it (most of a
        # search's layouts, and most of its time)
        floor = memory_floor(w, trace, tmp / "classes.parquet")
        if floor is not None and not (memory := memory_columns(floor, s["hardware"].memory_gib))["fits"]:
            return [{"workload": w.name, "hardware": s["hardware"].name, "topology": topo.name,
                     "world_size": w.world_size, "layout": c.name, **memory} for topo in s["topologies"]]
        run_profile(s["hardware"], trace, tmp / "kernels.parquet")
        rows = []
        for topo in s["topologies"]:
            network, timer = s["timers"][topo.name]
            summary = run_simulate(w, s["hardware"], topo, trace, tmp / "classes.parquet",
                                   tmp / "kernels.parquet", s["calib"][topo.name], tmp / "sim" / topo.name,
                                   network=network, timer=timer, summary_only=True)
            rows.append({**summary.to_pylist()[0], "layout": c.name})
    return rows


@dataclass(frozen=True)
class Plan:
    """A search's jobs, decided from its spec alone."""

    name: str
    exp: Expansion
    full: dict[str, str]                               # layouts traced in full -> why templates cannot stand for them
    templates: dict[str, tuple[Workload, list[int]]]   # "{signature}/{stages}x{depth}" -> (template workload, ranks)
    shards: list[list[int]]                            # indices into exp.kept, per shard
    signatures: dict[int, str]                         # composed layout's kept index -> its block signature
    needs: dict[int, tuple[str, ...]]                  # composed layout's kept index -> its template jobs

    @property
    def kept(self) -> list[Candidate]:
        return self.exp.kept

    @property
    def composed(self) -> list[Candidate]:
        return [c for c in self.exp.kept if c.name not in self.full]




def make_plan(name: str, root: Path | None = None, shards: int | None = None) -> Plan:
    """``name``'s plan; ``shards``: how many (default: the spec's ``shards``)."""
    exp = expand_search(name, root)
    if not exp.kept:
        raise ConfigError(exp.path, "axes", "no layout of the search is kept (layouts.parquet says why)")
    from echo.trace.compose import signature
    from echo.trace.template import template_jobs

    full = traced_in_full(exp)
    kept = exp.kept
    templates: dict[str, tuple[Workload, list[int]]] = {}
    signatures: dict[int, str] = {}
    needs: dict[int, tuple[str, ...]] = {}
    for i, c in enumerate(kept):  # each layout's signature and template jobs, once for every job of the search
        if c.name not in full:
            signatures[i] = signature(c.workload)
            jobs = template_jobs(c.workload, Path(signatures[i]), missing_only=False)
            needs[i] = tuple(str(folder) for folder, _, _ in jobs)
            for folder, tw, ranks in jobs:
                templates.setdefault(str(folder), (tw, ranks))
    batches = [[i] for i, c in enumerate(kept) if c.name in full]
    batches += _batches(kept, sorted(signatures), signatures)
    n = max(1, min(shards or exp.sweep.shards, len(batches)))
    out: list[list[int]] = [[] for _ in range(n)]
    k = 0
    for b in batches:  # contiguous shards of about len(kept) / n layouts, batches whole
        if k < n - 1 and sum(map(len, out[: k + 1])) >= len(kept) * (k + 1) / n:
            k += 1
        out[k] += b
    return Plan(name, exp, full, templates, out, signatures, needs)


def shard_templates(plan: Plan, shard: int) -> list[str]:
    """The template jobs shard ``shard``'s layouts are composed from."""
    return sorted({key for i in plan.shards[shard] for key in plan.needs.get(i, ())})


def trace_templates(plan: Plan, cache: Path, processes: int = 1) -> int:
    """Trace the plan's template jobs that ``cache`` does not hold yet, all in one pool; returns
    how many were traced."""
    from echo.trace.template import run_template_jobs

    jobs = [(Path(cache) / key, tw, ranks) for key, (tw, ranks) in plan.templates.items()
            if not (Path(cache) / key / "done").is_file()]
    run_template_jobs(jobs, processes)
    return len(jobs)


def evaluate(plan: Plan, indices: list[int], cache: Path, hardware, topologies: list, calib: dict[str, Path],
             work: Path, processes: int = 1, on_rows: Callable[[list[dict]], None] = lambda rows: None) -> dict:
    """Simulate the kept layouts ``indices`` on every topology (``calib``: each topology's
    calibrate folder); each finished layout's summary rows go to ``on_rows``. Returns the
    phases' times."""
    from echo.network import NetworkModel
    from echo.simulate.costing import CommTimer
    from echo.trace.compose import cached_pieces, tail_jobs, tails
    from echo.training.layout import Layout

    t0 = time.perf_counter()
    jobs = []
    for i in indices:  # the gradient-reduction tails, here, before forking: every worker finds them
        c = plan.kept[i]
        if c.name not in plan.full:
            w = c.workload
            jobs += tail_jobs(w, cached_pieces(w, cache), sorted(Layout(w.parallel).representatives().values()))
    tails(jobs, processes)
    t1 = time.perf_counter()
    # one network model and collective timer per topology: each worker's timer then prices a
    # collective once for all its layouts (they share most of their groups and sizes)
    timers = {}
    for topo in topologies:
        network = NetworkModel.load(Path(calib[topo.name]) / "network.json")
        timers[topo.name] = (network, CommTimer(network))
    work.mkdir(parents=True, exist_ok=True)
    _STATE.update(kept=plan.kept, cache=cache, hardware=hardware, topologies=topologies, calib=calib, work=work,
                  timers=timers, full=plan.full, traces=plan.exp.traces)
    for i in [i for i in indices if plan.kept[i].name in plan.full]:  # here: their traces use every core
        on_rows(_evaluate(i))
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(max(1, processes)) as pool:
        batches = _batches(plan.kept, [i for i in indices if i in plan.signatures], plan.signatures)
        for rows in pool.imap_unordered(_evaluate_batch, batches, chunksize=2):
            on_rows(rows)
    return {"tails": len(jobs), "tails_s": t1 - t0, "layouts_s": time.perf_counter() - t1}


def verify_composition(kept: list[Candidate], cache: Path, count: int, work: Path, processes: int = 1) -> list[dict]:
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
