"""Killed jobs resume (issue: faults and bad input). Each case copies the finished tiny run
(tests/conftest.py: tiny_run, whose GPU target's chain is modelled and so deterministic), deletes
one stage's outputs, re-runs the same Snakemake command while a watcher SIGKILLs that stage's job
(its whole process tree, as a pre-empted node would, or one trace worker) at a seeded random point
of its measured duration, then runs the command again. Every case must end with outputs equal to
the uninterrupted run's (Parquet content, wall-clock columns aside), and the killed run must never
leave an output that is partial: an output either is absent or passes echo.io's checks."""

from __future__ import annotations

import csv
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from conftest import GPU_TARGET, snakemake

from echo.errors import ArtifactError
from echo.io import read_parquet
from echo.workflow import paths

pytestmark = pytest.mark.slow

WORKLOAD, HARDWARE, TOPOLOGY = GPU_TARGET
TARGET = paths.SIMULATE("summary.parquet", workload=WORKLOAD, hardware=HARDWARE, topology=TOPOLOGY)
# Each stage of the chain: its outputs and its benchmark file (how long the job took uninterrupted).
OUTPUTS = {
    "trace": list(paths.trace_tables(WORKLOAD).values()),
    "dedup": [paths.DEDUP("rank_classes.parquet", workload=WORKLOAD)],
    "profile": [paths.PROFILE("kernels.parquet", workload=WORKLOAD, hardware=HARDWARE)],
    "calibrate": [paths.CALIBRATE("collectives.parquet", topology=TOPOLOGY),
                  paths.CALIBRATE("network.json", topology=TOPOLOGY)],
    "simulate": paths.simulated([GPU_TARGET]),
}
BENCHMARK = {
    "trace": f"results/benchmarks/trace/{WORKLOAD}.tsv",
    "dedup": f"results/benchmarks/dedup/{WORKLOAD}.tsv",
    "profile": f"results/benchmarks/profile/{WORKLOAD}/{HARDWARE}.tsv",
    "calibrate": f"results/benchmarks/calibrate/{TOPOLOGY}.tsv",
    "simulate": f"results/benchmarks/simulate/{WORKLOAD}/{HARDWARE}/{TOPOLOGY}.tsv",
}
# What re-runs after a stage: Snakemake re-creates a missing file only for a job that must run, so
# a case deletes the killed stage's outputs and those of every stage downstream of it.
DOWNSTREAM = {"trace": ["dedup", "profile", "simulate"], "dedup": ["simulate"], "profile": ["simulate"],
              "calibrate": ["simulate"], "simulate": []}
WALL_COLUMNS = {"trace_wall_s", "sim_wall_s"}  # how long this run took: differs run to run


@dataclass(frozen=True)
class Case:
    stage: str
    """The stage whose job is killed (its outputs are deleted first, so it re-runs)."""
    victim: str
    """What to kill: "job" (the job's script process and everything it started) or "worker"
    (one trace worker process only)."""
    seed: int
    """Seeds the kill point, a uniform fraction of the job's uninterrupted duration."""


CASES = [Case(stage, "job", seed) for stage in OUTPUTS for seed in (1, 2)] + [Case("trace", "worker", 3)]


@dataclass
class Watcher:
    """Finds the victim among snakemake's descendants and SIGKILLs its process tree after ``delay`` s."""

    root: psutil.Process
    pattern: str
    delay: float
    killed: list[str] = field(default_factory=list)

    def find(self) -> psutil.Process | None:
        try:
            for p in self.root.children(recursive=True):
                try:
                    if self.pattern in " ".join(p.cmdline()):
                        return p
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return None

    def run(self, deadline: float) -> None:
        victim = None
        while victim is None and time.monotonic() < deadline and self.root.is_running():
            victim = self.find()
            time.sleep(0.005)
        if victim is None:
            return
        time.sleep(self.delay)
        try:
            tree = [victim, *victim.children(recursive=True)]
        except psutil.Error:
            return  # finished before the kill point
        for p in tree:
            try:
                p.kill()
                self.killed.append(" ".join(p.cmdline()[:3]))
            except psutil.Error:
                pass


def fresh_copy(tiny_run: Path, wf: Path, stage: str) -> Path:
    """A new copy of the finished run at ``wf`` without the outputs of ``stage`` and of every stage
    downstream of it, so the same command re-runs them."""
    shutil.rmtree(wf, ignore_errors=True)
    shutil.copytree(tiny_run, wf, symlinks=True)
    for s in [stage, *DOWNSTREAM[stage]]:
        for out in OUTPUTS[s]:
            (wf / out).unlink()
    return wf


def cmdline(p: psutil.Process) -> str:
    """The process's command line, or "" once it has ended."""
    try:
        return " ".join(p.cmdline()) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE else ""
    except psutil.Error:
        return ""


def benchmark_seconds(wf: Path, stage: str) -> float:
    with open(wf / BENCHMARK[stage]) as fh:
        return float(next(csv.DictReader(fh, delimiter="\t"))["s"])


class Run:
    """`snakemake --cores 2 TARGET` in ``wf``, started in a thread; ``root`` is its process."""

    def __init__(self, wf: Path, target: str):
        self._done: dict = {}
        self._thread = threading.Thread(
            target=lambda: self._done.setdefault("proc", snakemake(wf, "--cores", "2", target)))
        self._thread.start()
        self.root: psutil.Process | None = None
        while self.root is None and self._thread.is_alive():  # snakemake() starts it; find it among ours
            self.root = next((p for p in psutil.Process().children() if "snakemake" in " ".join(p.cmdline())),
                             None)
            time.sleep(0.005)

    def wait(self) -> subprocess.CompletedProcess:
        self._thread.join()
        return self._done["proc"]


def run_with_kill(wf: Path, target: str, pattern: str, delay: float) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The same command as a plain run, with the process matching ``pattern`` (and what it
    started) killed ``delay`` s after it started."""
    run = Run(wf, target)
    watcher = Watcher(run.root, pattern, delay) if run.root else None
    if watcher:
        watcher.run(time.monotonic() + 600)
    return run.wait(), (watcher.killed if watcher else [])


def same(a: Path, b: Path) -> bool:
    """Equal content: Parquet tables but for their wall-clock columns, other files byte for byte."""
    if a.suffix != ".parquet":
        return a.read_bytes() == b.read_bytes()
    ta, tb = read_parquet(a), read_parquet(b)
    drop = [c for c in ta.column_names if c in WALL_COLUMNS]
    return ta.drop_columns(drop).equals(tb.drop_columns(drop))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.stage}-{c.victim}-{c.seed}")
def test_a_killed_job_resumes_to_the_same_outputs(tiny_run: Path, tmp_path: Path, case: Case) -> None:
    fraction = random.Random(case.seed).uniform(0.05, 0.6)
    for _attempt in range(4):  # a job may finish before its kill point: a fresh copy, an earlier point
        wf = fresh_copy(tiny_run, tmp_path / "wf", case.stage)
        pattern = "echo.trace.worker" if case.victim == "worker" else f".{case.stage}.py"
        first, killed = run_with_kill(wf, TARGET, pattern, fraction * benchmark_seconds(wf, case.stage))
        if killed:
            break
        fraction /= 4
    assert killed, f"{case}: the job finished before every kill point tried"
    assert first.returncode != 0, f"{case}: snakemake succeeded although {killed} were killed"
    for out in OUTPUTS[case.stage]:  # nothing partial is left where Snakemake would take it as done
        path = wf / out
        if path.is_file() and path.suffix == ".parquet":
            try:
                read_parquet(path)
            except ArtifactError as e:
                pytest.fail(f"{case}: the killed run left a partial output: {e}")

    second = snakemake(wf, "--cores", "2", TARGET)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    for stage in OUTPUTS:
        for out in OUTPUTS[stage]:
            assert same(wf / out, tiny_run / out), f"{case}: {out} differs from the uninterrupted run's"


def test_a_killed_measure_job_reruns_to_complete_outputs(tiny_run: Path, tmp_path: Path) -> None:
    """The measure stage trains for real (its timings differ run to run): killed part-way through,
    it leaves nothing partial, and the same command then writes all three of its tables whole."""
    wf = tmp_path / "wf"
    shutil.copytree(tiny_run, wf, symlinks=True)
    target = paths.MEASURE("measured.parquet", workload="tiny-dp2")
    outputs = [paths.MEASURE(f"{name}.parquet", workload="tiny-dp2") for name in ("measured", "phases", "events")]
    for delay in (3.0, 1.0, 0.3):  # seconds after the job's script starts
        first, killed = run_with_kill(wf, target, ".measure.py", delay)
        if killed:
            break
        for out in outputs:  # it finished first: undo, and kill earlier
            (wf / out).unlink(missing_ok=True)
    assert killed and first.returncode != 0
    for out in outputs:
        assert not (wf / out).exists() or read_parquet(wf / out).num_rows >= 0
    second = snakemake(wf, "--cores", "2", target)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert all(read_parquet(wf / out).num_rows > 0 for out in outputs)


def test_a_killed_snakemake_resumes_after_unlock(tiny_run: Path, tmp_path: Path) -> None:
    """Snakemake itself SIGKILLed with its jobs (a node lost under the whole run): its lock stays,
    so the same command is refused naming --unlock; after `snakemake --unlock` it runs again and
    ends with the uninterrupted run's outputs (the profile's rerun-incomplete re-runs a job whose
    outputs were half written when the run died)."""
    for fraction in (0.5, 0.1, 0.0):  # the trace may finish before the kill point: a fresh copy, an earlier point
        wf = fresh_copy(tiny_run, tmp_path / "wf", "trace")
        run = Run(wf, TARGET)
        root = run.root
        watcher = Watcher(root, ".trace.py", 0.0)
        deadline = time.monotonic() + 600
        while watcher.find() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(fraction * benchmark_seconds(wf, "trace"))
        tree = [root, *root.children(recursive=True)]  # the whole run at once, master first
        mid_job = any(".trace.py" in cmdline(p) for p in tree)
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        run.wait()
        if mid_job:
            break
    assert mid_job, "the trace job finished before every kill point tried"
    again = snakemake(wf, "--cores", "2", TARGET)
    assert again.returncode != 0 and "--unlock" in again.stdout + again.stderr
    assert snakemake(wf, "--unlock").returncode == 0
    final = snakemake(wf, "--cores", "2", TARGET)
    assert final.returncode == 0, final.stdout[-3000:] + final.stderr[-5000:]
    for stage in OUTPUTS:
        for out in OUTPUTS[stage]:
            assert same(wf / out, tiny_run / out), out
