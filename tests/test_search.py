"""Design-space search (echo.sweep.search): every layout of a spec ranked from composed graphs,
the same step times as the fully traced pipeline, fronts that no layout beats, refusals before
any tracing, and a failed composition check that names the layout."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_sweep import write_sweep

from echo.config import load_hardware, load_topology
from echo.sweep import search as S

TINY = {
    "description": "a tiny GPT on 4 or 8 H100s",
    "model": {"arch": "gpt", "layers": 4, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 128},
    "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "none"},
    "parallel": {"zero": 1},
    "gpus": [4, 8],
    "hardware": "h100-sxm-80gb",
    "topologies": ["dgx-h100-ndr"],
    "verify": 2,
    "axes": {"tp": [1, 2], "pp": [1, 2], "schedule": ["1f1b", "interleaved"], "virtual_stages": [1, 2],
             "micro_batch": [1, 2], "recompute": ["none", "full"]},
}


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    import shutil

    from conftest import REPO

    root = tmp_path_factory.mktemp("search")
    shutil.copytree(REPO / "config", root / "config")
    write_sweep(root / "config", "tiny", TINY)
    out = root / "out"
    result = S.run_search("tiny", out, processes=2, root=root / "config")
    return root, out, result


@pytest.mark.slow  # a whole search (about a minute)
def test_every_kept_layout_is_ranked_and_the_check_ran(searched):
    root, out, result = searched
    layouts = pq.read_table(out / "layouts.parquet").to_pylist()
    kept = [r for r in layouts if r["kept"]]
    ranking = pq.read_table(out / "ranking.parquet").to_pylist()
    assert result["kept"] == len(kept) > 20 and len(ranking) == len(kept)
    assert {r["gpus"] for r in ranking} == {4, 8}
    fits = [r for r in ranking if r["fits"]]
    assert [r["rank"] for r in fits] == list(range(1, len(fits) + 1))
    assert [r["step_time_s"] for r in fits] == sorted(r["step_time_s"] for r in fits)
    assert all(r["overflow"] is None for r in fits)
    dropped = [r for r in layouts if not r["kept"]]
    assert dropped and all(r["key"] and r["reason"] for r in dropped)
    verify = pq.read_table(out / "verify.parquet").to_pylist()
    assert len(verify) == 2 and all(v["equal"] and v["ops"] > 0 for v in verify)
    assert (out / "front_memory.svg").stat().st_size > 1000 and (out / "front_gpus.svg").is_file()
    assert not (out / "work").exists()  # the layouts' own files are gone


@pytest.mark.slow  # a whole search (about a minute)
def test_the_fronts_hold_the_layouts_no_other_beats(searched):
    _, out, _ = searched
    ranking = [r for r in pq.read_table(out / "ranking.parquet").to_pylist() if r["fits"]]
    fronts = pq.read_table(out / "pareto.parquet").to_pylist()
    for front, x in (("memory", "peak_mem_gib"), ("gpus", "gpus")):
        on = [f for f in fronts if f["front"] == front]
        assert on
        for f in on:  # nothing is at least as good in both and better in one
            assert not any(r[x] <= f[x] and r["step_time_s"] < f["step_time_s"] for r in ranking)
        names = {f["layout"] for f in on}
        for r in ranking:  # and every layout off the front is beaten by one on it
            if r["layout"] not in names:
                assert any(f[x] <= r[x] and f["step_time_s"] <= r["step_time_s"] for f in on)


@pytest.mark.slow  # a whole search (about a minute)
def test_search_step_times_are_the_fully_traced_pipelines(searched, tmp_path):
    """Two layouts through the ordinary stages (full traces): the same step time to the digit."""
    import pyarrow.parquet as pq

    from echo.artifacts import RANK_CLASSES
    from echo.dedup import rank_classes
    from echo.io import write_parquet
    from echo.network import run_calibrate
    from echo.profile import run_profile
    from echo.simulate import run_simulate
    from echo.trace import run_trace

    root, out, _ = searched
    ranking = pq.read_table(out / "ranking.parquet").to_pylist()
    exp = S.expand_search("tiny", root / "config")
    hw, topo = load_hardware("h100-sxm-80gb", root / "config"), load_topology("dgx-h100-ndr", root / "config")
    calib = tmp_path / "calib"
    run_calibrate(topo, calib)
    for row in (ranking[0], ranking[-1]):
        w = next(c for c in exp.kept if c.name == row["layout"]).workload
        d = tmp_path / row["tokens"]
        run_trace(w, d / "trace")
        write_parquet(rank_classes(w, pq.read_table(d / "trace" / "ranks.parquet")), d / "c.parquet", RANK_CLASSES)
        run_profile(hw, d / "trace", d / "k.parquet")
        s = run_simulate(w, hw, topo, d / "trace", d / "c.parquet", d / "k.parquet", calib, d / "sim").to_pylist()[0]
        assert s["step_time_s"] == row["step_time_s"], row["layout"]
        assert s["peak_mem_gib"] == row["peak_mem_gib"], row["layout"]


def test_what_templates_cannot_compose_is_traced_in_full_up_to_the_specs_limit(config_root: Path):
    from echo.errors import ConfigError

    write_sweep(config_root, "z3", {**TINY, "gpus": 4, "axes": {"tp": [1], "pp": [1], "zero": [1, 3]}})
    exp = S.expand_search("z3", config_root)
    assert len(exp.kept) == 2 and not exp.dropped
    (name, why), = S.traced_in_full(exp).items()
    assert "-z3" in name and why.startswith("parallel.zero") and "FSDP" in why
    write_sweep(config_root, "z3", {**TINY, "gpus": 4, "trace_in_full": 0, "axes": {"tp": [1], "pp": [1],
                                                                                    "zero": [1, 3]}})
    with pytest.raises(ConfigError, match="trace_in_full") as err:  # before any tracing
        S.traced_in_full(S.expand_search("z3", config_root))
    assert "FSDP" in str(err.value)


@pytest.mark.slow  # a whole search with a traced layout (about half a minute)
def test_a_search_ranks_composed_and_fully_traced_layouts_together(config_root: Path, tmp_path):
    write_sweep(config_root, "z3", {**TINY, "gpus": 4, "verify": 1, "axes": {"tp": [1], "pp": [1], "zero": [1, 3]}})
    result = S.run_search("z3", tmp_path / "out", processes=2, root=config_root)
    rows = pq.read_table(tmp_path / "out" / "ranking.parquet").to_pylist()
    assert result["traced"] == 1 and len(rows) == 2
    assert {r["zero"]: r["trace"] for r in rows} == {1: "composed", 3: "traced"}
    assert all(r["step_time_s"] > 0 for r in rows)


@pytest.mark.slow  # two small searches (about half a minute)
def test_what_cannot_fit_is_dropped_with_its_memory_and_not_simulated(config_root: Path, tmp_path):
    """The same layouts on a device that holds only the lighter half: those over it keep their
    memory figures (as simulated before) and overflow term, and get no step time; the others
    are simulated as before."""
    import yaml

    spec = {**TINY, "gpus": 4, "verify": 1, "axes": {"tp": [1, 2], "pp": [1, 2], "micro_batch": [1, 2],
                                                    "recompute": ["none", "full"]}}
    write_sweep(config_root, "m", spec)
    S.run_search("m", tmp_path / "a", processes=2, root=config_root)
    before = {r["layout"]: r for r in pq.read_table(tmp_path / "a" / "ranking.parquet").to_pylist()}
    assert len(before) == 16 and all(r["fits"] and r["step_time_s"] > 0 for r in before.values())
    hw = config_root / "hardware" / "h100-sxm-80gb.yaml"
    data = yaml.safe_load(hw.read_text())
    device = sorted(r["peak_mem_gib"] for r in before.values())
    data["memory_gib"] = (device[7] + device[8]) / 2 + 0.75  # framework buffers come on top of peak_mem
    hw.write_text(yaml.safe_dump(data))
    S.run_search("m", tmp_path / "b", processes=2, root=config_root)
    after = pq.read_table(tmp_path / "b" / "ranking.parquet").to_pylist()
    over = [r for r in after if not r["fits"]]
    assert 0 < len(over) < 16 and all(r["rank"] is None for r in over)
    for r in after:
        was = before[r["layout"]]
        assert r["peak_mem_gib"] == pytest.approx(was["peak_mem_gib"], rel=1e-12), r["layout"]
        if r["fits"]:
            assert r["step_time_s"] == was["step_time_s"]
        else:
            assert r["step_time_s"] is None and r["overflow"]
    assert [r["fits"] for r in after] == sorted((r["fits"] for r in after), reverse=True)


def test_rows_of_dropped_and_simulated_layouts_keep_every_column():
    # a layout dropped for memory first, a simulated one after: the shard and partial files keep
    # the second's step time (pyarrow alone would take the first row's keys for all)
    rows = [{"layout": "a", "fits": False, "peak_mem_gib": 90.0},
            {"layout": "b", "fits": True, "peak_mem_gib": 40.0, "step_time_s": 1.5}]
    assert S.rows_table(rows).to_pylist() == [{**rows[0], "step_time_s": None}, rows[1]]


def test_overflow_names_the_memory_term_that_passes_the_capacity():
    row = {"fits": False, "mem_state_gib": 50.0, "mem_activations_gib": 40.0, "mem_working_gib": 1.0}
    assert S.overflow(row, 80.0).startswith("activations (90.0 GiB")
    assert S.overflow({**row, "mem_state_gib": 90.0}, 80.0).startswith("state")
    assert S.overflow({**row, "fits": True}, 80.0) is None


def test_pareto_keeps_the_rows_nothing_beats():
    rows = [{"fits": True, "x": x, "step_time_s": t, "layout": n} for n, x, t in
            (("a", 1, 9.0), ("b", 2, 5.0), ("c", 3, 6.0), ("d", 4, 1.0), ("e", 2, 5.5))]
    rows.append({"fits": False, "x": 0, "step_time_s": 0.1, "layout": "f"})
    assert [r["layout"] for r in S.pareto(rows, "x")] == ["a", "b", "d"]


@pytest.mark.slow  # a whole search (about a minute)
def test_a_composed_graph_that_differs_from_its_full_trace_fails_the_search_naming_the_layout(searched, tmp_path):
    """A template whose block was recorded wrong (one kernel's FLOPs doubled in the cache): the
    check traces the sampled rank in full and refuses the search."""
    import shutil

    import pyarrow as pa

    from echo.io import write_parquet

    root, out, _ = searched
    cache = tmp_path / "templates"
    shutil.copytree(out / "templates", cache)
    for ops_file in cache.glob("*/*/ops.parquet"):
        ops = pq.read_table(ops_file).to_pylist()
        for o in ops:  # every block's first GEMM: whichever block a layout's chunk takes
            if o["layer"] >= 0 and o["flops"] > 0 and o["name"] == next(x["name"] for x in ops if x["flops"] > 0):
                o["flops"] *= 2
        write_parquet(pa.Table.from_pylist(ops, schema=pq.read_schema(ops_file)), ops_file)
    exp = S.expand_search("tiny", root / "config")
    with pytest.raises(S.SearchError, match=r"tiny--\S+: rank \d+ composed from templates differs") as err:
        S.verify_composition(exp.kept, cache, 2, tmp_path / "work")
    assert "flops" in str(err.value)


@pytest.mark.slow  # the workflow: template, check, shard and rank jobs (about two minutes)
def test_the_workflow_runs_a_search_as_jobs_and_ranks_as_the_single_process_search_does(workflow_copy, tmp_path):
    from conftest import snakemake, workflow_logs

    spec = {**TINY, "gpus": 4, "shards": 2, "verify": 1,
            "axes": {"tp": [1, 2], "pp": [1, 2], "micro_batch": [1, 2], "zero": [0, 1]}}
    write_sweep(workflow_copy / "config", "tiny", spec)
    target = "results/search/tiny/ranking.parquet"
    proc = snakemake(workflow_copy, "--cores", "2", target)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:] + workflow_logs(workflow_copy)
    jobs = proc.stdout + proc.stderr
    for rule in ("search_template", "search_verify", "search_shard", "search"):
        assert f"rule {rule}:" in jobs or f"localrule {rule}:" in jobs, rule
    assert sorted(p.name for p in (workflow_copy / "results/search/tiny/shards").iterdir()) == ["0.parquet",
                                                                                               "1.parquet"]
    S.run_search("tiny", tmp_path / "one", processes=2, root=workflow_copy / "config")
    as_jobs = pq.read_table(workflow_copy / target).to_pylist()
    in_one = pq.read_table(tmp_path / "one" / "ranking.parquet").to_pylist()
    assert len(as_jobs) == len(in_one) == 16  # tp x pp x micro_batch x zero
    assert [(r["layout"], r["step_time_s"], r["peak_mem_gib"]) for r in as_jobs] == \
        [(r["layout"], r["step_time_s"], r["peak_mem_gib"]) for r in in_one]
