"""Shared fixtures: temporary copies of the workflow (so tests never touch the repo's results/),
a way to run snakemake in them, and a parser for dry-run job lists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# What a workflow copy needs: the Snakefile and rules, the configs, the default profile, and the
# echo package (the Snakefile puts the copy's own echo first on sys.path, so code versions and
# config loading see the copy, which tests may edit).
WORKFLOW_PARTS = ("Snakefile", "workflow", "config", "profiles", "echo")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".snakemake", "results", "logs")


def copy_workflow(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for part in WORKFLOW_PARTS:
        src = REPO / part
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
