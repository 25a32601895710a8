"""``python -m echo``: run one stage outside Snakemake (to debug it), audit results, price a collective.

Each stage subcommand loads and validates its configs the way the workflow does and writes to
the workflow's paths under ``--results`` (default ``results/``), so its output can be inspected
with ``audit`` or picked up by a later ``snakemake`` run (which re-runs it anyway if it has no
record of it). Bad configuration exits with status 2 and one line naming file, key and reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from echo.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
}


class StageInputMissing(RuntimeError):
    """An upstream artifact a stage reads has not been written yet."""


def parse_bytes(text: str) -> int:
    """'1048576', '1e6', '64KB' (10^3), '1MiB' (2^20), ... as a whole number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1048576, 64KB, 1MiB, 1e9)")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value != int(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a whole, non-negative number of bytes: {text!r}")
    return int(value)


def positive(text: str) -> float:
    """A number > 0 (``--tokens 15e12``, ``--days 54``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def straggler(text: str) -> tuple[int, float]:
    """``RANK:FACTOR`` (``--straggler 17:1.1``; ``--slow-node`` takes a node index the same way)."""
    rank, sep, factor = text.partition(":")
    try:
        pair = int(rank), float(factor)
    except ValueError:
        pair = None
    if not sep or pair is None or pair[0] < 0 or not pair[1] > 0:
        raise argparse.ArgumentTypeError(f"not RANK:FACTOR with a rank >= 0 and a factor > 0: {text!r}")
    return pair


def stage_hardware(text: str) -> tuple[tuple[int, ...], str]:
    """``STAGES:HARDWARE``: ``4-7:a100-sxm-80gb``, ``2:h200-sxm-141gb``."""
    stages, sep, name = text.partition(":")
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", stages)
    if not sep or not name or not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
        raise argparse.ArgumentTypeError(f"not STAGES:HARDWARE (STAGES: 3 or 4-7): {text!r}")
    first = int(m.group(1))
    return tuple(range(first, int(m.group(2) or first) + 1)), name


def _paths(results: Path, workload: str = "", hardware: str = "", topology: str = "") -> dict[str, Path]:
    """The workflow's artifact paths (echo.workflow.paths) under ``results`` for the given names."""
    from echo.workflow import paths

    def at(folder: paths.Folder, *files: str) -> Path:
        return Path(folder(*files, results=results, workload=workload, hardware=hardware, topology=topology))

    return {"trace_dir": at(paths.TRACE), "ops": at(paths.TRACE, "ops.parquet"),
            "rank_classes": at(paths.DEDUP, "rank_classes.parquet"), "kernels": at(paths.PROFILE, "kernels.parquet"),
            "calib_dir": at(paths.CALIBRATE), "network": at(paths.CALIBRATE, "network.json"),
            "simulate_dir": at(paths.SIMULATE), "overlap": at(paths.OVERLAP, "slowdown.parquet"),
            "profile_cache": at(paths.PROFILE_CACHE)}


def _need(*paths: Path, hint: str) -> None:
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise StageInputMissing(f"missing {', '.join(missing)}; {hint}")


# --- subcommands ----------------------------------------------------------------------------


def cmd_trace(args: argparse.Namespace) -> int:
    from echo.config import load_workload
    from echo.trace import run_trace

    workload = load_workload(args.workload, root=args.config_dir)
    out = args.out or _paths(args.results, args.workload)["trace_dir"]
    run_trace(workload, Path(out))
    print(out)
    return 0


def cmd_dedup(args: argparse.Namespace) -> int:
    from echo.config import load_workload
    from echo.dedup import run_dedup

    workload = load_workload(args.workload, root=args.config_dir)
    p = _paths(args.results, args.workload)
    _need(p["ops"], hint=f"run `python -m echo trace --workload {args.workload}` first")
    run_dedup(workload, p["trace_dir"], p["rank_classes"])
    print(p["rank_classes"])
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from echo.config import load_hardware, load_workload
    from echo.profile import run_profile
    from echo.profile.eager import colocated_ranks

    hardware = load_hardware(args.hardware, root=args.config_dir)
    ranks = colocated_ranks(load_workload(args.workload, root=args.config_dir).world_size)
    p = _paths(args.results, args.workload, args.hardware)
    _need(p["ops"], hint=f"run `python -m echo trace --workload {args.workload}` first")
    # the workflow's cache by default, so the CLI and `snakemake` time each kernel once between them
    cache_dir = args.cache_dir if args.cache_dir is not None else p["profile_cache"]
    run_profile(hardware, p["trace_dir"], p["kernels"], cache_dir=cache_dir, ranks_on_host=ranks, overlay=args.overlay)
    print(p["kernels"])
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from echo.config import load_topology
    from echo.network import run_calibrate

    topology = load_topology(args.topology, root=args.config_dir)
    p = _paths(args.results, topology=args.topology)
    run_calibrate(topology, p["calib_dir"])
    print(p["calib_dir"])
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from echo.config import load_hardware, load_topology, load_workload
    from echo.config.loader import check_placement, config_path
    from echo.simulate import run_simulate
    from echo.simulate.slow_links import check_slow_nodes

    workload = load_workload(args.workload, root=args.config_dir)
    hardware = load_hardware(args.hardware, root=args.config_dir)
    topology = load_topology(args.topology, root=args.config_dir)
    check_placement(workload, topology, config_path("topology", args.topology, args.config_dir))
    p = _paths(args.results, args.workload, args.hardware, args.topology)
    w, h, t = args.workload, args.hardware, args.topology
    _need(p["ops"], hint=f"run `python -m echo trace --workload {w}` first")
    _need(p["rank_classes"], hint=f"run `python -m echo dedup --workload {w}` first")
    _need(p["kernels"], hint=f"run `python -m echo profile --workload {w} --hardware {h}` first")
    _need(p["network"], hint=f"run `python -m echo calibrate --topology {t}` first")
    # the overlap rule's measured slowdown when it has run (cpu hardware); GPUs use published figures
    measured = p["overlap"]
    stragglers = dict(args.straggler or [])
    if stragglers and max(stragglers) >= workload.world_size:
        raise ConfigError(config_path("workload", w, args.config_dir), "parallel",
                          f"--straggler rank {max(stragglers)} is not in the job (world size {workload.world_size})")
    try:  # before any work: the node must be one the job fills
        slow_nodes = check_slow_nodes(dict(args.slow_node or []), topology.nodes(workload.world_size),
                                      topology.node_ranks)
    except ValueError as exc:
        raise ConfigError(config_path("topology", t, args.config_dir), "gpus_per_node", f"--slow-node: {exc}") from None
    stage_kernels: dict[int, list[Path]] = {}

    def kernels_of(other: str) -> Path:
        load_hardware(other, root=args.config_dir)  # a known hardware file, before any work
        path = _paths(args.results, w, other)["kernels"]
        _need(path, hint=f"run `python -m echo profile --workload {w} --hardware {other}` first")
        return path

    stage_memory: dict[int, float] = {}  # each stage fits the smallest GPU it runs on

    def on(s: int, other: str) -> None:
        stage_kernels.setdefault(s, []).append(kernels_of(other))
        stage_memory[s] = min(stage_memory.get(s, math.inf), load_hardware(other, root=args.config_dir).memory_gib)

    for stages, other in args.stage_hardware or []:  # these stages run on that model only
        for s in stages:
            if s >= workload.parallel.pp:
                raise ConfigError(config_path("workload", w, args.config_dir), "parallel.pp",
                                  f"--stage-hardware names stage {s}; the workload has pp = {workload.parallel.pp}")
            on(s, other)
    for other in args.replica_hardware or []:  # some replicas on that model: every stage waits for it
        for s in range(workload.parallel.pp):
            stage_kernels.setdefault(s, [p["kernels"]])
            stage_memory.setdefault(s, hardware.memory_gib)
            on(s, other)
    run_simulate(workload, hardware, topology, p["trace_dir"], p["rank_classes"], p["kernels"],
                 p["calib_dir"], p["simulate_dir"], overlap=measured if measured.exists() else None,
                 stragglers=stragglers, stage_kernels=stage_kernels or None, slow_nodes=slow_nodes or None,
                 stage_memory_gib=stage_memory or None)
    from echo.report.audit import summaries_table

    print(summaries_table([p["simulate_dir"] / "summary.parquet"], args.results))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    import duckdb

    from echo.report.audit import audit
    from echo.workflow.paths import VIEWS

    sql = sys.stdin.read() if args.sql == "-" else args.sql
    try:
        print(audit(sql, args.results, VIEWS, max_rows=args.max_rows))
    except duckdb.Error as exc:
        print(f"echo audit: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from echo.trace.graph import class_graph, write_graph

    p = _paths(args.results, args.workload)
    _need(p["ops"], p["rank_classes"], hint=f"run `python -m echo trace/dedup --workload {args.workload}` first")
    g = class_graph(p["trace_dir"], p["rank_classes"], args.class_id)
    out = args.out or p["trace_dir"] / f"class{args.class_id}.{args.format}"
    write_graph(g, out, args.format)
    print(f"{out}: {g.number_of_nodes()} ops, {g.number_of_edges()} dependencies (rank {g.graph['rank']})")
    return 0


def cmd_chakra_export(args: argparse.Namespace) -> int:
    from echo.io import read_parquet
    from echo.trace.chakra import export_trace

    p = _paths(args.results, args.workload, args.hardware or "")
    _need(p["ops"], hint=f"run `python -m echo trace --workload {args.workload}` first")
    durations = None
    if args.hardware:
        _need(p["kernels"], hint=f"run `python -m echo profile --workload {args.workload} --hardware {args.hardware}` first")
        k = read_parquet(p["kernels"])
        durations = dict(zip(k["kernel_key"].to_pylist(), k["duration_us"].to_pylist(), strict=True))
    out = args.out or Path(args.results) / "chakra" / args.workload
    manifest = export_trace(p["trace_dir"], out, args.workload, p["rank_classes"], durations)
    print(f"{out}: {len(manifest['files'])} Chakra ET files (schema {manifest['schema']})"
          + (f", costed on {args.hardware}" if durations else ", uncosted (give --hardware for durations)"))
    return 0


def cmd_chakra_import(args: argparse.Namespace) -> int:
    from echo.config import load_workload
    from echo.trace.chakra import import_trace
    from echo.trace.chakra_schema import ChakraError

    workload = load_workload(args.workload, root=args.config_dir)
    out = _paths(args.results, args.workload)["trace_dir"]
    try:
        got = import_trace(args.path, out, workload)
    except ChakraError as exc:
        print(f"echo: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {len(got['ranks'])} ranks, {got['ops']} ops, {got['deps']} dependencies, "
          f"{got['comms']} collectives and transfers from {len(got['files'])} Chakra ET files")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from echo.report.audit import render_rows
    from echo.trace.diff import diff

    dirs = [_paths(args.results, w)["trace_dir"] for w in (args.a, args.b)]
    _need(*(d / "ops.parquet" for d in dirs), hint="trace both workloads first")
    rows = diff(*dirs)
    if not rows:
        print(f"{args.a} and {args.b} run the same ops and collectives on every role")
        return 0
    table = pa.Table.from_pylist(rows).rename_columns(
        ["role", "what", "phase", "name", "detail", args.a, args.b])
    shown = table.slice(0, args.max_rows)
    print(render_rows(shown.column_names, [str(t) for t in shown.schema.types], [tuple(r.values()) for r in shown.to_pylist()],
                      caption=f"{table.num_rows} differences" + (f", first {args.max_rows} shown"
                                                                if table.num_rows > args.max_rows else "")))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from echo.report.audit import summaries_table
    from echo.workflow.paths import SIMULATE

    print(summaries_table(SIMULATE.glob("summary.parquet", results=args.results), args.results))
    return 0


def cmd_collective(args: argparse.Namespace) -> int:
    from echo.network import collective_main

    result = collective_main(args.topology, args.op, args.gpus, args.bytes, config_root=args.config_dir,
                             network_json=_paths(args.results, topology=args.topology)["network"],
                             nccl_algo=args.nccl_algo, nccl_proto=args.nccl_proto)
    print(json.dumps(result, default=str))
    return 0


def cmd_import_kineto(args: argparse.Namespace) -> int:
    from echo.config import load_hardware
    from echo.io import read_parquet
    from echo.profile.gpu_import import describe, import_traces, job_name, write_import
    from echo.profile.kineto import KinetoError
    from echo.profile.stage import distinct_kernels
    from echo.workflow import paths

    hardware = load_hardware(args.hardware, root=args.config_dir)
    kernels = None
    if args.workload:
        ops = _paths(args.results, args.workload)["ops"]
        _need(ops, hint=f"run `python -m echo trace --workload {args.workload}` first")
        kernels = distinct_kernels(read_parquet(ops))
    try:
        imp = import_traces(args.path, hardware, kernels)
    except KinetoError as exc:
        print(f"echo: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(paths.IMPORT(job=job_name(args.path), hardware=args.hardware, results=args.results))
    write_import(imp, out)
    print(describe(imp))
    print(f"wrote {out}")
    return 0


def cmd_fit_overlay(args: argparse.Namespace) -> int:
    from echo.io import read_parquet
    from echo.profile.overlay import build_overlay, write_overlay
    from echo.workflow import paths

    rows, sources = [], []
    for job in args.jobs:
        f = Path(paths.IMPORT("model_error.parquet", job=job, hardware=args.hardware, results=args.results))
        _need(f, hint=f"run `python -m echo import-kineto PATH --hardware {args.hardware}` first")
        rows += read_parquet(f).to_pylist()
        sources.append(str(f))
    doc = build_overlay(rows, args.hardware, sources)
    out = args.out or Path(paths.OVERLAY(f"{args.hardware}.json", job="+".join(args.jobs), results=args.results))
    write_overlay(doc, out)
    print(f"{out}: {len(doc['regimes'])} shape regimes, {len(doc['exact'])} exact shapes "
          f"({doc['split']['fit_shapes']} fitted, {doc['split']['held_out_shapes']} held out)")
    for cls, v in doc["validation"].items():
        print(f"  held out, {cls}: mean |error| model {100 * v['model_mean_abs_error']:.1f}% -> overlay "
              f"{100 * v['overlay_mean_abs_error']:.1f}% over {v['shapes']} shapes ({v['covered']} in fitted regimes)")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from echo.config import load_hardware
    from echo.io import read_parquet, write_parquet
    from echo.network.query import model_for
    from echo.report.explain import EXPLAIN, describe, explain
    from echo.workflow import paths

    hardware = load_hardware(args.hardware, root=args.config_dir)
    folder = Path(paths.IMPORT(job=args.job, hardware=args.hardware, results=args.results))
    _need(folder / "activity.parquet", folder / "import.json",
          hint=f"run `python -m echo import-kineto PATH --hardware {args.hardware}` first")
    network = None
    if args.topology:
        network = model_for(args.topology, _paths(args.results, topology=args.topology)["network"], args.config_dir)
    simulated = None
    if args.workload:
        if not args.topology:
            print("echo explain: --workload needs --topology (the simulation it reads)", file=sys.stderr)
            return 2
        sim = _paths(args.results, args.workload, args.hardware, args.topology)["simulate_dir"] / "summary.parquet"
        _need(sim, hint=f"simulate {args.workload} on {args.hardware} / {args.topology} first")
        simulated = read_parquet(sim).to_pylist()[0]
    table = explain(read_parquet(folder / "activity.parquet"), json.loads((folder / "import.json").read_text()),
                    hardware, network, simulated)
    write_parquet(table, folder / "explain.parquet", EXPLAIN)
    print(describe(table))
    print(f"wrote {folder / 'explain.parquet'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from echo.workflow.status import status

    code, text = status(args.targets, workdir=args.workdir, config_dir=args.config_dir, extra=args.snakemake_args)
    print(text)
    return code


def cmd_sweep(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from echo.io import read_parquet
    from echo.report.audit import render_table
    from echo.sweep import expansion, layouts_table
    from echo.workflow.paths import SWEEP

    exp = expansion(args.sweep, root=args.config_dir)
    s = exp.sweep
    print(f"sweep {s.name}: {s.description}")
    print(f"  {'/'.join(map(str, s.gpu_counts))} x {s.hardware} on {', '.join(s.topologies)}; axes: "
          + "; ".join(f"{a} {v}" for a, v in s.axes.items()))
    print(f"  {len(exp.candidates)} combinations: {len(exp.kept)} layouts kept (traced as {len(exp.traces)} "
          f"shared traces), {len(exp.dropped)} dropped")
    table = layouts_table(exp)
    shared = [t.split("--", 1)[1] if t else None for t in table.column("trace").to_pylist()]
    table = table.set_column(table.schema.get_field_index("trace"), "shared trace", pa.array(shared, pa.string()))
    print(render_table(table.select(["tokens", "kept", "shared trace", "key", "reason"]), title=f"layouts of {s.name}"))
    ranking = Path(SWEEP("ranking.parquet", sweep=s.name, results=args.results))
    if ranking.is_file():
        top = read_parquet(ranking).slice(0, args.top)
        print(render_table(top.select(["rank", "tokens", "topology", "step_time_s", "mfu", "peak_mem_gib", "fits"]),
                           title=f"best layouts ({ranking})"))
    else:
        print(f"not simulated yet: snakemake --cores 2 {ranking}")
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    import os

    from echo.report.audit import render_table
    from echo.sweep.search import run_search
    from echo.workflow.paths import SEARCH, TEMPLATES

    out = Path(args.out or SEARCH("", search=Path(args.spec).stem, results=args.results))
    cores = args.cores or len(os.sched_getaffinity(0))
    res = run_search(args.spec, out, processes=cores, root=args.config_dir, verify=args.verify,
                     cache_dir=Path(args.templates or TEMPLATES("", results=args.results)))
    print(f"search {args.spec}: {res['layouts']} combinations, {res['kept']} layouts kept, {res['ranked']} ranked "
          f"({res['fit']} fit in memory, {res['traced']} traced in full) in {res['wall_s']:.0f} s (templates "
          f"{res['templates_s']:.0f} s, {res['verified']} layouts checked against full traces {res['verify_s']:.0f} s, "
          f"tails and layouts {res['simulate_s']:.0f} s)")
    import pyarrow as pa

    if res["best"]:
        best = pa.Table.from_pylist(res["best"]).select(["rank", "tokens", "topology", "step_time_s", "mfu",
                                                           "peak_mem_gib"])
        print(render_table(best, title=f"best layouts ({out / 'ranking.parquet'})"))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from echo.config import load_hardware, load_site, load_topology, load_workload
    from echo.io import read_parquet
    from echo.plan import plan

    workload = load_workload(args.workload, root=args.config_dir)
    hardware = load_hardware(args.hardware, root=args.config_dir)
    topology = load_topology(args.topology, root=args.config_dir)
    site = load_site(args.site, root=args.config_dir)
    path = args.summary or _paths(args.results, args.workload, args.hardware, args.topology)["simulate_dir"] / "summary.parquet"
    _need(path, hint=f"simulate it first: snakemake {path} --cores N (or python -m echo simulate ...)")
    rows = read_parquet(path).to_pylist()
    if len(rows) != 1 or rows[0]["workload"] != args.workload:
        raise ConfigError(path, "workload", f"expected one summary row of workload {args.workload}, found "
                          f"{[r['workload'] for r in rows]}")
    result = plan(workload, hardware, topology, site, rows[0], args.tokens, days=args.days,
                  interval_steps=args.checkpoint_every, usd_per_gpu_hour=args.usd_per_gpu_hour)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=float))
        return 0
    from echo.plan.report import plan_text

    print(plan_text(result))
    return 0


def cmd_plan_search(args: argparse.Namespace) -> int:
    from echo.io import read_parquet
    from echo.sweep.time_to_train import plan_search

    out = args.out or args.results / "search" / args.spec
    ranking = out / "ranking.parquet"
    _need(ranking, hint=f"run the search first: python -m echo search {args.spec}")
    table = plan_search(args.spec, read_parquet(ranking).to_pylist(), args.tokens, args.site,
                        out / "time_to_train.parquet", out / "time_to_train.png", config_dir=args.config_dir,
                        usd_per_gpu_hour=args.usd_per_gpu_hour)
    for t in table:
        cost = "unknown" if t["cost_usd"] is None else f"${t['cost_usd'] / 1e6:,.1f}M"
        print(f"{t['gpus']:>7,} GPUs  {t['time_to_train_days']:7.1f} days (ETTR {t['effective_training_time']:.1%})  "
              f"{cost:>10}  {t['layout']}")
    print(out / "time_to_train.png")
    return 0


def cmd_versions(args: argparse.Namespace) -> int:
    from echo.workflow.versions import STAGE_MODULES, code_version

    for stage in STAGE_MODULES:
        print(f"{stage:10s} {code_version(stage)}")
    return 0


# --- parser ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m echo",
        description="Echo: simulate one iteration of large-scale distributed training. "
                    "The workflow (`snakemake`) runs all stages; these commands run one at a time.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--results", type=Path, default=Path("results"), help="results folder (default: results)")
    common.add_argument("--config-dir", type=Path, default=None,
                        help="folder with workloads/, hardware/, topologies/ (default: the repository's config/)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = add("trace", cmd_trace, "trace each distinct rank of a workload")
    p.add_argument("--workload", required=True)
    p.add_argument("--out", type=Path, help="output folder (default: RESULTS/trace/WORKLOAD)")

    p = add("dedup", cmd_dedup, "group a traced workload's ranks into classes")
    p.add_argument("--workload", required=True)

    p = add("profile", cmd_profile, "time the distinct kernels of a traced workload on a hardware")
    p.add_argument("--workload", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="kernel timing cache (default: RESULTS/profile/_cache, the workflow's)")
    p.add_argument("--overlay", type=Path, default=None,
                   help="a real job's overlay (fit-overlay) over the GPU model, for the kernels it covers")

    p = add("calibrate", cmd_calibrate, "fit the collective model of a topology")
    p.add_argument("--topology", required=True)

    p = add("simulate", cmd_simulate, "simulate one iteration (needs trace, dedup, profile, calibrate)")
    p.add_argument("--workload", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--straggler", type=straggler, action="append", metavar="RANK:FACTOR",
                   help="a GPU whose kernels take FACTOR times as long (e.g. 17:1.1); may be repeated")
    p.add_argument("--slow-node", type=straggler, action="append", metavar="NODE:FACTOR",
                   help="a node whose NICs deliver 1/FACTOR of the fitted bandwidth (a link straggler, e.g. 3:2): "
                   "transfers crossing it take that much longer; may be repeated")
    p.add_argument("--stage-hardware", type=stage_hardware, action="append", metavar="STAGES:HARDWARE",
                   help="a heterogeneous job: pipeline stages (4-7 or 2) that run on another GPU model (the "
                   "workload profiled on it first); may be repeated")
    p.add_argument("--replica-hardware", action="append", metavar="HARDWARE",
                   help="a heterogeneous job: some data-parallel replicas run on another GPU model (profiled "
                   "first); every stage then runs at the slower model's pace")

    p = add("audit", cmd_audit, "SQL over all results (DuckDB views); without SQL, list the views")
    p.add_argument("sql", nargs="?", default=None, help="a query, or - to read it from stdin")
    p.add_argument("--max-rows", type=int, default=200)

    p = add("graph", cmd_graph, "export one rank class's traced graph (networkx) as GraphML or Graphviz dot")
    p.add_argument("--workload", required=True)
    p.add_argument("--class", dest="class_id", type=int, required=True, help="class_id in rank_classes.parquet")
    p.add_argument("--format", choices=("graphml", "dot"), default="graphml")
    p.add_argument("--out", type=Path, default=None, help="output file (default: RESULTS/trace/W/classC.FORMAT)")

    p = add("chakra-export", cmd_chakra_export, "write each traced rank's graph as a Chakra execution trace "
            "(schema 0.0.4, as ASTRA-sim reads it), costed when --hardware is given")
    p.add_argument("--workload", required=True)
    p.add_argument("--hardware", help="a profiled hardware: each compute node's duration from its kernels.parquet")
    p.add_argument("--out", type=Path, help="output folder (default: RESULTS/chakra/WORKLOAD)")

    p = add("chakra-import", cmd_chakra_import, "a workload's trace tables from Chakra execution traces (Echo's "
            "export, or another tool's prefix.RANK.et graphs), for dedup, profile and simulate to run on")
    p.add_argument("path", type=Path, help="a folder of .et files (and its comm_groups.json), or one file")
    p.add_argument("--workload", required=True, help="the workload whose layout and schedule the graphs run in")

    p = add("diff", cmd_diff, "op, shape and collective differences between two traced workloads, per role")
    p.add_argument("a", help="a traced workload (e.g. one with zero 1)")
    p.add_argument("b", help="another (e.g. the same with zero 3)")
    p.add_argument("--max-rows", type=int, default=200)

    add("report", cmd_report, "print the summaries of all simulated experiments")

    p = add("collective", cmd_collective, "estimate one collective on a topology (calibrated first)")
    p.add_argument("--topology", required=True)
    p.add_argument("--op", required=True, help="all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send | recv")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--bytes", type=parse_bytes, required=True, help="message size, e.g. 1048576, 64KB, 1MiB")
    p.add_argument("--nccl-algo", default=None, help="force NCCL's algorithm as NCCL_ALGO does: Ring, Tree, NVLS, "
                   "NVLSTree, a list, or ^excluded (default: the topology's nccl.algo, else NCCL's choice)")
    p.add_argument("--nccl-proto", default=None, help="force the protocol as NCCL_PROTO does: LL, LL128, Simple "
                   "(default: the topology's nccl.proto, else NCCL's choice)")

    p = add("import-kineto", cmd_import_kineto, "import a real job's GPU profiler (Kineto) traces: kernels with "
            "their ops, shapes, collectives, steps and streams, and the hardware model's error on them")
    p.add_argument("path", type=Path, help="a trace file (.json, .json.gz) or a folder of per-rank files")
    p.add_argument("--hardware", required=True, help="the hardware file whose model is checked on the kernels")
    p.add_argument("--workload", help="a traced workload: fill kernel_key where its kernels match the job's")
    p.add_argument("--out", type=Path, help="output folder (default: RESULTS/import/JOB/HARDWARE)")

    p = add("fit-overlay", cmd_fit_overlay, "a hardware profile overlay from imported real jobs' kernels "
            "(per shape regime, fitted on a declared split, its held-out error printed)")
    p.add_argument("jobs", nargs="+", help="imports (RESULTS/import/JOB/HARDWARE) to build it from")
    p.add_argument("--hardware", required=True)
    p.add_argument("--out", type=Path, help="output file (default: RESULTS/fit/overlay/JOB/HARDWARE.json)")

    p = add("explain", cmd_explain, "an imported real job's step, phase by phase, measured beside what Echo's "
            "models give for the same kernels and messages, largest differences first")
    p.add_argument("job", help="the import's job name (RESULTS/import/JOB/HARDWARE, from import-kineto)")
    p.add_argument("--hardware", required=True)
    p.add_argument("--topology", help="price the job's collectives on this topology's model (default: measured only)")
    p.add_argument("--workload", help="the job's workload, simulated on HARDWARE and TOPOLOGY: its step, compute, "
                   "exposed communication and bubble beside the measured")

    p = add("status", cmd_status, "what is cached and what would re-run, and why (Snakemake's dry run, explained)")
    p.add_argument("targets", nargs="*", help="Snakemake targets (default: rule all)")
    p.add_argument("--workdir", type=Path, default=Path("."), help="the workflow's folder (default: .)")
    p.add_argument("--snakemake-args", nargs=argparse.REMAINDER, default=[],
                   help="passed on to snakemake, e.g. --config 'sweeps=[gpt3-175b-a100-1024]'")

    p = add("sweep", cmd_sweep, "a sweep's layouts (kept or dropped, with why) and, once simulated, the best")
    p.add_argument("sweep", help="a config/sweeps/ file's name")
    p.add_argument("--top", type=int, default=3, help="best layouts to show (default 3)")

    p = add("search", cmd_search, "rank every layout of a sweep file, each rank composed from layer templates "
            "(thousands of layouts in minutes; writes results/search/SPEC/)")
    p.add_argument("spec", help="a config/sweeps/ file's name, or a spec file's path (*.yaml)")
    p.add_argument("--cores", type=int, default=None, help="worker processes (default: the CPUs this may use)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default results/search/SPEC)")
    p.add_argument("--templates", type=Path, default=None,
                   help="the layer templates' cache (default results/templates, shared by every search)")
    p.add_argument("--verify", type=int, default=None,
                   help="layouts whose composed rank is compared with a full trace (default: the spec's verify)")

    p = add("plan", cmd_plan, "time-to-train, interruptions, effective training time, checkpoints, cost and energy "
            "of a simulated workload (its summary.parquet) on a site's failure rates, storage and power")
    p.add_argument("workload")
    p.add_argument("--hardware", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--tokens", type=positive, required=True, help="tokens to train on, e.g. 15e12")
    p.add_argument("--site", default="meta-llama3-h100", help="a config/sites/ file (default: meta-llama3-h100)")
    p.add_argument("--days", type=positive, default=None, help="also the expected interruptions over this many days")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="checkpoint interval in steps (default: the interval that maximizes goodput, Daly 2006)")
    p.add_argument("--usd-per-gpu-hour", type=positive, default=None, help="price of a GPU-hour (default: the site's)")
    p.add_argument("--summary", type=Path, default=None,
                   help="a summary.parquet (default: RESULTS/simulate/WORKLOAD/HARDWARE/TOPOLOGY/summary.parquet)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")

    p = add("plan-search", cmd_plan_search, "time-to-train and cost against GPU count: each GPU count's fastest "
            "fitting layout of a search (results/search/SPEC/ranking.parquet), planned on a site")
    p.add_argument("spec", help="a config/sweeps/ search file's name, searched first")
    p.add_argument("--tokens", type=positive, required=True, help="tokens to train on, e.g. 15e12")
    p.add_argument("--site", default="meta-llama3-h100", help="a config/sites/ file (default: meta-llama3-h100)")
    p.add_argument("--usd-per-gpu-hour", type=positive, default=None, help="price of a GPU-hour (default: the site's)")
    p.add_argument("--out", type=Path, default=None, help="the search's folder (default RESULTS/search/SPEC)")

    add("versions", cmd_versions, "print each stage's code version (what the workflow's params compare)")

    p = add("fit", cmd_fit, "fit hardware files' kernel models to the reference folder's per-kernel tables "
            "(default: every fitted and transferred GPU) and print the errors")
    p.add_argument("hardware", nargs="*", help="hardware files (default: every fitted or transferred GPU)")
    p.add_argument("--write", action="store_true", help="replace each file's compute_model section with the fit's "
                   "values, provenance and fitted_by (today's fit code version)")
    return parser


def cmd_fit(args) -> int:
    """`python -m echo fit [--write] [hardware ...]`: `make fit` runs the same fit through the workflow."""
    import json

    from echo.config import CONFIG_ROOT
    from echo.fit import kernels
    from echo.workflow.versions import code_version

    code = code_version("fit")
    root = args.config_dir or CONFIG_ROOT
    for name in args.hardware or [*kernels.FITTED, *kernels.SAME_SILICON]:
        doc = kernels.fit_kernels(name)
        print(f"{name}: mean |error| % {json.dumps(doc['errors'], default=float)}")
        path = root / "hardware" / f"{name}.yaml"
        if args.write and path.is_file():
            kernels.write_compute_model(path, doc, code)
            print(f"  wrote {path} (fit code {code})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"echo: bad configuration: {exc}", file=sys.stderr)
        return 2
    except StageInputMissing as exc:
        print(f"echo: {exc}", file=sys.stderr)
        return 1
