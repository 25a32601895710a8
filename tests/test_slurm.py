"""The workflow on a real SLURM: a single-node cluster from Debian's packages (munge, slurmctld,
slurmd, slurmdbd + MariaDB for accounting; tests/slurm_local.py) is installed if missing and
brought up as root, a tiny experiment and the GPU target run through `snakemake --profile profiles/slurm`
(snakemake-executor-plugin-slurm), and the results are compared with a local run's.

Only this module's daemons are stopped afterwards, by process id. Without root the test is
skipped, loudly; anything else that goes wrong (apt, a daemon, a job) fails it.
Run alone with `pytest -m slurm` (it takes a few minutes: about a minute of apt on a fresh
machine, ~10 s of bring-up, then the jobs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import (
    GPU_TARGET,
    TINY,
    TINY_TARGETS,
    copy_workflow,
    dry_run,
    snakemake,
    use_tiny_experiments,
    workflow_logs,
)

sys.path.insert(0, str(Path(__file__).parent))
from slurm_local import LocalSlurm, SlurmUnavailable, install  # noqa: E402

pytestmark = pytest.mark.slurm

# Rules that run on the submitting host (localrule: True / localrules:), not as SLURM jobs.
LOCAL_RULES = {"all", "report", "plot_experiment", "plot_overview", "plot_sweep", "plan_experiment",
               "plot_time_to_train", "sweep_trace", "sweep_layouts", "sweep_rank"}
# The experiments run through SLURM: the one that shares its workload with GPU_TARGET, so that one
# trace feeds a measured (local-cpu) and a modelled (GPU) chain; every rule of the workflow runs as
# a job all the same, and the other tiny layouts add only more of the same jobs (they run locally
# in tiny_run, whose results these are compared with).
THROUGH_SLURM = [e for e in TINY if e[0] == GPU_TARGET[0]]
# Columns that hold wall-clock times of the run itself, not results.
WALL_CLOCK = {"trace_wall_s", "sim_wall_s"}


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("SLURM TEST SKIPPED: needs root to install and run munge/slurmctld/slurmd/slurmdbd "
                    f"(running as uid {os.geteuid()})")
    try:
        install_s = install()
    except SlurmUnavailable as exc:
        pytest.skip(f"SLURM TEST SKIPPED: {exc}")
    root = Path(tempfile.mkdtemp(prefix="echo-slurm-", dir="/tmp"))
    c = LocalSlurm(root)
    c.timings["install_s"] = install_s
    try:
        c.start()
        yield c
    finally:
        c.stop()
        print(f"\nSLURM timings: {json.dumps({k: round(v, 1) for k, v in c.timings.items()})}")
        shutil.rmtree(root, ignore_errors=True)


def table(path: Path, drop: set[str] = WALL_CLOCK):
    t = pq.read_table(path)
    return t.drop_columns([c for c in t.column_names if c in drop])


def test_tiny_experiments_through_slurm(tiny_run: Path, cluster: LocalSlurm, tmp_path: Path) -> None:
    wf = copy_workflow(tmp_path / "wf", source=tiny_run)  # the same code and configs as the local run
    use_tiny_experiments(wf, THROUGH_SLURM)
    planned = dry_run(wf, *TINY_TARGETS)
    expected = Counter(rule for rule, _ in planned if rule not in LOCAL_RULES)
    assert expected["trace"] == 1 and expected["simulate"] == len(THROUGH_SLURM) + 1, expected

    t0 = time.monotonic()
    # the profile as users run it; this node has 2 cores, so tracing may ask for 2 (not 8)
    proc = snakemake(wf, "--profile", "profiles/slurm", "--jobs", "4", "--set-threads", "trace=2",
                     "--slurm-init-seconds-before-status-checks", "2", *TINY_TARGETS, timeout=1800)
    cluster.timings["workflow_s"] = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:] + workflow_logs(wf) + cluster.logs()

    # every non-local job went through SLURM and completed there
    jobs = cluster.jobs()
    by_rule = Counter(m.group(1) for j in jobs if (m := re.match(r"rule_([a-z_]+?)(?:_wildcards_|$)", j["Comment"])))
    assert by_rule == expected, (by_rule, expected, jobs)
    assert all(j["State"] == "COMPLETED" and j["ExitCode"] == "0:0" for j in jobs), jobs
    assert "slurm" in (proc.stdout + proc.stderr).lower()

    # the results equal the local run's: traces, classes and the modelled GPU target exactly;
    # the local-cpu ones (kernels timed on this busy CPU) in shape
    local, remote = tiny_run / "results", wf / "results"
    for w, _, _ in THROUGH_SLURM:
        for name in ("ops", "comms", "deps", "ranks"):
            assert table(remote / "trace" / w / f"{name}.parquet").equals(
                table(local / "trace" / w / f"{name}.parquet")), (w, name)
        assert table(remote / "dedup" / w / "rank_classes.parquet").equals(
            table(local / "dedup" / w / "rank_classes.parquet")), w
    w, h, t = GPU_TARGET
    assert table(remote / "calibrate" / t / "collectives.parquet").equals(table(local / "calibrate" / t / "collectives.parquet"))
    for name in ("summary", "timeline"):
        path = Path("simulate", w, h, t, f"{name}.parquet")
        assert table(remote / path).equals(table(local / path)), name
    for w, h, t in THROUGH_SLURM:
        path = Path("simulate", w, h, t, "summary.parquet")
        got, want = pq.read_table(remote / path).to_pylist()[0], pq.read_table(local / path).to_pylist()[0]
        assert got.keys() == want.keys()
        for key in ("workload", "hardware", "topology", "world_size", "micro_batches", "classes", "fits"):
            assert got.get(key) == want.get(key), (path, key)
        assert got["step_time_s"] > 0 and got["compute_s"] > 0
        kernels = Path("profile", w, h, "kernels.parquet")
        assert set(pq.read_table(remote / kernels).column("kernel_key").to_pylist()) == set(
            pq.read_table(local / kernels).column("kernel_key").to_pylist())
    # the local rules ran here: the report and its figures
    assert (remote / "report" / "summaries.parquet").is_file()
    assert list((remote / "report" / "experiments").rglob("gantt.svg"))
    assert cluster.timings["bring_up_s"] < 120


def _cancel_when_running(cluster: LocalSlurm, rule: str, times: int, stop: threading.Event) -> list[str]:
    """scancel the job of ``rule`` once it runs, up to ``times`` jobs (each a retry of the last)."""
    cancelled: list[str] = []
    while len(cancelled) < times and not stop.is_set():
        out = cluster.cmd("squeue", "-h", "-o", "%i|%T|%k", check=False).stdout
        for line in out.splitlines():
            jobid, state, comment = (line.split("|") + ["", ""])[:3]
            if comment.startswith(f"rule_{rule}") and state == "RUNNING" and jobid not in cancelled:
                cluster.cmd("scancel", jobid)
                cancelled.append(jobid)
        time.sleep(0.2)
    return cancelled


def _run_with_cancels(wf: Path, cluster: LocalSlurm, rule: str, times: int, *extra: str):
    stop, found = threading.Event(), {}
    watcher = threading.Thread(target=lambda: found.setdefault("ids", _cancel_when_running(cluster, rule, times, stop)))
    watcher.start()
    try:
        proc = snakemake(wf, "--profile", "profiles/slurm", "--jobs", "2", "--set-threads", "trace=2",
                         "--slurm-init-seconds-before-status-checks", "2", *extra, TINY_TARGETS[1], timeout=1800)
    finally:
        stop.set()
        watcher.join()
    return proc, found.get("ids", [])


def test_a_cancelled_job_is_retried_and_the_run_completes(tiny_run: Path, cluster: LocalSlurm, tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    shutil.copytree(tiny_run, wf, symlinks=True)
    w, h, t = GPU_TARGET
    # the trace re-runs (the longest job), then its chain: Snakemake re-creates a missing file only
    # for a job that must run, so the chain's outputs go too
    outputs = [*(Path("trace", w, f"{n}.parquet") for n in ("ops", "comms", "deps", "ranks")),
               Path("dedup", w, "rank_classes.parquet"), Path("profile", w, h, "kernels.parquet"),
               *(Path("simulate", w, h, t, f) for f in ("summary.parquet", "timeline.parquet", "schedule.parquet",
                                                         "trace.json"))]
    for out in outputs:
        (wf / "results" / out).unlink()
    proc, cancelled = _run_with_cancels(wf, cluster, "trace", 1)
    assert len(cancelled) == 1, (cancelled, proc.stdout[-3000:] + proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:] + workflow_logs(wf) + cluster.logs()
    states = {j["JobID"]: j["State"] for j in cluster.jobs() if j["Comment"].startswith("rule_trace")}
    assert states[cancelled[0]].startswith("CANCELLED") and "COMPLETED" in states.values(), states
    summary = Path("results", "simulate", w, h, t, "summary.parquet")
    assert table(wf / summary).equals(table(tiny_run / summary))


def test_a_job_that_keeps_failing_is_reported_not_retried_forever(tiny_run: Path, cluster: LocalSlurm,
                                                                  tmp_path: Path) -> None:
    wf = tmp_path / "wf"
    shutil.copytree(tiny_run, wf, symlinks=True)
    w, h, t = GPU_TARGET
    for name in ("summary", "timeline", "schedule"):
        (wf / "results" / "simulate" / w / h / t / f"{name}.parquet").unlink()
    (wf / "results" / "simulate" / w / h / t / "trace.json").unlink()
    proc, cancelled = _run_with_cancels(wf, cluster, "simulate", 2, "--retries", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and len(cancelled) == 2, (cancelled, out[-5000:])
    assert "Error in rule simulate" in out and "CANCELLED" in out, out[-5000:]
    assert not (wf / "results" / "simulate" / w / h / t / "summary.parquet").exists()
