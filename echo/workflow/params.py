"""Each rule's params, threads and config checks, as plain functions of a job's wildcards and the
config folder: workflow/rules/*.smk name them, and ``echo status`` calls the very same ones to say
which keys of a job's params changed.

Snakemake re-runs a job when the repr of its params changes, so each rule gets only its own
config slice, as a plain dict. It computes params lazily (maybe only when the job starts), but
input functions always run while the DAG is built: ``validated`` checks a job's configs there,
so a bad file is refused, naming file, key and reason, before any job runs.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from echo.config import load_hardware, load_site, load_topology, load_workload
from echo.config.limits import full_mode_refusal
from echo.config.loader import check_numerics, check_placement, config_path
from echo.errors import ConfigError
from echo.sweep import expansion, is_sweep_name, layouts_table, shared_trace, sweep_workload
from echo.workflow import paths

CONFIG_DIR = Path("config")  # as configfile: reads it, relative to the working directory


@cache
def workload_config(name: str, root: Path = CONFIG_DIR):
    """A workload file's, or a sweep layout's ({sweep}--{tokens}, from config/sweeps/{sweep}.yaml)."""
    return sweep_workload(name, root=root) if is_sweep_name(name) else load_workload(name, root=root)


@cache
def hardware_config(name: str, root: Path = CONFIG_DIR):
    return load_hardware(name, root=root)


@cache
def topology_config(name: str, root: Path = CONFIG_DIR):
    return load_topology(name, root=root)


def workload_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    return workload_config(wildcards.workload, root).model_dump()


def trace_workload_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    """The workload slice of trace and dedup: without the keys the tracer does not read
    (echo.config.workload), so changing one of those re-runs the simulation only."""
    return workload_config(wildcards.workload, root).trace_dump()


def hardware_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    return hardware_config(wildcards.hardware, root).model_dump()


def topology_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    return topology_config(wildcards.topology, root).model_dump()


def site_params(name: str, root: Path = CONFIG_DIR) -> dict:
    """A site file (config/sites/), checked when the rule files are read: the plan rules' params."""
    return load_site(name, root).model_dump()


def numerics_checked(wildcards, root: Path = CONFIG_DIR) -> None:
    """The workload's precision (FP8 recipe) runs on the hardware's tensor cores."""
    check_numerics(workload_config(wildcards.workload, root), hardware_config(wildcards.hardware, root),
                   config_path("hardware", wildcards.hardware, root))


def placed_topology_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    """The topology slice of a simulate job, after checking the workload fits its nodes."""
    topology = topology_config(wildcards.topology, root)
    check_placement(workload_config(wildcards.workload, root), topology,
                    config_path("topology", wildcards.topology, root))
    return topology.model_dump()


# The config slices in each rule's params, by param name (the rule files name the same
# functions; tests/test_workflow.py checks): what `echo status` recomputes to name changed keys.
CONFIG_PARAMS = {
    "trace": {"workload": trace_workload_params},
    "dedup": {"workload": trace_workload_params},
    "profile": {"hardware": hardware_params},
    "calibrate": {"topology": topology_params},
    "simulate": {"workload": workload_params, "hardware": hardware_params, "topology": placed_topology_params},
    "measure": {"workload": workload_params},
}


def validated(*kinds: str, root: Path = CONFIG_DIR):
    """An input function that adds no files: it checks the named configs of the job's wildcards
    (workload, hardware, topology, placement = topology + workload fit, numerics = the workload's
    precision on the hardware)."""
    check = {"workload": workload_params, "hardware": hardware_params, "topology": topology_params,
             "placement": placed_topology_params, "numerics": numerics_checked}

    def inputs(wildcards) -> list:
        for kind in kinds:
            check[kind](wildcards, root)
        return []

    return inputs


def simulate_mode_checked(mode: str, root: Path = CONFIG_DIR):
    """An input function that adds no files: full mode (settings ``simulate.mode``) replays every
    rank, so a workload with more ranks than the limit is refused while the DAG is built."""

    def inputs(wildcards) -> list:
        if mode == "full" and (reason := full_mode_refusal(workload_config(wildcards.workload, root))):
            raise ConfigError("config/config.yaml", "simulate.mode", reason)
        return []

    return inputs


def profile_threads(wildcards, root: Path = CONFIG_DIR) -> int:
    """Kernels timed on this machine (a cpu hardware file) get both cores to themselves: timings
    taken next to another job are noisy. Modelled GPUs need one."""
    return 2 if hardware_config(wildcards.hardware, root).kind == "cpu" else 1


def ranks_on_host(wildcards, root: Path = CONFIG_DIR) -> int:
    """The profile job's count of the workload's ranks that run side by side on one host."""
    from echo.profile.eager import colocated_ranks  # only profile jobs need the profile package

    return colocated_ranks(workload_config(wildcards.workload, root).world_size)


def calibrate_threads(wildcards, root: Path = CONFIG_DIR) -> int:
    """A local gloo benchmark runs its ranks as processes: give it the cores they use."""
    calibration = topology_config(wildcards.topology, root).calibration
    return calibration.ranks if calibration.source == "gloo_benchmark" else 1


def calibrate_priority(wildcards, priority: str, root: Path = CONFIG_DIR) -> str:
    """A local gloo benchmark runs its ranks as the measure stage runs the training ranks whose
    collectives it predicts (``priority``: settings measure.priority); other calibrations start
    no process."""
    return priority if topology_config(wildcards.topology, root).calibration.source == "gloo_benchmark" else "none"


def overlap_input(wildcards, root: Path = CONFIG_DIR) -> list[str]:
    """The simulate job's overlap slowdown input: this machine's measurement for cpu hardware;
    GPUs use the table in echo/overlap/table.py (covered by the code version)."""
    hardware = hardware_config(wildcards.hardware, root)
    return [paths.OVERLAP("slowdown.parquet", hardware=hardware.name)] if hardware.kind == "cpu" else []


def overlap_device(wildcards, root: Path = CONFIG_DIR) -> dict:
    """The overlap rule's params: refuses a GPU (nothing to measure on this machine)."""
    hardware = hardware_config(wildcards.hardware, root)
    if hardware.kind != "cpu":
        raise ConfigError(config_path("hardware", hardware.name, root), "kind",
                          "the overlap slowdown is measured on this machine only (kind: cpu); GPUs use the "
                          "published figures in echo/overlap/table.py")
    return {"name": hardware.name, "kind": hardware.kind}


def hardware_memory(wildcards, root: Path = CONFIG_DIR) -> float:
    """The one hardware figure the memory plot draws (its limit line)."""
    return hardware_config(wildcards.hardware, root).memory_gib


def measurements(wildcards) -> dict[str, float]:
    """The measurements the predictions are compared with, where the validation rules wrote any:
    {path: mtime}. Params, not inputs: the report reads what exists and never makes the workflow
    measure; a new or re-made measurement changes the params, so the figure is redrawn."""
    return {f: Path(f).stat().st_mtime for f in paths.measurements()}


# --- sweeps ------------------------------------------------------------------------------------


def sweep_checked(wildcards, root: Path = CONFIG_DIR) -> list:
    """No files: expands the sweep while the DAG is built, so a bad sweep file is refused (file,
    key, reason) before any job runs."""
    expansion(wildcards.sweep, root=root)
    return []


def sweep_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    """Everything the sweep decides: its file, each candidate (kept or dropped, why) and the
    workloads it generates. A change to any of them re-runs the sweep's own rules only; each
    layout's stages depend on its own workload params."""
    exp = expansion(wildcards.sweep, root=root)
    return {"sweep": exp.sweep.model_dump(), "layouts": layouts_table(exp).to_pylist(),
            "workloads": {c.name: c.workload.model_dump() for c in exp.kept}}


def sweep_summaries(wildcards, root: Path = CONFIG_DIR) -> list[str]:
    return paths.sweep_summaries(expansion(wildcards.sweep, root=root))


def shared_trace_files(wildcards, root: Path = CONFIG_DIR) -> dict[str, str]:
    """The tables of the trace a sweep layout shares with layouts that trace alike."""
    return paths.trace_tables(shared_trace(wildcards.workload, root=root))


@cache
def search_plan(name: str, root: Path = CONFIG_DIR):
    """The search's jobs (echo.sweep.search_jobs.make_plan), from its file alone: every job, on
    any node, computes the same plan."""
    from echo.sweep.search import make_plan

    return make_plan(name, root)


def search_template_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    """The template jobs of one block signature of the search: each one's template workload and
    the ranks traced (one Snakemake job a signature: its jobs share the process's warm-up)."""
    plan = search_plan(wildcards.search, root)
    jobs = {key.split("/")[1]: {"workload": tw.model_dump(), "ranks": list(ranks)}
            for key, (tw, ranks) in plan.templates.items() if key.split("/")[0] == wildcards.signature}
    if not jobs:
        raise ConfigError(plan.exp.path, "axes", f"no layout of the search has block signature {wildcards.signature}")
    return jobs


def search_templates(wildcards, root: Path = CONFIG_DIR, keys: list[str] | None = None) -> list[str]:
    """The search's template folders, one per block signature (``keys``: those holding these jobs)."""
    plan = search_plan(wildcards.search, root)
    signatures = sorted({key.split("/")[0] for key in (plan.templates if keys is None else keys)})
    return [paths.SEARCH("templates", sig, search=wildcards.search) for sig in signatures]


def search_shard_inputs(wildcards, root: Path = CONFIG_DIR) -> dict[str, list[str]]:
    """What one shard of a search's layouts reads: its template folders, the composition checks
    (a wrong graph fails the search before any shard runs) and each topology's calibration."""
    from echo.sweep.search import shard_templates

    plan = search_plan(wildcards.search, root)
    shard = int(wildcards.shard)
    if not 0 <= shard < len(plan.shards):
        raise ConfigError(plan.exp.path, "shards", f"shard {shard}: the search has {len(plan.shards)} shards")
    return {"templates": search_templates(wildcards, root, shard_templates(plan, shard)),
            "verify": [paths.SEARCH("verify.parquet", search=wildcards.search)],
            "networks": [paths.CALIBRATE("network.json", topology=t) for t in plan.exp.sweep.topologies]}


def search_shards(wildcards, root: Path = CONFIG_DIR) -> list[str]:
    plan = search_plan(wildcards.search, root)
    return [paths.SEARCH("shards", f"{k}.parquet", search=wildcards.search) for k in range(len(plan.shards))]


def search_params(wildcards, root: Path = CONFIG_DIR) -> dict:
    """Everything a search decides (its file, its hardware and topologies), checked while the DAG
    is built: a bad search file is refused (file, key, reason) before any job runs. A change to
    any of them re-runs the search."""
    from echo.sweep.search import expand_search

    exp = expand_search(wildcards.search, root=root)
    s = exp.sweep
    return {"spec": s.model_dump(), "hardware": load_hardware(s.hardware, root).model_dump(),
            "topologies": [load_topology(t, root).model_dump() for t in s.topologies]}
