"""The profile rule in a copy of the workflow: the shared CPU kernel cache, the note, and an
imported Kineto trace dropped in by convention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import dry_run, job, snakemake


def profile_target(w: str, h: str) -> str:
    return f"results/profile/{w}/{h}/kernels.parquet"


@pytest.mark.slow
def test_cpu_profiles_share_the_kernel_cache_and_write_a_note(workflow_copy: Path) -> None:
    for w in ("tiny-dp2", "tiny-pp2"):
        proc = snakemake(workflow_copy, "--cores", "2", profile_target(w, "local-cpu"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    cache = workflow_copy / "results" / "profile" / "_cache" / "cpu_kernels.parquet"
    assert cache.is_file()
    first = json.loads((workflow_copy / "results/profile/tiny-dp2/local-cpu/profile.json").read_text())
    second = json.loads((workflow_copy / "results/profile/tiny-pp2/local-cpu/profile.json").read_text())
    assert first["measure"]["cached"] == 0 and first["measure"]["timed"] > 0
    # tiny-pp2's layers are tiny-dp2's: most of its kernels come from the cache
    assert second["measure"]["cached"] > second["measure"]["timed"]
    assert second["measure"]["cache"].endswith("results/profile/_cache")


@pytest.mark.slow
def test_a_dropped_in_kineto_trace_is_an_input_of_the_profile_job(workflow_copy: Path) -> None:
    target = profile_target("tiny-dp2", "h100-sxm-80gb")
    assert snakemake(workflow_copy, "--cores", "2", target).returncode == 0
    assert dry_run(workflow_copy, target) == set()
    # a real run's trace of this workload on this hardware appears: the profile job re-runs
    trace = workflow_copy / "imports" / "kineto" / "tiny-dp2" / "h100-sxm-80gb.json"
    trace.parent.mkdir(parents=True)
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 3.5,
         "args": {"Input Dims": [[256, 256], [256, 4096]], "Input type": ["float", "float"]}}]}))
    assert job("profile", workload="tiny-dp2", hardware="h100-sxm-80gb") in dry_run(workflow_copy, target)
    proc = snakemake(workflow_copy, "--cores", "2", target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    note = json.loads((workflow_copy / "results/profile/tiny-dp2/h100-sxm-80gb/profile.json").read_text())
    assert note["imported"]["file"].endswith("imports/kineto/tiny-dp2/h100-sxm-80gb.json")
    assert note["sources"].get("imported", 0) == note["imported"]["matched_kernels"] >= 1
    assert note["imported"]["unmatched_kernels"] == note["kernels"] - note["imported"]["matched_kernels"]
