"""Shared fixtures: temporary copies of the workflow (so tests never touch the repo's results/),
a way to run snakemake in them, a parser for dry-run job lists, and the reference folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

from echo.reference import reference_root

REPO = Path(__file__).resolve().parents[1]
# What a workflow copy needs: the Snakefile and rules, the configs, the default profile, and the
# echo package (the Snakefile puts the copy's own echo first on sys.path, so code versions and
# config loading see the copy, which tests may edit).
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "profiles", "echo")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results", "logs")


def copy_workflow(dest: Path, source: Path = REPO) -> Path:
    """The workflow's parts from ``source`` (default: this repository) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = source / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=_IGNORE)
        else:
            shutil.copy2(src, dest / part)
    return dest


@pytest.fixture
def workflow_copy(tmp_path: Path) -> Path:
    """A fresh copy of the workflow (no results) in a temporary folder."""
    return copy_workflow(tmp_path / "wf")


@pytest.fixture
def config_root(tmp_path: Path) -> Path:
    """A copy of the shipped config/ folder, to break on purpose (the loaders take root=)."""
    root = tmp_path / "config"
    shutil.copytree(REPO / "config", root)
    return root


@pytest.fixture(scope="session")
def reference() -> Path:
    """The reference folder of published measurements (echo.reference.reference_root); a test
    that needs it skips, saying why, where it is absent (CI always has it)."""
    root = reference_root()
    if not root.is_dir():
        pytest.skip(f"needs the reference folder ({root} is absent): set ECHO_REFERENCE or put "
                    "shared/reference beside the checkout")
    return root


def edit_yaml(path: Path, **changes: object) -> None:
    """Set (or, with value None, delete) dotted keys of a YAML file: edit_yaml(p, **{"parallel.tp": 3})."""
    data = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def snakemake(cwd: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run this venv's snakemake in ``cwd`` (it picks up the copy's profiles/default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # A copy's echo looks for shared/reference beside the copy (echo.reference.DEFAULT), which a
    # temporary folder lacks; point it at this checkout's reference folder unless a test chose one.
    env.setdefault("ECHO_REFERENCE", str(reference_root()))
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


_JOB = re.compile(r"^(?:local)?rule (\S+):$")
_WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")


def parse_jobs(output: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The jobs a dry run lists, as {(rule, ((wildcard, value), ...))}."""
    jobs: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    rule: str | None = None
    wildcards: tuple[tuple[str, str], ...] = ()
    for line in output.splitlines() + [""]:
        if m := _JOB.match(line):
            rule, wildcards = m.group(1), ()
        elif rule and (m := _WILDCARDS.match(line)):
            wildcards = tuple(sorted(tuple(kv.split("=", 1)) for kv in m.group(1).split(", ")))
        elif rule and not line.strip():
            jobs.add((rule, wildcards))
            rule = None
    return jobs


def dry_run(cwd: Path, *targets: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Jobs that ``snakemake -n`` would run for the targets (default: rule all)."""
    proc = snakemake(cwd, "-n", *targets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return parse_jobs(proc.stdout + "\n" + proc.stderr)


def job(rule: str, **wildcards: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return rule, tuple(sorted(wildcards.items()))


# --- the tiny experiments, run once per session (the end-to-end and SLURM tests compare to it) ---

TINY = [("tiny-dp2", "local-cpu", "local-gloo"), ("tiny-tp2", "local-cpu", "local-gloo"),
        ("tiny-pp2", "local-cpu", "local-gloo")]
# A GPU target whose results are deterministic (modelled kernels and network), to compare exactly.
GPU_TARGET = ("tiny-tp2", "a100-sxm-80gb", "dgx-a100-hdr")
TINY_TARGETS = ("all", "results/simulate/{}/{}/{}/summary.parquet".format(*GPU_TARGET))


def use_tiny_experiments(wf: Path, tiny: list[tuple[str, str, str]] = TINY) -> None:
    """Make the tiny experiments (or some of them) the copy's default experiments (rule all)."""
    experiments = "".join(f"  - {{workload: {w}, hardware: {h}, topology: {t}}}\n" for w, h, t in tiny)
    (wf / "config" / "config.yaml").write_text("experiments:\n" + experiments)


def workflow_logs(wf: Path, tail: int = 3000) -> str:
    return "\n".join(f"== {p}\n{p.read_text()[-tail:]}" for p in sorted((wf / "logs").rglob("*.log")))


def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Path:
    """``build(wf)`` run once per test session, across pytest-xdist's workers too (``make test``
    runs on every core): the first worker to ask builds the workflow copy ``wf`` under a file
    lock in the folder all workers share, the others wait and take it. A build that failed leaves
    no done-marker, so the next asker starts over (and fails alike, with its own message)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's base temp sits in the session's common one
    wf, done = root / f"shared-{name}" / "wf", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(wf.parent, ignore_errors=True)
            build(copy_workflow(wf))
            done.touch()
    return wf


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workflow copy in which the tiny experiments (rule all, with the report's figures) and
    GPU_TARGET have run locally with the real stages; the terminal output is in run.out. Tests
    copy it before changing anything."""

    def build(wf: Path) -> None:
        use_tiny_experiments(wf)
        proc = snakemake(wf, "--cores", "2", *TINY_TARGETS)
        (wf / "run.out").write_text(proc.stdout + proc.stderr)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:] + workflow_logs(wf)

    return shared_once(tmp_path_factory, "tiny", build)


# --- the default DAG run with stub stages (for what-re-runs tests) --------------------------------

STUB = '''\
from pathlib import Path

for f in map(Path, snakemake.output):  # noqa: F821
    if f.suffix == ".parquet":  # a real (checked) artifact, so `echo status` finds nothing damaged
        import pyarrow as pa

        from echo.io import write_parquet

        write_parquet(pa.table({"stub": [1]}), f)
    elif f.suffix:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("stub")
    else:  # a directory() output
        f.mkdir(parents=True, exist_ok=True)
Path(snakemake.log[0]).write_text("stub")  # noqa: F821
'''


def stub_scripts(wf: Path) -> None:
    """Replace the copy's rule scripts by ones that only write their outputs (so Snakemake
    records params and code versions without running the stages)."""
    for script in (wf / "workflow" / "scripts").glob("*.py"):
        if not script.name.startswith("_"):
            script.write_text(STUB)


@pytest.fixture(scope="session")
def stub_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workflow copy whose whole default DAG has run once with stub scripts."""

    def build(wf: Path) -> None:
        stub_scripts(wf)
        proc = snakemake(wf, "--cores", "2")
        assert proc.returncode == 0, proc.stdout + proc.stderr

    return shared_once(tmp_path_factory, "stub", build)


FIXED_EAGER = {"eager_op_us": 10.0, "colocated": {"1": 1.0, "2": 1.05}, "kernels_per_microbatch": 80,
               "method": "fixed by tests/conftest.py", "cached": True}


@pytest.fixture
def fixed_eager_step(monkeypatch):
    """The eager engine's per-op time and the side-by-side slowdown (echo.profile.eager) fixed at
    FIXED_EAGER, for tests of other parts of the profile (measuring them takes ~25 s and moves a
    few percent between runs)."""
    from echo.profile import eager

    monkeypatch.setattr(eager, "step_overheads", lambda cache_dir: dict(FIXED_EAGER))
    return FIXED_EAGER


# Fixtures that run real work (a gloo benchmark, tracing the Table 4 layers, a real training run,
# the tiny experiments' report) or Snakemake in a copy of the workflow: every test that uses one is slow, so `make
# test-fast` (the unit tests) leaves it out; `make test` runs everything.
HEAVY_FIXTURES = {"gloo_bench", "layer_traces", "report_html", "real_run", "workflow_copy", "tiny_run", "stub_run"}
# Fixtures that time this machine (a gloo benchmark, a real training step under the profiler) for
# tests that bound what they measured: such a test needs the machine to itself, so `make test`
# runs the tests marked timing alone, after the rest has run on every core.
TIMING_FIXTURES = {"gloo_bench", "real_run"}


def pytest_configure(config):
    # pytest-xdist's workers share the cores: torch's intra-op pool in each worker takes its share
    # (the timing tests run alone, in one process, and time with the threads they set themselves)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# Test files that take minutes, the longest first (the last serial CI's --durations): pytest-xdist,
# with --no-loadscope-reorder (make test), hands whole files to its workers in collection order, so
# these start first and the short files fill in around them, instead of one long file starting last
# and running alone at the end.
# test_slurm builds tiny_run on its worker while the other runs test_validate and the NVL72 refit,
# so that test_faults, which needs tiny_run too, rarely waits for it.
LONG_FILES = ("test_slurm.py", "test_validate.py", "test_network_nvl72.py", "test_faults.py", "test_search.py",
              "test_profile_workflow.py", "test_sweep.py", "test_workflow.py", "test_report.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order kept
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if HEAVY_FIXTURES & fixtures:
            item.add_marker(pytest.mark.slow)
        if TIMING_FIXTURES & fixtures:
            item.add_marker(pytest.mark.timing)
