# Helpers for the rule files, which include this first. Config loading, validated, one slice
# per stage; the default experiments and sweeps; the per-stage code versions.

from functools import cache
from glob import glob
from pathlib import Path

from echo.config import load_hardware, load_topology, load_workload
from echo.config.loader import check_placement, config_path
from echo.errors import ConfigError
from echo.sweep import expansion, is_sweep_name, layouts_table, shared_trace, summary_paths, sweep_workload
from echo.validate.measure import settings as measure_settings
from echo.versioning import code_version

# Config files are read from the working directory's config/ (as configfile: is).
CONFIG_DIR = Path("config")
NAME = "[A-Za-z0-9._-]+"
# A sweep's name has no "--" (it separates the sweep from a layout's tokens in workload names).
SWEEP_NAME = "(?:(?!--)[A-Za-z0-9._-])+"
# A sweep layout's workload name (not a shared trace's): {sweep}--{tokens}, see echo/sweep/spec.py.
LAYOUT_NAME = f"{SWEEP_NAME}--(?!trace-){SWEEP_NAME}"


wildcard_constraints:
    workload=NAME,
    hardware=NAME,
    topology=NAME,
    sweep=SWEEP_NAME,


@cache
def workload_config(name):
    """A workload file's, or a sweep layout's ({sweep}--{tokens}, generated from
    config/sweeps/{sweep}.yaml: see echo/sweep/spec.py)."""
    if is_sweep_name(name):
        return sweep_workload(name, root=CONFIG_DIR)
    return load_workload(name, root=CONFIG_DIR)


@cache
def hardware_config(name):
    return load_hardware(name, root=CONFIG_DIR)


@cache
def topology_config(name):
    return load_topology(name, root=CONFIG_DIR)


# --- params: each rule gets only its slice, as a plain dict (Snakemake compares its repr) ---


def workload_params(wildcards):
    return workload_config(wildcards.workload).model_dump()


def trace_workload_params(wildcards):
    """The workload slice of trace and dedup: without the simulation-only keys (overlap flags,
    echo.config.workload.SIMULATION_ONLY), so flipping one re-runs the simulation only."""
    return workload_config(wildcards.workload).trace_dump()


def hardware_params(wildcards):
    return hardware_config(wildcards.hardware).model_dump()


def topology_params(wildcards):
    return topology_config(wildcards.topology).model_dump()


def placed_topology_params(wildcards):
    """The topology slice of a simulate job, after checking the workload fits its nodes."""
    topology = topology_config(wildcards.topology)
    check_placement(
        workload_config(wildcards.workload),
        topology,
        config_path("topology", wildcards.topology, CONFIG_DIR),
    )
    return topology.model_dump()


# --- validation while the DAG is built ----------------------------------------------------
# Snakemake evaluates params lazily (a job that must run anyway may have its params computed
# only when it starts), but input functions always run while the DAG is built. So each rule's
# input function validates every config its job reads: a bad file is refused, naming the file,
# key and reason, before any job runs.


def validated(*kinds):
    """An input function that adds no files: it checks the named configs of the job's
    wildcards (workload, hardware, topology, placement = topology + workload fit)."""
    check = {
        "workload": workload_params,
        "hardware": hardware_params,
        "topology": topology_params,
        "placement": placed_topology_params,
    }

    def inputs(wildcards):
        for kind in kinds:
            check[kind](wildcards)
        return []

    return inputs


def profile_threads(wildcards):
    """Kernels timed on this machine (a cpu hardware file) get both cores to themselves: timings
    taken next to another job are noisy (shared/TRACING-NOTES.md). Modelled GPUs need one."""
    return 2 if hardware_config(wildcards.hardware).kind == "cpu" else 1


def calibrate_threads(wildcards):
    """A local gloo benchmark runs its ranks as processes: give it the cores they use."""
    calibration = topology_config(wildcards.topology).calibration
    return calibration.ranks if calibration.source == "gloo_benchmark" else 1


def calibrate_priority(wildcards):
    """A local gloo benchmark runs its ranks as the measure stage runs the training ranks whose
    collectives it predicts (config measure.priority); other calibrations start no process."""
    if topology_config(wildcards.topology).calibration.source != "gloo_benchmark":
        return "none"
    return measure_settings(config.get("measure") or {})["priority"]


# --- experiments -----------------------------------------------------------------------------

EXPERIMENT_KEYS = ("workload", "hardware", "topology")


def read_experiments(entries):
    """config["experiments"] as a list of (workload, hardware, topology), checked for shape."""
    if not isinstance(entries, list):
        raise ConfigError("config/config.yaml", "experiments", "expected a list of {workload, hardware, topology}")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != set(EXPERIMENT_KEYS):
            raise ConfigError(
                "config/config.yaml",
                f"experiments.{i}",
                f"expected exactly the keys {', '.join(EXPERIMENT_KEYS)}; got {entry!r}",
            )
        out.append(tuple(str(entry[k]) for k in EXPERIMENT_KEYS))
    return out


EXPERIMENTS = read_experiments(config.get("experiments", []))

SIMULATE_OUTPUTS = ("summary.parquet", "timeline.parquet", "trace.json")


def experiment_targets(experiments):
    """The simulate outputs of each experiment."""
    return [
        f"results/simulate/{w}/{h}/{t}/{name}"
        for w, h, t in experiments
        for name in SIMULATE_OUTPUTS
    ]


def experiment_summaries(experiments):
    return [f"results/simulate/{w}/{h}/{t}/summary.parquet" for w, h, t in experiments]


# --- sweeps ------------------------------------------------------------------------------------
# config["sweeps"]: the sweeps the report shows (default none; they are run on their own by
# asking for results/sweep/{sweep}/ranking.parquet). Set with --config 'sweeps=[a, b]'.


def read_sweeps(entry):
    names = [entry] if isinstance(entry, str) else entry
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError("config/config.yaml", "sweeps", f"expected a list of sweep names; got {entry!r}")
    return names


SWEEPS = read_sweeps(config.get("sweeps", []) or [])

TRACE_TABLES = ("ops", "comms", "deps", "ranks")


def sweep_expansion(wildcards):
    return expansion(wildcards.sweep, root=CONFIG_DIR)


def sweep_checked(wildcards):
    """No files: expands the sweep while the DAG is built, so a bad sweep file is refused
    (file, key, reason) before any job runs."""
    sweep_expansion(wildcards)
    return []


def sweep_params(wildcards):
    """Everything the sweep decides: its file, each candidate (kept or dropped, why) and the
    workloads it generates. A change to any of them re-runs the sweep's own rules only; each
    layout's stages depend on its own workload params (workload_config above)."""
    exp = sweep_expansion(wildcards)
    return {
        "sweep": exp.sweep.model_dump(),
        "layouts": layouts_table(exp).to_pylist(),
        "workloads": {c.name: c.workload.model_dump() for c in exp.kept},
    }


def sweep_summaries(wildcards):
    return summary_paths(sweep_expansion(wildcards))


def shared_trace_files(wildcards):
    """The tables of the trace a sweep layout shares with layouts that trace alike."""
    shared = shared_trace(wildcards.workload, root=CONFIG_DIR)
    return {name: f"results/trace/{shared}/{name}.parquet" for name in TRACE_TABLES}


# --- the report ---------------------------------------------------------------------------------

EXPERIMENT_FIGURES = ("gantt.svg", "memory.svg", "trace.json")


def experiment_figures(experiments):
    return [
        f"results/report/experiments/{w}/{h}/{t}/{name}"
        for w, h, t in experiments
        for name in EXPERIMENT_FIGURES
    ]


def sweep_figures(sweeps):
    return [f"results/report/sweeps/{s}/heatmap.svg" for s in sweeps]


def measurements(wildcards):
    """The measurements the predictions are compared with, where the validation rules (`make
    validate`) wrote any: {path: mtime} of results/validate/**/*.parquet and
    results/measure/*/measured.parquet. Params, not inputs: the report reads what exists and never
    makes the workflow measure; a new or re-made measurement changes the params, so the figure
    is redrawn."""
    files = sorted(glob("results/validate/**/*.parquet", recursive=True)) + sorted(
        glob("results/measure/*/measured.parquet")
    )
    return {f: Path(f).stat().st_mtime for f in files}


def hardware_memory(wildcards):
    """The one hardware figure the memory plot draws (its limit line)."""
    return hardware_config(wildcards.hardware).memory_gib
