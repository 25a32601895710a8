# Shared by the rule files, which include this first. config/config.yaml checked once
# (echo/workflow/settings.py), the artifact paths (echo/workflow/paths.py), each rule's params and
# config checks (echo/workflow/params.py, shared with `echo status`), the per-stage code versions.

from pathlib import Path

from echo.config.loader import config_path
from echo.workflow import paths
from echo.workflow.params import (
    CONFIG_DIR,
    calibrate_threads,
    hardware_config,
    hardware_memory,
    hardware_params,
    measurements,
    overlap_device,
    overlap_input,
    placed_topology_params,
    profile_threads,
    ranks_on_host,
    search_params,
    search_shard_inputs,
    search_shards,
    search_template_params,
    search_templates,
    site_params,
    shared_trace_files,
    simulate_mode_checked,
    sweep_checked,
    sweep_params,
    sweep_summaries,
    topology_config,
    topology_params,
    trace_workload_params,
    validated,
    workload_config,
    workload_params,
)
from echo.workflow.params import calibrate_priority as _calibrate_priority
from echo.workflow.settings import Settings
from echo.workflow.versions import code_version

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
    search=SWEEP_NAME,


SETTINGS = Settings.from_config(config)
EXPERIMENTS = [e.names for e in SETTINGS.experiments]
# the sweeps the report shows (default none; each runs on its own by asking for
# results/sweep/{sweep}/ranking.parquet). Set with --config 'sweeps=[a, b]'.
SWEEPS = SETTINGS.sweeps
# the searches whose time-to-train against GPU count the report shows (default none; a search of
# several GPU counts, e.g. --config 'searches=[gpt3-175b-a100-scaling]'), and the run planned
SEARCHES = SETTINGS.searches
PLAN = SETTINGS.plan


def calibrate_priority(wildcards):
    """The calibrate job's process priority, that of the measure stage's ranks (measure.priority)."""
    return _calibrate_priority(wildcards, SETTINGS.measure.priority)
