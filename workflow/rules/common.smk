# Helpers for the rule files, which include this first. Config loading, validated, one slice
# per stage; the default experiments; the per-stage code versions.

from functools import cache
from pathlib import Path

from echo.config import load_hardware, load_topology, load_workload
from echo.config.loader import check_placement, config_path
from echo.errors import ConfigError
from echo.versioning import code_version

# Config files are read from the working directory's config/ (as configfile: is).
CONFIG_DIR = Path("config")
NAME = "[A-Za-z0-9._-]+"


wildcard_constraints:
    workload=NAME,
    hardware=NAME,
    topology=NAME,


@cache
def workload_config(name):
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
