"""The workflow shell (Snakefile, rules), the CLI and the audit.

Most tests dry-run Snakemake in a temporary copy of the workflow, so they need no stage to be
implemented. The caching tests run the whole DAG once with stub rule scripts that only write
their outputs (so Snakemake records params and code versions), then edit configs or code and
look at what a dry run would re-run. The end-to-end test runs the real stages on the three tiny
experiments (marked slow, run by default).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import (
    REPO,
    TINY,
    dry_run,
    edit_yaml,
    job,
    parse_jobs,
    snakemake,
    use_tiny_experiments,
)

from echo.artifacts import SUMMARY, TIMELINE, TRACED_RANKS
from echo.errors import ConfigError
from echo.io import write_parquet
from echo.report.audit import audit as audit_views
from echo.report.audit import summaries_table
from echo.workflow import params, paths
from echo.workflow.paths import VIEWS

EXPERIMENTS = [tuple(e[k] for k in ("workload", "hardware", "topology"))
               for e in yaml.safe_load((REPO / "config" / "config.yaml").read_text())["experiments"]]


# Hardware measured on this machine (kind: cpu) has its compute/communication overlap measured by
# the overlap rule; GPUs take published figures and need no job.
CPU_HARDWARE = {p.stem for p in (REPO / "config" / "hardware").glob("*.yaml")
                if yaml.safe_load(p.read_text()).get("kind") == "cpu"}
HAS_OVERLAP = (REPO / "workflow" / "rules" / "overlap.smk").is_file()


def jobs_for(experiments, rules=("trace", "dedup", "profile", "calibrate", "overlap", "simulate")) -> set:
    out = set()
    for w, h, t in experiments:
        out |= {job("trace", workload=w), job("dedup", workload=w), job("profile", workload=w, hardware=h),
                job("calibrate", topology=t), job("simulate", workload=w, hardware=h, topology=t)}
        if HAS_OVERLAP and h in CPU_HARDWARE:
            out.add(job("overlap", hardware=h))
    return {j for j in out if j[0] in rules}


def plots_for(experiments) -> set:
    """The report's per-experiment jobs: figures (Gantt, memory, Perfetto trace) and the run planned."""
    return {job(rule, workload=w, hardware=h, topology=t) for w, h, t in experiments
            for rule in ("plot_experiment", "plan_experiment")}


# what any change to a default experiment re-runs last: the overview figures, the report, rule all
REPORT = {job("plot_overview"), job("report"), job("all")}


# --- DAG shape --------------------------------------------------------------------------------


def test_rule_all_dry_run_lists_expected_jobs(workflow_copy: Path) -> None:
    expected = jobs_for(EXPERIMENTS) | plots_for(EXPERIMENTS) | REPORT
    assert dry_run(workflow_copy) == expected


def test_any_combination_can_be_requested_by_path(workflow_copy: Path) -> None:
    target = "results/simulate/tiny-tp2/h200-sxm-141gb/dgx-h100-ndr/summary.parquet"
    assert dry_run(workflow_copy, target) == jobs_for([("tiny-tp2", "h200-sxm-141gb", "dgx-h100-ndr")])


def test_single_stage_targets(workflow_copy: Path) -> None:
    assert dry_run(workflow_copy, "results/calibrate/dgx-h100-ndr/network.json") == {
        job("calibrate", topology="dgx-h100-ndr")}
    assert dry_run(workflow_copy, "results/profile/tiny-pp2/b200-sxm/kernels.parquet") == {
        job("trace", workload="tiny-pp2"), job("profile", workload="tiny-pp2", hardware="b200-sxm")}


def test_lint_is_clean() -> None:
    proc = snakemake(REPO, "--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


def test_rules_get_only_their_config_slice() -> None:
    """Topology reaches only calibrate/simulate, hardware only profile/simulate (docs/DESIGN.md, "The pipeline"),
    and both the report's plan of a simulated run (rule plan_experiment: power, servers, parameters)."""
    rules = {p.stem: p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk")}
    for rule, text in rules.items():
        if rule == "common":
            continue
        assert f'code=code_version("{rule}")' in text, rule
        assert ("topology_params" in text) == (rule in ("calibrate", "simulate", "report")), rule
        assert ("hardware=hardware_params" in text) == (rule in ("profile", "simulate", "report")), rule
        # trace and dedup get the workload without its simulation-only keys (overlap flags)
        assert ("workload=trace_workload_params" in text) == (rule in ("trace", "dedup")), rule
        assert ("workload=workload_params" in text) == (rule in ("simulate", "measure", "report")), rule
        for name, function in params.CONFIG_PARAMS.get(rule, {}).items():  # what `echo status` recomputes
            assert f"{name}={function.__name__}," in text, (rule, name)
        for directive in ("log:", "benchmark:", 'conda:\n        "../envs/echo.yaml"'):
            assert directive in text, (rule, directive)


def test_paths_fill_the_wildcards_given() -> None:
    assert paths.TRACE("ops.parquet") == "results/trace/{workload}/ops.parquet"
    assert paths.SIMULATE("summary.parquet", workload="w", results=Path("/r")) == (
        "/r/simulate/w/{hardware}/{topology}/summary.parquet")
    assert paths.fit("a100-sxm-80gb") == "results/fit/a100-sxm-80gb.json"
    assert paths.VIEWS["kernels"] == "profile/{workload}/{hardware}/kernels.parquet"


def test_overlap_is_measured_for_cpu_hardware_only() -> None:
    """The overlap rule's params refuse a GPU; the simulate rule reads the measurement for cpu hardware."""
    root = REPO / "config"
    cpu, gpu = SimpleNamespace(hardware="local-cpu"), SimpleNamespace(hardware="a100-sxm-80gb")
    with pytest.raises(ConfigError, match="kind: the overlap slowdown is measured on this machine only"):
        params.overlap_device(gpu, root)
    assert params.overlap_device(cpu, root) == {"name": "local-cpu", "kind": "cpu"}
    assert params.overlap_input(cpu, root) == ["results/overlap/local-cpu/slowdown.parquet"]
    assert params.overlap_input(gpu, root) == []


# --- bad input is refused while the DAG is built ------------------------------------------------


def failed(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_bad_workload_fails_dry_run_naming_file_and_key(workflow_copy: Path) -> None:
    edit_yaml(workflow_copy / "config" / "workloads" / "tiny-tp2.yaml", **{"parallel.tp": 3})
    out = failed(snakemake(workflow_copy, "-n"))
    assert "ConfigError: config/workloads/tiny-tp2.yaml: parallel.tp: heads 8 is not divisible by tp 3" in out


def test_bad_config_stops_before_any_job_runs(workflow_copy: Path) -> None:
    edit_yaml(workflow_copy / "config" / "topologies" / "local-gloo.yaml", **{"intra_node.bandwidth_GBps": "2 GB/s"})
    out = failed(snakemake(workflow_copy, "--cores", "1"))
    assert "config/topologies/local-gloo.yaml: intra_node.bandwidth_GBps:" in out
    assert not (workflow_copy / "results").exists() and not (workflow_copy / "logs").exists()


def test_unknown_name_in_a_requested_path(workflow_copy: Path) -> None:
    out = failed(snakemake(workflow_copy, "-n", "results/profile/tiny-dp2/a100-pcie/kernels.parquet"))
    assert "config/hardware/a100-pcie.yaml: hardware: unknown hardware 'a100-pcie'" in out


def test_placement_checked_for_simulate(workflow_copy: Path) -> None:
    six = workflow_copy / "config" / "topologies" / "six-gpu.yaml"
    shutil.copy(workflow_copy / "config" / "topologies" / "dgx-a100-hdr.yaml", six)
    edit_yaml(six, gpus_per_node=6)
    # calibrating the topology alone is fine; simulating 1,024 ranks on 6-GPU nodes is not
    assert dry_run(workflow_copy, "results/calibrate/six-gpu/network.json") == {job("calibrate", topology="six-gpu")}
    out = failed(snakemake(workflow_copy, "-n", "results/simulate/gpt3-175b/a100-sxm-80gb/six-gpu/trace.json"))
    assert "config/topologies/six-gpu.yaml: gpus_per_node: workload 'gpt3-175b': world size 1024 is above 6" in out


def test_bad_experiment_list_refused(workflow_copy: Path) -> None:
    (workflow_copy / "config" / "config.yaml").write_text("experiments:\n  - {workload: tiny-dp2, hardware: local-cpu}\n")
    out = failed(snakemake(workflow_copy, "-n"))
    assert "config/config.yaml: experiments.0: expected exactly the keys workload, hardware, topology" in out


# --- caching: what an edit re-runs --------------------------------------------------------------

@pytest.fixture
def completed(stub_run: Path, tmp_path: Path) -> Path:
    """A private copy of the stub-run workflow (outputs, logs and Snakemake's records kept)."""
    dest = tmp_path / "wf"
    shutil.copytree(stub_run, dest, symlinks=True)
    return dest


def test_completed_workflow_has_nothing_to_do(completed: Path) -> None:
    proc = snakemake(completed, "-n")
    assert proc.returncode == 0 and parse_jobs(proc.stdout + proc.stderr) == set(), proc.stdout + proc.stderr


def test_topology_edit_reruns_only_that_topology(completed: Path) -> None:
    edit_yaml(completed / "config" / "topologies" / "local-gloo.yaml", **{"intra_node.bandwidth_GBps": 3.0})
    tiny_gloo = [e for e in EXPERIMENTS if e[2] == "local-gloo"]
    expected = jobs_for(tiny_gloo, rules=("calibrate", "simulate")) | plots_for(tiny_gloo) | REPORT
    assert dry_run(completed) == expected
    # (not `--list-changes params`: in snakemake 9.27.1 it lists one output of every job, changed
    # or not, because an empty ParamsChange still iterates over its files)


def test_hardware_edit_reruns_only_profile_and_simulate(completed: Path) -> None:
    edit_yaml(completed / "config" / "hardware" / "local-cpu.yaml", memory_gib=32.0)
    on_cpu = [e for e in EXPERIMENTS if e[1] == "local-cpu"]
    assert dry_run(completed) == jobs_for(on_cpu, rules=("profile", "simulate")) | plots_for(on_cpu) | REPORT


def test_workload_edit_reruns_its_chain_only(completed: Path) -> None:
    edit_yaml(completed / "config" / "workloads" / "tiny-pp2.yaml", **{"training.micro_batch": 4})  # a traced key
    exp = [e for e in EXPERIMENTS if e[0] == "tiny-pp2"]
    assert dry_run(completed) == jobs_for(exp, rules=("trace", "dedup", "profile", "simulate")) | plots_for(
        exp) | REPORT


def test_overlap_flag_reruns_the_simulation_only(completed: Path) -> None:
    # a simulation-only key (Megatron's overlap options): the trace, dedup and profile stay
    edit_yaml(completed / "config" / "workloads" / "tiny-dp2.yaml", **{"parallel.overlap_grad_reduce": True})
    exp = [e for e in EXPERIMENTS if e[0] == "tiny-dp2"]
    assert dry_run(completed) == jobs_for(exp, rules=("simulate",)) | plots_for(exp) | REPORT


def test_comment_or_touch_of_a_config_reruns_nothing(completed: Path) -> None:
    path = completed / "config" / "topologies" / "local-gloo.yaml"
    path.write_text("# a comment changes no params\n" + path.read_text())
    assert dry_run(completed) == set()


def test_stage_code_change_reruns_that_stage(completed: Path) -> None:
    audit_py = completed / "echo" / "report" / "audit.py"
    audit_py.write_text(audit_py.read_text() + "\n# changed\n")
    assert dry_run(completed) == plots_for(EXPERIMENTS) | REPORT  # the report stage's rules only


def test_shared_module_change_reruns_its_users(completed: Path) -> None:
    from echo.workflow import versions

    users = {s for s in versions.STAGE_MODULES
             if completed / "echo" / "errors.py" in versions.stage_files(s, completed / "echo")}
    assert {"trace", "calibrate", "simulate"} <= users  # everything that loads configs
    errors_py = completed / "echo" / "errors.py"
    errors_py.write_text(errors_py.read_text() + "\n# changed\n")
    rerun = {rule for rule, _ in dry_run(completed)}
    assert {"trace", "calibrate", "simulate", "report", "all"} <= rerun


# --- code versions ------------------------------------------------------------------------------


def test_code_version_follows_imports(tmp_path: Path) -> None:
    from echo.workflow.versions import code_version, stage_files

    root = tmp_path / "echo"
    files = {
        "__init__.py": "",
        "io.py": "X = 1\n",
        "util.py": "Y = 1\n",
        "config/__init__.py": "",
        "trace/__init__.py": "from echo.trace.run import run\n",
        "trace/run.py": "from echo import io\n\ndef run():\n    from ..util import Y\n    return Y\n",
        "network/__init__.py": "from .model import M\n",
        "network/model.py": "M = 1\n",
        "simulate/__init__.py": "import echo.network.model\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    names = {s: {p.relative_to(root).as_posix() for p in stage_files(s, root)} for s in ("trace", "calibrate", "simulate")}
    assert {"io.py", "util.py", "trace/run.py", "config/__init__.py"} <= names["trace"]
    assert "io.py" not in names["calibrate"] and "network/model.py" in names["calibrate"]
    assert "network/model.py" in names["simulate"] and "network/__init__.py" in names["simulate"]

    def versions() -> dict[str, str]:
        from echo.workflow.versions import _code_version
        _code_version.cache_clear()
        return {s: code_version(s, root) for s in ("trace", "calibrate", "simulate", "dedup")}

    before = versions()
    assert all(len(v) == 12 for v in before.values())
    (root / "io.py").write_text("X = 2\n")
    after = versions()
    assert after["trace"] != before["trace"]
    assert {s: after[s] for s in ("calibrate", "simulate", "dedup")} == {
        s: before[s] for s in ("calibrate", "simulate", "dedup")}
    (root / "network" / "model.py").write_text("M = 2\n")
    again = versions()
    assert again["calibrate"] != after["calibrate"] and again["simulate"] != after["simulate"]
    assert again["trace"] == after["trace"]


# --- CLI ----------------------------------------------------------------------------------------


def echo_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "echo", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_cli_config_error_exits_2_without_traceback(config_root: Path) -> None:
    proc = echo_cli("trace", "--workload", "no-such-workload")
    assert proc.returncode == 2
    assert "workloads/no-such-workload.yaml: workload: unknown workload 'no-such-workload'" in proc.stderr
    assert "Traceback" not in proc.stderr
    edit_yaml(config_root / "workloads" / "tiny-tp2.yaml", **{"parallel.tp": 3})
    proc = echo_cli("simulate", "--workload", "tiny-tp2", "--hardware", "local-cpu", "--topology", "local-gloo",
                    "--config-dir", str(config_root))
    assert proc.returncode == 2 and "parallel.tp: heads 8 is not divisible by tp 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_missing_upstream_named(tmp_path: Path) -> None:
    proc = echo_cli("dedup", "--workload", "tiny-dp2", "--results", str(tmp_path))
    assert proc.returncode == 1 and "python -m echo trace --workload tiny-dp2" in proc.stderr


def test_cli_parses_byte_sizes() -> None:
    from echo.cli import parse_bytes

    assert [parse_bytes(s) for s in ("1048576", "1MiB", "64KB", "1e6", "2 GiB")] == [
        1 << 20, 1 << 20, 64_000, 1_000_000, 2 << 30]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("1.5")


def test_cli_collective_prints_one_json_object() -> None:
    import echo.network

    if not hasattr(echo.network, "collective_main"):
        pytest.skip("waits on echo.network.collective_main")
    proc = echo_cli("collective", "--topology", "dgx-a100-hdr", "--op", "all_reduce", "--gpus", "16",
                    "--bytes", "64MiB")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert isinstance(result, dict) and result


# --- audit --------------------------------------------------------------------------------------


def write_summary(results: Path, w: str, h: str, t: str, step: float) -> None:
    row = {f.name: [None] for f in SUMMARY}
    row.update(workload=[w], hardware=[h], topology=[t], world_size=[2], step_time_s=[step], compute_s=[step / 2])
    write_parquet(pa.table(row, schema=SUMMARY), results / "simulate" / w / h / t / "summary.parquet")


def audit(sql: str | None, results: Path) -> str:
    return audit_views(sql, results, VIEWS)


@pytest.fixture
def results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    for w, h, t, step in [("tiny-dp2", "local-cpu", "local-gloo", 0.5), ("gpt3-175b", "a100-sxm-80gb", "dgx-a100-hdr", 12.0)]:
        (results / "simulate" / w / h / t).mkdir(parents=True)
        write_summary(results, w, h, t, step)
    for w, h in [("tiny-dp2", "local-cpu"), ("tiny-tp2", "h100-sxm-80gb")]:
        (results / "profile" / w / h).mkdir(parents=True)
        write_parquet(pa.table({"kernel_key": ["k1", "k2"], "duration_us": [1.0, 2.0]}),
                       results / "profile" / w / h / "kernels.parquet")
    (results / "benchmarks" / "trace").mkdir(parents=True)
    (results / "benchmarks" / "trace" / "tiny-dp2.tsv").write_text(
        "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
        "1.5\t0:00:01\t100.0\t200.0\t90.0\t95.0\t0.0\t1.0\t50.0\t0.75\n")
    return results


def test_audit_lists_views_with_path_columns(results: Path) -> None:
    text = audit(None, results)
    assert "summary (2 files)" in text and "kernels (2 files)" in text and "benchmarks (1 file)" in text
    kernels_line = text.splitlines()[text.splitlines().index("  kernels (2 files)") + 1]
    assert "workload VARCHAR" in kernels_line and "hardware VARCHAR" in kernels_line
    assert "not yet written" in text and "ops" in text


def test_audit_sql_table(results: Path) -> None:
    text = audit("SELECT workload, hardware, sum(duration_us) AS total FROM kernels GROUP BY ALL ORDER BY 1", results)
    lines = [ln for ln in text.splitlines() if "tiny" in ln]
    assert "tiny-dp2" in lines[0] and "local-cpu" in lines[0] and "3" in lines[0]
    assert "tiny-tp2" in lines[1] and "h100-sxm-80gb" in lines[1]
    text = audit("SELECT topology, step_time_s FROM summary ORDER BY step_time_s", results)
    assert text.index("local-gloo") < text.index("dgx-a100-hdr")
    text = audit("SELECT rule, target, s FROM benchmarks", results)
    assert "trace" in text and "tiny-dp2" in text and "1.5" in text


def test_audit_every_view_name_matches_design() -> None:
    # the pipeline's artifacts (docs/DESIGN.md, "Paths") first, then validation and sweeps
    assert list(VIEWS) == ["ops", "comms", "deps", "traced_ranks", "rank_classes", "kernels",
                                       "collectives", "calibration_measurements", "summary", "timeline",
                                       "overlap_slowdown", "measured",
                                       "measured_phases", "compare", "published", "sweep_layouts", "sweep_ranking",
                                       "plan", "imported_activity", "imported_streams", "imported_model_error"]


def test_audit_empty_results(tmp_path: Path) -> None:
    assert "no results" in audit(None, tmp_path)
    assert "no simulation summaries" in summaries_table([], tmp_path)


def test_cli_audit_and_report(results: Path) -> None:
    proc = echo_cli("audit", "SELECT count(*) AS n FROM summary", "--results", str(results))
    assert proc.returncode == 0 and "2" in proc.stdout, proc.stderr
    proc = echo_cli("audit", "SELECT * FROM no_such_view", "--results", str(results))
    assert proc.returncode == 1 and "no_such_view" in proc.stderr and "Traceback" not in proc.stderr
    proc = echo_cli("report", "--results", str(results))
    assert proc.returncode == 0 and "gpt3-175b" in proc.stdout and "step_time_s" in proc.stdout


def write_timeline(path: Path, stages: int) -> None:
    rows = [{"class_id": 0, "pp_rank": s, "stream": stream, "name": f"{kind} {mb}", "kind": kind, "microbatch": mb,
             "chunk": 0, "start_s": 0.01 * (2 * mb + (kind == "backward") + s), "end_s": 0.01 * (2 * mb + (kind == "backward") + s + 1)}
            for s in range(stages) for mb in range(2) for kind, stream in (("forward", "compute"), ("backward", "compute"))]
    rows.append({**rows[-1], "kind": "optimizer", "name": "optimizer", "microbatch": -1, "start_s": 0.1, "end_s": 0.11})
    write_parquet(pa.Table.from_pylist(rows, schema=TIMELINE), path)


def write_traced_ranks(path: Path, stages: int) -> None:
    rows = [{"rank": s, "role": f"pp{s}", "pp_rank": s, "tp_rank": 0, "dp_rank": 0, "cp_rank": 0, "graph_hash": "h",
             "param_bytes": 2 << 20, "grad_bytes": 4 << 20, "optimizer_bytes": 8 << 20,
             "activation_bytes_per_microbatch": 1 << 20, "trace_wall_s": 1.0} for s in range(stages)]
    write_parquet(pa.Table.from_pylist(rows, schema=TRACED_RANKS), path)


def test_report_rule_writes_and_prints_summaries(workflow_copy: Path) -> None:
    """The report and its figure rules alone, over results written here (the stages are not run)."""
    use_tiny_experiments(workflow_copy)
    for step, (w, h, t) in enumerate(TINY, start=1):
        out = workflow_copy / "results" / "simulate" / w / h / t
        out.mkdir(parents=True)
        write_summary(workflow_copy / "results", w, h, t, step / 10)
        write_timeline(out / "timeline.parquet", stages=2 if w == "tiny-pp2" else 1)
        (out / "trace.json").write_text('{"traceEvents": []}')
        (workflow_copy / "results" / "trace" / w).mkdir(parents=True)
        write_traced_ranks(workflow_copy / "results" / "trace" / w / "ranks.parquet", stages=2 if w == "tiny-pp2" else 1)
    proc = snakemake(workflow_copy, "--cores", "1", "results/report/summaries.parquet",
                     "--allowed-rules", "report", "plot_experiment", "plot_overview", "plan_experiment")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = pq.read_table(workflow_copy / "results" / "report" / "summaries.parquet")
    assert table.column("workload").to_pylist() == sorted(w for w, _, _ in TINY)
    assert set(SUMMARY.names) <= set(table.column_names)
    # each experiment's run planned for config["plan"] (300B tokens by default) beside its step
    days = table.column("plan_time_to_train_days").to_pylist()
    assert all(d > 0 for d in days) and table.column("plan_tokens").to_pylist() == [3e11] * len(TINY)
    assert "step_time_s" in proc.stdout and "tiny-pp2" in proc.stdout  # printed on the terminal
    assert "tiny-pp2" in (workflow_copy / "logs" / "report" / "report.log").read_text()
    report = workflow_copy / "results" / "report"
    for w, h, t in TINY:
        for name in ("gantt.svg", "memory.svg", "trace.json"):
            assert (report / "experiments" / w / h / t / name).stat().st_size > 0, (w, name)
    assert "<svg" in (report / "step_breakdown.svg").read_text()
    assert "no measurements yet" in (report / "predicted_vs_measured.svg").read_text()


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_experiments_end_to_end(tiny_run: Path, tmp_path: Path) -> None:
    """The real stages on the three tiny experiments (rule all over them, run once per session by
    the tiny_run fixture), the contract columns, the audit, the report's figures, and what a
    topology edit would re-run afterwards."""
    workflow_copy = tmp_path / "wf"
    shutil.copytree(tiny_run, workflow_copy, symlinks=True)
    out_text = (workflow_copy / "run.out").read_text()
    results = workflow_copy / "results"
    for w, h, t in TINY:
        out = results / "simulate" / w / h / t
        summary = pq.read_table(out / "summary.parquet")
        assert summary.num_rows == 1
        assert set(SUMMARY.names) <= set(summary.column_names)
        row = summary.to_pylist()[0]
        assert (row["workload"], row["hardware"], row["topology"]) == (w, h, t)
        assert row["world_size"] == 2
        assert row["step_time_s"] > 0 and row["compute_s"] > 0 and row["tokens_per_s"] > 0
        assert row["step_time_s"] >= row["compute_s"] * 0.999
        assert 0 < row["mfu"] <= 1 and row["peak_mem_gib"] > 0
        timeline = pq.read_table(out / "timeline.parquet")
        assert set(TIMELINE.names) <= set(timeline.column_names) and timeline.num_rows > 0
        trace = json.loads((out / "trace.json").read_text())
        assert trace.get("traceEvents") if isinstance(trace, dict) else trace
        figures = results / "report" / "experiments" / w / h / t
        assert "<svg" in (figures / "gantt.svg").read_text() and "<svg" in (figures / "memory.svg").read_text()
        assert (figures / "trace.json").read_bytes() == (out / "trace.json").read_bytes()
    for stage in ("trace", "dedup", "profile", "calibrate", "simulate", "report"):
        assert list((workflow_copy / "logs" / stage).rglob("*.log")), stage
        assert list((results / "benchmarks" / stage).rglob("*.tsv")), stage
    report = pq.read_table(results / "report" / "summaries.parquet")
    assert sorted(report.column("workload").to_pylist()) == sorted(w for w, _, _ in TINY)
    assert "step_time_s" in out_text  # the report rule printed its table
    assert "Step-time breakdown" in (results / "report" / "step_breakdown.svg").read_text()

    text = audit("SELECT workload, count(*) AS n FROM summary GROUP BY ALL ORDER BY 1", results)
    assert all(w in text for w, _, _ in TINY)
    assert dry_run(workflow_copy) == set()

    edit_yaml(workflow_copy / "config" / "topologies" / "local-gloo.yaml", **{"intra_node.latency_us": 60.0})
    assert dry_run(workflow_copy) == jobs_for(TINY, rules=("calibrate", "simulate")) | plots_for(TINY) | REPORT
