"""Every artifact path of the workflow, once: the rules' patterns, the CLI's files under
``--results``, the audit's views, a sweep's summaries and the report's figures.

A ``Folder`` is one stage's output folder with the rules' {wildcards}: ``TRACE("ops.parquet")`` is
the rule pattern ``results/trace/{workload}/ops.parquet``, ``TRACE("ops.parquet",
workload="tiny-dp2", results=args.results)`` one file of it. Stages do not build these paths;
they are handed them (this module is above them).
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from echo.sweep import Expansion

RESULTS = "results"
_WILDCARD = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Folder:
    """A stage's output folder under the results folder."""

    pattern: str
    """Relative to the results folder; each {wildcard} is one path component, e.g. trace/{workload}."""

    def under(self, *files: str, **names: str) -> str:
        """``files`` in the folder, relative to the results folder, with the given wildcards filled
        (the others stay {wildcards}, as rule patterns)."""
        return _WILDCARD.sub(lambda m: names.get(m.group(1), m.group(0)), "/".join([self.pattern, *files]))

    def __call__(self, *files: str, results: str | Path = RESULTS, **names: str) -> str:
        """``files`` in the folder under ``results`` (default results/, where the rules write)."""
        return f"{Path(results).as_posix()}/{self.under(*files, **names)}"

    def glob(self, *files: str, results: str | Path = RESULTS) -> list[str]:
        """The existing files ``files`` of every instance of the folder (each wildcard a *, ** any
        folders), in order."""
        return sorted(glob.glob(_WILDCARD.sub("*", self(*files, results=results)), recursive=True))


TRACE = Folder("trace/{workload}")
DEDUP = Folder("dedup/{workload}")
PROFILE = Folder("profile/{workload}/{hardware}")
PROFILE_CACHE = Folder("profile/_cache")  # kernel timings shared by every profile job on this machine
CALIBRATE = Folder("calibrate/{topology}")
OVERLAP = Folder("overlap/{hardware}")
SIMULATE = Folder("simulate/{workload}/{hardware}/{topology}")
MEASURE = Folder("measure/{workload}")
VALIDATE = Folder("validate")
COMPARE = Folder("validate/{workload}/{hardware}/{topology}")
SWEEP = Folder("sweep/{sweep}")
SEARCH = Folder("search/{search}")
TEMPLATES = Folder("templates")  # `echo search`'s layer templates, shared by its searches (a rule's: SEARCH/templates)
REPORT = Folder("report")
EXPERIMENT_FIGURES = Folder("report/experiments/{workload}/{hardware}/{topology}")
SWEEP_FIGURES = Folder("report/sweeps/{sweep}")
SEARCH_FIGURES = Folder("report/searches/{search}")
PLAN = Folder("plan/{workload}/{hardware}/{topology}")  # an experiment's run: echo.plan
FIT = Folder("fit")
IMPORT = Folder("import/{job}/{hardware}")
OVERLAY = Folder("fit/overlay/{job}")  # {hardware}.json: a real job's kernels over the model (echo.profile.overlay)  # a real job's GPU Kineto traces, read (echo.profile.gpu_import)

TRACE_TABLES = ("ops", "comms", "deps", "ranks")
SIMULATE_OUTPUTS = ("summary.parquet", "timeline.parquet", "trace.json")
FIGURES = ("gantt.svg", "memory.svg", "trace.json")  # of each experiment

# The audit's views (echo.report.audit): view name -> its files, relative to the results folder.
VIEWS = {
    "ops": TRACE.under("ops.parquet"),
    "comms": TRACE.under("comms.parquet"),
    "deps": TRACE.under("deps.parquet"),
    "traced_ranks": TRACE.under("ranks.parquet"),
    "rank_classes": DEDUP.under("rank_classes.parquet"),
    "kernels": PROFILE.under("kernels.parquet"),
    "collectives": CALIBRATE.under("collectives.parquet"),
    "calibration_measurements": CALIBRATE.under("measurements.parquet"),
    "summary": SIMULATE.under("summary.parquet"),
    "timeline": SIMULATE.under("timeline.parquet"),
    "overlap_slowdown": OVERLAP.under("slowdown.parquet"),
    "measured": MEASURE.under("measured.parquet"),
    "measured_phases": MEASURE.under("phases.parquet"),
    "compare": COMPARE.under("compare.parquet"),
    "published": VALIDATE.under("published.parquet"),
    "sweep_layouts": SWEEP.under("layouts.parquet"),
    "sweep_ranking": SWEEP.under("ranking.parquet"),
    "plan": PLAN.under("plan.parquet"),
    "imported_activity": IMPORT.under("activity.parquet"),
    "imported_streams": IMPORT.under("streams.parquet"),
    "imported_model_error": IMPORT.under("model_error.parquet"),
}

Names = tuple[str, str, str]  # an experiment: (workload, hardware, topology)


def fit(hardware: str = "{hardware}", results: str | Path = RESULTS) -> str:
    """The fitted figures of a hardware (echo.fit): results/fit/{hardware}.json."""
    return FIT("{hardware}.json", hardware=hardware, results=results)


def trace_tables(workload: str = "{workload}", results: str | Path = RESULTS) -> dict[str, str]:
    """A trace's tables by name (ops, comms, deps, ranks), as rule inputs or outputs."""
    return {t: TRACE(f"{t}.parquet", workload=workload, results=results) for t in TRACE_TABLES}


def simulated(experiments: Iterable[Names], *files: str) -> list[str]:
    """``files`` (default every simulate output) of each experiment."""
    return [SIMULATE(f, workload=w, hardware=h, topology=t) for w, h, t in experiments
            for f in files or SIMULATE_OUTPUTS]


def experiment_figures(experiments: Iterable[Names]) -> list[str]:
    return [EXPERIMENT_FIGURES(f, workload=w, hardware=h, topology=t) for w, h, t in experiments for f in FIGURES]


def sweep_figures(sweeps: Iterable[str]) -> list[str]:
    return [SWEEP_FIGURES("heatmap.svg", sweep=s) for s in sweeps]


def search_figures(searches: Iterable[str]) -> list[str]:
    return [SEARCH_FIGURES("time_to_train.svg", search=s) for s in searches]


def planned(experiments: Iterable[Names]) -> list[str]:
    """Each experiment's plan (echo.plan): results/plan/{workload}/{hardware}/{topology}/plan.parquet."""
    return [PLAN("plan.parquet", workload=w, hardware=h, topology=t) for w, h, t in experiments]


def sweep_summaries(exp: Expansion) -> list[str]:
    """The simulate summaries a sweep ranks: every kept layout on every topology."""
    s = exp.sweep
    return simulated([(c.name, s.hardware, t) for c in exp.kept for t in s.topologies], "summary.parquet")


def measurements(results: str | Path = RESULTS) -> list[str]:
    """The measurements written so far: results/validate/**/*.parquet, results/measure/*/measured.parquet."""
    return VALIDATE.glob("**/*.parquet", results=results) + MEASURE.glob("measured.parquet", results=results)
