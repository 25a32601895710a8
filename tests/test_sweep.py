"""Design-space sweeps: config/sweeps/{sweep}.yaml expanded into layouts (kept or dropped with a
reason), resolved by the workflow as workloads, sharing traces, ranked by step time."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, copy_workflow, dry_run, edit_yaml, job, snakemake, stub_scripts, workflow_logs

from echo.errors import ConfigError
from echo.sweep import AXES, RANKING, best, expansion, layout_tokens, load_sweep, shared_trace, sweep_workload
from echo.sweep.spec import expand

TINY_SWEEP = {
    "description": "a tiny GPT on 8 H100s: tp x schedule",
    "base": "tiny-pp2",                      # 4 layers, 8 heads, global batch 8, fp32
    "parallel": {"zero": 1},
    "training": {"micro_batch": 1},
    "gpus": 8,
    "hardware": "h100-sxm-80gb",
    "topologies": ["dgx-h100-ndr"],
    "axes": {"tp": [1, 2], "pp": [2], "schedule": ["1f1b", "gpipe"]},
}


def write_sweep(root: Path, name: str, spec: dict) -> Path:
    path = root / "sweeps" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def expand_spec(config_root: Path, spec: dict, name: str = "s", traceable=lambda w: None):
    """Expand ``spec`` (tracing everything unless ``traceable`` refuses)."""
    write_sweep(config_root, name, spec)
    sweep, path = load_sweep(name, root=config_root)
    return expand(sweep, path, config_root, traceable=traceable)


# --- expansion ----------------------------------------------------------------------------------


def test_layouts_names_and_derived_dp(config_root: Path) -> None:
    exp = expand_spec(config_root, {**TINY_SWEEP, "axes": {"tp": [1, 2, 3], "pp": [2], "micro_batch": [1, 2]}})
    names = {c.name: c for c in exp.candidates}
    assert len(exp.candidates) == 6
    ok = names["s--tp2-pp2-dp2-mb2"]
    assert ok.kept and ok.workload.parallel.dp == 2 and ok.workload.training.micro_batch == 2
    assert ok.workload.name == "s--tp2-pp2-dp2-mb2" and ok.workload.model.layers == 4  # from base tiny-pp2
    # the name leaves out what equals Echo's defaults (mb1 here), and keeps what does not
    assert "s--tp1-pp2-dp4" in names and names["s--tp1-pp2-dp4"].values["micro_batch"] == 1
    assert layout_tokens({**{a: None for a in AXES}, "tp": 8, "pp": 4, "dp": 2, "cp": 1, "ep": 1, "zero": 1,
                          "schedule": "interleaved", "virtual_stages": 2, "micro_batch": 1, "recompute": "full",
                          "sequence_parallel": True}) == "tp8-pp4-dp2-interleaved-v2-rfull-sp1"
    # gpus 8 is not divisible by tp3 x pp2
    bad = [c for c in exp.dropped if c.values["tp"] == 3]
    assert len(bad) == 2 and all(c.key == "parallel.dp" and "not divisible by tp x pp x cp = 6" in c.reason
                                 for c in bad)


def test_invalid_combinations_dropped_with_reason(config_root: Path) -> None:
    spec = {**TINY_SWEEP, "axes": {"tp": [2, 16], "pp": [2, 4], "schedule": ["1f1b", "interleaved"],
                                   "virtual_stages": [1, 2]}}
    exp = expand_spec(config_root, spec)
    reasons = {c.name.split("--")[1]: (c.key, c.reason) for c in exp.dropped}
    assert reasons["tp16-pp2"] == ("parallel.dp", "gpus 8 is not divisible by tp x pp x cp = 32")
    assert reasons["tp2-pp2-dp2-v2"] == ("parallel.virtual_stages", "virtual_stages 2 > 1 needs schedule: interleaved (or zb-v, dualpipev, dualpipe)")
    assert reasons["tp2-pp2-dp2-interleaved"][0] == "parallel.schedule"
    assert "same as s--tp2-pp2-dp2" in reasons["tp2-pp2-dp2-interleaved"][1]
    # tiny-pp2 has 4 layers: pp4 x v2 = 8 chunks do not divide them
    assert reasons["tp2-pp4-dp1-interleaved-v2"] == ("model.layers",
                                                     "layers 4 are not divisible by pp x virtual_stages = 8")
    assert {c.name for c in exp.kept} == {"s--tp2-pp2-dp2", "s--tp2-pp2-dp2-interleaved-v2", "s--tp2-pp4-dp1"}


def test_tracer_refusals_drop_layouts(config_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the tracer's own check decides what can be traced (echo.trace.check_traceable)."""
    import echo.trace

    def refuse_tp2(w):
        if w.parallel.tp == 2:
            raise ConfigError(f"config/workloads/{w.name}.yaml", "parallel.tp", "tp 2 is not traced yet")

    monkeypatch.setattr(echo.trace, "check_traceable", refuse_tp2)
    write_sweep(config_root, "t", TINY_SWEEP)
    sweep, path = load_sweep("t", root=config_root)
    exp = expand(sweep, path, config_root)
    assert {c.name for c in exp.kept} == {"t--tp1-pp2-dp4", "t--tp1-pp2-dp4-gpipe"}
    assert all(c.key == "parallel.tp" and c.reason == "tp 2 is not traced yet" for c in exp.dropped)


def test_layouts_that_trace_alike_share_one_trace(config_root: Path) -> None:
    exp = expand_spec(config_root, TINY_SWEEP)
    assert len(exp.kept) == 4 and len(exp.traces) == 2
    trace = {c.name: c.trace for c in exp.kept}
    assert trace["s--tp2-pp2-dp2"] == trace["s--tp2-pp2-dp2-gpipe"] == "s--trace-tp2-pp2-dp2"
    assert trace["s--tp1-pp2-dp4"] != trace["s--tp2-pp2-dp2"]
    shared = exp.traces["s--trace-tp2-pp2-dp2"]
    one, other = (next(c.workload for c in exp.kept if c.name == n) for n in ("s--tp2-pp2-dp2", "s--tp2-pp2-dp2-gpipe"))
    # the shared trace's workload is each layout's, up to what the tracer does not read
    for w in (one, other):
        a, b = shared.model_dump(), w.model_dump()
        for d in (a, b):
            d.pop("name"), d.pop("description"), d["parallel"].pop("schedule")
        assert a == b


def test_bad_sweep_files_name_file_and_key(config_root: Path) -> None:
    cases = [
        ({**TINY_SWEEP, "axes": {"tq": [1]}}, "axes.tq", "unknown axis"),
        ({**TINY_SWEEP, "axes": {"tp": []}}, "axes.tp", "non-empty list"),
        ({**TINY_SWEEP, "hardware": "a100-pcie"}, "hardware", "unknown hardware 'a100-pcie'"),
        ({**TINY_SWEEP, "topologies": ["dgx-h100-ndr", "nope"]}, "topologies.1", "unknown topology 'nope'"),
        ({**TINY_SWEEP, "gpu": 8}, "gpu", "Extra inputs"),
        ({**TINY_SWEEP, "base": "nope"}, "base", "unknown workload 'nope'"),
    ]
    for i, (spec, key, reason) in enumerate(cases):
        write_sweep(config_root, f"bad{i}", spec)
        with pytest.raises(ConfigError) as err:
            expansion(f"bad{i}", root=config_root)
        assert err.value.file.endswith(f"sweeps/bad{i}.yaml") and err.value.key == key and reason in err.value.reason


def test_sweep_workload_lookup(config_root: Path) -> None:
    write_sweep(config_root, "look", TINY_SWEEP)
    assert sweep_workload("look--tp2-pp2-dp2-gpipe", root=config_root).parallel.schedule == "gpipe"
    assert shared_trace("look--tp2-pp2-dp2-gpipe", root=config_root) == "look--trace-tp2-pp2-dp2"
    assert sweep_workload("look--trace-tp2-pp2-dp2", root=config_root).parallel.schedule == "1f1b"
    with pytest.raises(ConfigError, match="not a layout of sweep 'look'"):
        sweep_workload("look--tp4-pp2-dp1", root=config_root)
    with pytest.raises(ConfigError, match="unknown sweep 'nope'"):
        sweep_workload("nope--tp1-pp1-dp1", root=config_root)


def test_shipped_sweeps() -> None:
    gpt = expansion("gpt3-175b-a100-1024")
    assert gpt.sweep.gpus == 1024 and gpt.sweep.hardware == "a100-sxm-80gb"
    assert 6 <= len(gpt.kept) <= 12 and len(gpt.traces) < len(gpt.kept)
    assert all(c.workload.world_size == 1024 for c in gpt.kept)
    llama = expansion("llama3-70b-h100-512")
    assert llama.sweep.gpus == 512 and llama.sweep.hardware == "h100-sxm-80gb"
    assert len(llama.candidates) >= 6
    for c in llama.candidates:  # each layout is simulated, or dropped saying why (e.g. not traceable yet)
        assert c.kept or (c.key and c.reason)
    assert all(c.workload.model.arch == "llama" and c.workload.world_size == 512 for c in llama.kept)


# --- the workflow ----------------------------------------------------------------------------------


def test_sweep_dry_run_traces_each_distinct_graph_once(workflow_copy: Path) -> None:
    jobs = dry_run(workflow_copy, "results/sweep/gpt3-175b-a100-1024/ranking.parquet")
    exp = expansion("gpt3-175b-a100-1024")
    by_rule: dict[str, set] = {}
    for rule, wildcards in jobs:
        by_rule.setdefault(rule, set()).add(dict(wildcards).get("workload"))
    assert by_rule["trace"] == set(exp.traces)                       # 8 shared traces
    assert by_rule["sweep_trace"] == by_rule["dedup"] == by_rule["simulate"] == {c.name for c in exp.kept}
    assert len(by_rule["trace"]) < len(by_rule["simulate"])
    assert {job("calibrate", topology="dgx-a100-hdr"), job("sweep_layouts", sweep="gpt3-175b-a100-1024"),
            job("sweep_rank", sweep="gpt3-175b-a100-1024")} <= jobs


def test_a_layout_is_requested_by_path(workflow_copy: Path) -> None:
    target = "results/simulate/gpt3-175b-a100-1024--tp8-pp8-dp16-gpipe/a100-sxm-80gb/dgx-a100-hdr/summary.parquet"
    w = "gpt3-175b-a100-1024--tp8-pp8-dp16-gpipe"
    assert dry_run(workflow_copy, target) == {
        job("trace", workload="gpt3-175b-a100-1024--trace-tp8-pp8-dp16"), job("sweep_trace", workload=w),
        job("dedup", workload=w), job("profile", workload=w, hardware="a100-sxm-80gb"),
        job("calibrate", topology="dgx-a100-hdr"), job("simulate", workload=w, hardware="a100-sxm-80gb",
                                                       topology="dgx-a100-hdr")}


def test_dropped_layout_or_bad_sweep_refused_before_running(workflow_copy: Path) -> None:
    proc = snakemake(workflow_copy, "-n", "results/simulate/gpt3-175b-a100-1024--tp8-pp8-dp16-v2/"
                                          "a100-sxm-80gb/dgx-a100-hdr/summary.parquet")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("config/sweeps/gpt3-175b-a100-1024.yaml: parallel.virtual_stages: layout "
            "'gpt3-175b-a100-1024--tp8-pp8-dp16-v2' is dropped: virtual_stages 2 > 1 needs schedule: interleaved") in out
    edit_yaml(workflow_copy / "config" / "sweeps" / "gpt3-175b-a100-1024.yaml", **{"axes.tq": [1]})
    proc = snakemake(workflow_copy, "-n", "results/sweep/gpt3-175b-a100-1024/ranking.parquet")
    assert proc.returncode != 0 and "gpt3-175b-a100-1024.yaml: axes.tq: unknown axis" in proc.stdout + proc.stderr


def test_report_shows_configured_sweeps(workflow_copy: Path) -> None:
    jobs = dry_run(workflow_copy, "--config", "sweeps=[gpt3-175b-a100-1024]")
    assert job("plot_sweep", sweep="gpt3-175b-a100-1024") in jobs and job("sweep_rank", sweep="gpt3-175b-a100-1024") in jobs
    assert not any(rule.startswith("sweep") or rule == "plot_sweep" for rule, _ in dry_run(workflow_copy))


@pytest.mark.slow
def test_sweep_edit_reruns_only_new_layouts(tmp_path: Path) -> None:
    """A completed sweep (stub stages), then one more tp value: only the new layouts' jobs run,
    and the sweep's own bookkeeping."""
    wf = copy_workflow(tmp_path / "wf")
    stub_scripts(wf)
    write_sweep(wf / "config", "tiny", TINY_SWEEP)
    target = "results/sweep/tiny/ranking.parquet"
    proc = snakemake(wf, "--cores", "2", target)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert dry_run(wf, target) == set()
    edit_yaml(wf / "config" / "sweeps" / "tiny.yaml", **{"axes.tp": [1, 2, 4]})
    new = "tiny--tp4-pp2-dp1"
    assert {(r, dict(w).get("workload")) for r, w in dry_run(wf, target)} == {
        ("trace", "tiny--trace-tp4-pp2-dp1"), ("sweep_trace", new), ("sweep_trace", new + "-gpipe"),
        ("dedup", new), ("dedup", new + "-gpipe"), ("profile", new), ("profile", new + "-gpipe"),
        ("simulate", new), ("simulate", new + "-gpipe"), ("sweep_layouts", None), ("sweep_rank", None)}


@pytest.mark.slow
def test_tiny_sweep_end_to_end(workflow_copy: Path) -> None:
    """The real stages over a 4-layout sweep of a tiny GPT on 8 H100s: two traces, four
    simulations, the ranking and the heatmap."""
    write_sweep(workflow_copy / "config", "tiny", TINY_SWEEP)
    targets = ("results/sweep/tiny/ranking.parquet", "results/report/sweeps/tiny/heatmap.svg")
    proc = snakemake(workflow_copy, "--cores", "2", *targets)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:] + workflow_logs(workflow_copy)
    out = proc.stdout + proc.stderr
    assert "layouts by step time" in out  # the ranking, printed on the terminal
    results = workflow_copy / "results"
    ranking = pq.read_table(results / "sweep" / "tiny" / "ranking.parquet")
    assert ranking.schema.names[:len(RANKING.names)] == RANKING.names
    assert ranking.num_rows == 4
    rows = ranking.to_pylist()
    assert [r["rank"] for r in rows if r["fits"]] == list(range(1, sum(r["fits"] for r in rows) + 1))
    fitting = [r["step_time_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting) and len(best(ranking)) == min(3, len(fitting))
    assert {r["layout"] for r in rows} == {"tiny--tp1-pp2-dp4", "tiny--tp1-pp2-dp4-gpipe", "tiny--tp2-pp2-dp2",
                                           "tiny--tp2-pp2-dp2-gpipe"}
    # two traces, linked under four names
    traced = sorted(p.name for p in (results / "trace").iterdir())
    assert traced == sorted(["tiny--trace-tp1-pp2-dp4", "tiny--trace-tp2-pp2-dp2", *(r["layout"] for r in rows)])
    assert len(list((results / "benchmarks" / "trace").glob("*.tsv"))) == 2
    assert os.path.samefile(results / "trace" / "tiny--tp2-pp2-dp2" / "ops.parquet",
                            results / "trace" / "tiny--tp2-pp2-dp2-gpipe" / "ops.parquet")
    layouts = pq.read_table(results / "sweep" / "tiny" / "layouts.parquet")
    assert layouts.num_rows == 4 and all(layouts.column("kept").to_pylist())
    generated = sorted(p.stem for p in (results / "sweep" / "tiny" / "workloads").glob("*.yaml"))
    assert generated == sorted(r["layout"] for r in rows)
    svg = (results / "report" / "sweeps" / "tiny" / "heatmap.svg").read_text()
    assert "<svg" in svg and "Sweep tiny: 4 layouts simulated" in svg
    # the schedule of a layout reaches the simulator: gpipe holds more micro-batches in flight
    by = {r["layout"]: r for r in rows}
    assert by["tiny--tp2-pp2-dp2-gpipe"]["peak_mem_gib"] >= by["tiny--tp2-pp2-dp2"]["peak_mem_gib"]
    assert dry_run(workflow_copy, *targets) == set()


def test_repository_has_no_stray_sweep_files() -> None:
    assert sorted(p.stem for p in (REPO / "config" / "sweeps").glob("*.yaml")) == [
        "gpt3-175b-a100-1024", "gpt3-175b-a100-1024-search", "gpt3-175b-a100-scaling", "llama3-70b-h100-512",
        "llama3-70b-h100-512-search"]


def test_cli_sweep_lists_layouts_and_reasons(tmp_path: Path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "echo", "sweep", *args, "--results", str(tmp_path)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)

    proc = cli("gpt3-175b-a100-1024")
    assert proc.returncode == 0, proc.stderr
    assert "24 combinations: 12 layouts kept (traced as 8 shared traces), 12 dropped" in proc.stdout
    assert "virtual_stages 2 > 1 needs schedule: interleaved" in proc.stdout and "not simulated yet" in proc.stdout
    proc = cli("no-such-sweep")
    assert proc.returncode == 2 and "sweeps/no-such-sweep.yaml: sweep: unknown sweep" in proc.stderr
