"""Importing a real job's GPU Kineto traces (echo.profile.gpu_import): the shipped A100 traces of
the reference folder (kineto/, from HolisticTraceAnalysis' test data), small hand-written traces for
the rules (launch stacks, NCCL arguments, concurrency, the profiler window), and bad input."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from conftest import snakemake
from test_profile import T, kernel

from echo.cli import main
from echo.config import load_hardware
from echo.io import read_parquet
from echo.profile import gpu_import
from echo.profile.gpu_trace import read_rank
from echo.profile.kineto import KinetoError

A100 = "a100-sxm-80gb"
TRACES = ("a100_128rank_sampled_rank0", "a100_128rank_sampled_rank1", "a100_16rank_rank0", "a100_2rank_nccl_rank0")


@pytest.fixture(scope="module")
def hw():
    return load_hardware(A100)


@pytest.fixture(scope="module")
def imported(reference, hw):
    """Each shipped trace, imported once."""
    return {name: gpu_import.import_traces(reference / "kineto" / f"{name}.json.gz", hw) for name in TRACES}


# --- the shipped traces -----------------------------------------------------------------------
@pytest.mark.parametrize("name", TRACES[:3])
def test_traces_with_shapes_match_at_least_90_percent_of_gpu_kernel_time(imported, name):
    s = imported[name].summary
    assert s["ranks"][0]["shapes_recorded"]
    assert s["matched_share"] >= 0.90, s
    assert s["named_share"] > 0.999  # every kernel has a named op or collective around its launch


def test_a_trace_without_shapes_matches_by_op_name_only(imported):
    s = imported["a100_2rank_nccl_rank0"].summary
    assert not s["ranks"][0]["shapes_recorded"]
    # only its collectives, whose message record_param_comms carries, have sizes
    assert s["named_share"] > 0.999 and s["matched_share"] < 0.5
    assert "recorded without shapes" in gpu_import.describe(imported["a100_2rank_nccl_rank0"])


@pytest.mark.parametrize("name", TRACES)
def test_every_nccl_kernel_carries_its_collective_and_bytes(imported, name):
    act = imported[name].activity.to_pylist()
    nccl = [a for a in act if a["kernel"].startswith("ncclKernel") and a["launched"]]
    assert nccl
    assert all(a["collective"] for a in nccl)
    assert all(a["bytes"] and a["bytes"] > 0 for a in nccl)


def test_nccl_group_and_message_from_record_param_comms(imported):
    """The 2-rank trace's record_param_comms: Collective name, In msg nelems (x4 bytes: Float),
    Group size and Process Group Ranks."""
    act = imported["a100_2rank_nccl_rank0"].activity.to_pylist()
    ar = [a for a in act if a["collective"] == "all_reduce"]
    assert ar and {a["group_size"] for a in ar} == {2} and {a["group_ranks"] for a in ar} == {"[0, 1]"}
    assert all(a["bytes"] % 4 == 0 for a in ar)
    assert {a["collective"] for a in act if a["collective"]} == {"all_reduce", "broadcast"}


def test_the_16_rank_job_reduce_scatters_and_all_to_alls(imported):
    s = imported["a100_16rank_rank0"].summary
    assert {"reduce_scatter", "all_to_all"} <= set(s["collectives"])
    act = imported["a100_16rank_rank0"].activity.to_pylist()
    rs = {a["bytes"] for a in act if a["collective"] == "reduce_scatter"}
    assert 100663296 in rs  # a 96 MiB reduce-scatter input (nccl:reduce_scatter's tensor)


def test_kernels_launched_before_the_window_are_left_out_of_the_share(imported):
    imp = imported["a100_16rank_rank0"]
    before = [a for a in imp.activity.to_pylist() if not a["launched"]]
    assert before and all(a["op"] is None and a["step"] == -1 for a in before)
    assert imp.summary["before_window_us"] == pytest.approx(sum(a["dur_us"] for a in before if a["kind"] == "kernel"))
    launched = sum(a["dur_us"] for a in imp.activity.to_pylist() if a["kind"] == "kernel" and a["launched"])
    assert imp.summary["gpu_kernel_us"] == pytest.approx(launched)


def test_steps_and_streams(imported):
    imp = imported["a100_16rank_rank0"]
    r = imp.summary["ranks"][0]
    assert r["steps"] == 5 and r["world_size"] == 16 and r["device"] == "NVIDIA A100-SXM4-80GB"
    streams = imp.streams.to_pylist()
    assert {s["step"] for s in streams} <= set(range(550, 555))
    for s in streams:
        assert 0 < s["busy_us"] <= s["step_us"] + 1e-6
        assert s["idle_us"] == pytest.approx(s["step_us"] - s["busy_us"])
        assert s["nccl_us"] <= s["busy_us"] + 1e-6
    # NCCL runs on streams of its own, beside the compute stream
    nccl_streams = {s["stream"] for s in streams if s["nccl_us"] > 0}
    compute_streams = {s["stream"] for s in streams if s["nccl_us"] == 0}
    assert nccl_streams and compute_streams


def test_the_a100_model_is_checked_per_op_class_on_the_real_kernels(imported):
    """GEMMs (TF32 tensor-core and fp32 SIMT, told apart by the kernel's name), elementwise and
    copy ops: each with its mean and worst error and the worst shape; events beside another
    stream's kernel are pooled apart from those that ran alone."""
    errs = imported["a100_128rank_sampled_rank0"].summary["model_error"]
    assert {"gemm (fp32)", "gemm (fp32_simt)", "elementwise", "copy"} <= set(errs)
    assert any(c.endswith("beside another stream") for c in errs)
    for e in errs.values():
        assert e["shapes"] >= 1 and e["mean_abs_error"] >= 0 and e["worst_shapes"].startswith("[[")
        assert abs(e["worst_error"]) >= e["mean_abs_error"] - 1e-12
    rows = imported["a100_16rank_rank0"].model_error.to_pylist()
    assert all(r["measured_us"] > 0 and r["predicted_us"] > 0 for r in rows)
    assert all(r["error"] == pytest.approx(r["predicted_us"] / r["measured_us"] - 1) for r in rows)


def test_a_folder_of_ranks_imports_as_one_job(reference, hw, tmp_path):
    job = tmp_path / "dlrm"
    job.mkdir()
    for r in (0, 1):
        shutil.copy(reference / "kineto" / f"a100_128rank_sampled_rank{r}.json.gz", job)
    imp = gpu_import.import_traces(job, hw)
    assert [r["rank"] for r in imp.summary["ranks"]] == [0, 1]
    assert set(imp.activity.column("rank").to_pylist()) == {0, 1}
    assert imp.summary["matched_share"] >= 0.9


# --- hand-written traces: the rules -------------------------------------------------------------
def _op(name, ts, dur, dims=None, types=None, tid=1, cat="cpu_op", **args):
    a = dict(args)
    if dims is not None:
        a.update({"Input Dims": dims, "Input type": types})
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": a}


def _launch(ts, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid, "ts": ts,
            "dur": 2, "args": {"correlation": corr}}


def _kernel(name, ts, dur, corr, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream, "device": 0}}


def _write(path: Path, events, **meta) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, **meta, "traceEvents": events}))
    return path


def _small_job(tmp_path: Path, rank: int = 3) -> Path:
    events = [
        _op("ProfilerStep#7", 0, 1000, cat="user_annotation"),
        _op("aten::linear", 10, 100, [[64, 32], [16, 32], []], ["float", "float", ""]),
        _op("aten::mm", 20, 50, [[64, 32], [32, 16]], ["float", "float"]),  # innermost: its kernel
        _launch(30, 1),
        _op("c10d::allreduce_", 200, 40, [[], [], [], []], ["TensorList", "", "", "Scalar"]),
        _op("record_param_comms", 205, 30, [[], [], [], [], [], [], []], ["TensorList"] + [""] * 6),
        _op("nccl:all_reduce", 210, 20, [[1024]], ["c10::BFloat16"], cat="user_annotation"),
        _launch(215, 2),
        _kernel("volta_sgemm_128x64_nn", 100, 40, 1),
        _kernel("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclDevComm*)", 120, 200, 2, stream=20),
        _kernel("void at::native::vectorized_elementwise_kernel<4>", 5, 10, 99),  # launched before the window
    ]
    return _write(tmp_path / f"rank{rank}.json", events, distributedInfo={"rank": rank, "world_size": 8})


def test_launch_stacks_collectives_and_concurrency(tmp_path):
    r = read_rank(_small_job(tmp_path))
    by_corr = {a["correlation"]: a for a in r.activities}
    mm = by_corr[1]
    assert mm["op"] == "aten::mm" and json.loads(mm["shapes"]) == [[64, 32], [32, 16]] and mm["dtype"] == "float32"
    assert mm["op_class"] == "gemm" and mm["step"] == 7 and mm["with_shapes"]
    assert mm["input_bytes"] == (64 * 32 + 32 * 16) * 4
    assert mm["concurrent_share"] == pytest.approx(20 / 40)  # the all-reduce starts halfway through it
    ar = by_corr[2]
    assert ar["collective"] == "all_reduce" and ar["bytes"] == 1024 * 2 and ar["op_class"] == "collective"
    early = by_corr[99]
    assert not early["launched"] and early["op"] is None and early["step"] == -1
    assert r.rank == 3 and r.world_size == 8


def test_kernel_keys_of_a_traced_workload_join_the_import(tmp_path, hw):
    mm = kernel("aten.mm.default", "gemm", [T([64, 32]), T([32, 16])], flops=2 * 64 * 32 * 16, nbytes=1)
    other = kernel("aten.mm.default", "gemm", [T([64, 32]), T([32, 8])], flops=1, nbytes=1)
    imp = gpu_import.import_traces(_small_job(tmp_path), hw, kernels=[mm, other])
    keys = {a["correlation"]: a["kernel_key"] for a in imp.activity.to_pylist()}
    assert keys[1] == mm.kernel_key and keys[2] is None
    assert imp.summary["kernel_keys"] == {"traced": 2, "matched_activities": 1}


def test_the_command_prints_the_matched_share_and_writes_the_tables(tmp_path, capsys):
    trace = _small_job(tmp_path)
    assert main(["import-kineto", str(trace), "--hardware", A100, "--results", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    assert "matched 100.0% of GPU time" in out
    folder = tmp_path / "res" / "import" / "rank3" / A100
    assert read_parquet(folder / "activity.parquet").num_rows == 3
    assert json.loads((folder / "import.json").read_text())["matched_share"] == 1.0


# --- bad input ----------------------------------------------------------------------------------
def test_bad_input_is_refused_with_file_and_reason(reference, tmp_path, hw, capsys):
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes((reference / "kineto" / "a100_2rank_nccl_rank0.json.gz").read_bytes()[:20000])
    with pytest.raises(KinetoError, match=r"cut\.json\.gz: not a JSON Chrome trace"):
        gpu_import.import_traces(cut, hw)
    other = _write(tmp_path / "other.json", [{"ph": "X", "cat": "function", "name": "f", "ts": 0, "dur": 1}])
    with pytest.raises(KinetoError, match=r"other\.json: no cpu_op events"):
        gpu_import.import_traces(other, hw)
    cpu_only = _write(tmp_path / "cpu.json", [_op("aten::mm", 0, 5, [[2, 2], [2, 2]], ["float", "float"])])
    with pytest.raises(KinetoError, match=r"cpu\.json: no GPU activity"):
        gpu_import.import_traces(cpu_only, hw)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KinetoError, match="a folder with no trace files"):
        gpu_import.import_traces(empty, hw)
    twice = tmp_path / "twice"
    twice.mkdir()
    _small_job(twice, rank=3)
    shutil.copy(twice / "rank3.json", twice / "again.json")
    with pytest.raises(KinetoError, match="rank 3 again"):
        gpu_import.import_traces(twice, hw)
    # the command: status 2 and one line naming the file, nothing written
    assert main(["import-kineto", str(cut), "--hardware", A100, "--results", str(tmp_path / "res")]) == 2
    assert "cut.json.gz" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()


def test_a_gzip_trace_reads_like_its_json(tmp_path, hw):
    plain = _small_job(tmp_path)
    gz = tmp_path / "rank3.json.gz"
    with gzip.open(gz, "wt") as fh:
        fh.write(plain.read_text())
    a = gpu_import.import_traces(plain, hw).activity
    b = gpu_import.import_traces(gz, hw).activity
    assert a.equals(b)


@pytest.mark.slow
def test_the_workflow_rule_imports_a_dropped_in_job(reference, workflow_copy: Path):
    job = workflow_copy / "imports" / "gpu" / "dlrm"
    job.mkdir(parents=True)
    for r in (0, 1):
        shutil.copy(reference / "kineto" / f"a100_128rank_sampled_rank{r}.json.gz", job)
    target = f"results/import/dlrm/{A100}/import.json"
    overlay = f"results/fit/overlay/dlrm/{A100}.json"
    proc = snakemake(workflow_copy, "--cores", "1", target, overlay)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((workflow_copy / target).read_text())
    assert len(summary["ranks"]) == 2 and summary["matched_share"] >= 0.9
    assert "matched" in (workflow_copy / "logs" / "import" / "dlrm" / f"{A100}.log").read_text()
    assert json.loads((workflow_copy / overlay).read_text())["validation"]
    # copied to imports/overlay/, it is an input of every profile job on that hardware
    (workflow_copy / "imports" / "overlay").mkdir()
    shutil.copy(workflow_copy / overlay, workflow_copy / "imports" / "overlay" / f"{A100}.json")
    proc = snakemake(workflow_copy, "-n", "--cores", "1", f"results/profile/tiny-dp2/{A100}/kernels.parquet")
    assert proc.returncode == 0 and f"imports/overlay/{A100}.json" in proc.stdout + proc.stderr


# --- explain ------------------------------------------------------------------------------------
def test_explain_a_real_multi_rank_job_phase_by_phase(reference, tmp_path, capsys):
    """The 128-rank job's two sampled ranks, imported and explained on the Azure NDv4 fit: per
    rank, the step, then compute per op class, communication per collective, exposed communication
    and idle, measured beside predicted where a model reads the work, largest difference first."""
    job = tmp_path / "dlrm"
    job.mkdir()
    for r in (0, 1):
        shutil.copy(reference / "kineto" / f"a100_128rank_sampled_rank{r}.json.gz", job)
    res = tmp_path / "res"
    assert main(["import-kineto", str(job), "--hardware", A100, "--results", str(res)]) == 0
    capsys.readouterr()
    assert main(["explain", "dlrm", "--hardware", A100, "--topology", "azure-ndv4", "--results", str(res)]) == 0
    out = capsys.readouterr().out
    assert "compute:gemm" in out and "exposed_comm" in out and "idle" in out
    rows = read_parquet(res / "import" / "dlrm" / A100 / "explain.parquet").to_pylist()
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert mine[0]["phase"] == "step"
        phases = {r["phase"]: r for r in mine}
        assert {"compute:gemm", "comm:all_to_all", "comm:all_gather x64", "exposed_comm", "idle"} <= set(phases)
        assert phases["compute:gemm"]["predicted_ms"] > 0
        diffs = [abs(r["difference_ms"]) for r in mine[1:] if r["difference_ms"] is not None]
        assert diffs == sorted(diffs, reverse=True)  # largest difference first
        # the phases that take GPU time, and the idle, are the step (NCCL beside compute counted twice at most)
        busy = sum(r["measured_ms"] for r in mine if r["phase"].startswith(("compute:", "comm:", "memcpy")))
        assert busy + phases["idle"]["measured_ms"] >= phases["step"]["measured_ms"] * 0.99


def test_explain_needs_an_import_first(tmp_path, capsys):
    assert main(["explain", "nothing", "--hardware", A100, "--results", str(tmp_path)]) == 1
    assert "import-kineto" in capsys.readouterr().err


# --- overlay ------------------------------------------------------------------------------------
def test_an_overlay_is_fitted_on_a_declared_split_and_scored_on_the_rest(imported):
    from echo.profile.overlay import build_overlay, held_out

    rows = imported["a100_16rank_rank0"].model_error.to_pylist() + imported["a100_128rank_sampled_rank0"].model_error.to_pylist()
    doc = build_overlay(rows, A100, ["x"])
    fit_sigs = {r["signature"] for r in rows if r["isolated"] and not held_out(r["signature"])}
    assert set(doc["exact"]) <= fit_sigs  # no held-out shape is in the exact table
    assert doc["split"]["held_out_shapes"] > 0 and doc["validation"]
    for v in doc["validation"].values():
        assert v["shapes"] > 0 and v["model_mean_abs_error"] >= 0 and v["overlay_mean_abs_error"] >= 0
    for r in doc["regimes"].values():  # kept only where it beat the model on its own fit shapes, left out in turn
        assert r["shapes"] >= 3 and r["loo_mean_abs_error"] < r["model_mean_abs_error"]


def test_the_profile_stage_uses_an_overlay_for_the_kernels_it_covers(tmp_path):
    from test_profile import ops_table

    from echo.profile import distinct_kernels, run_profile
    from echo.profile.gpu_trace import signature_id
    from echo.profile.kineto import kernel_signature
    from echo.profile.overlay import SCHEMA, regime

    hw = load_hardware(A100)
    mm = kernel("aten.mm.default", "gemm", [T([4096, 4096], "bfloat16"), T([4096, 4096], "bfloat16")],
                dtype="bfloat16", flops=2 * 4096**3, nbytes=3 * 4096 * 4096 * 2)
    add = kernel("aten.add.Tensor", "elementwise", [T([4096, 4096], "bfloat16"), T([4096, 4096], "bfloat16")],
                 dtype="bfloat16", nbytes=3 * 4096 * 4096 * 2)
    relu = kernel("aten.relu.default", "elementwise", [T([64], "bfloat16")], dtype="bfloat16", nbytes=256)
    trace = tmp_path / "trace"
    trace.mkdir()
    from echo.io import write_parquet

    write_parquet(ops_table([mm, add, relu]), trace / "ops.parquet")
    kernels = distinct_kernels(read_parquet(trace / "ops.parquet"))
    from echo.profile import roofline

    est = {k.name: roofline.estimate(hw, k) for k in kernels}
    k_add = next(k for k in kernels if k.name == "aten.add.Tensor")
    doc = {"schema": SCHEMA, "hardware": A100, "sources": ["test"],
           "exact": {signature_id(kernel_signature(next(k for k in kernels if k.name == "aten.mm.default"))): 777.0},
           "regimes": {regime("elementwise", "", est["aten.add.Tensor"].bound, k_add.bytes): {"factor": 1.5}}}
    overlay = tmp_path / "overlay.json"
    overlay.write_text(json.dumps(doc))
    note = run_profile(hw, trace, tmp_path / "out" / "kernels.parquet", overlay=overlay)
    rows = {r["name"]: r for r in read_parquet(tmp_path / "out" / "kernels.parquet").to_pylist()}
    assert rows["aten.mm.default"]["source"] == "overlay" and rows["aten.mm.default"]["duration_us"] == 777.0
    assert rows["aten.add.Tensor"]["source"] == "model+overlay"
    assert rows["aten.add.Tensor"]["duration_us"] == pytest.approx(1.5 * est["aten.add.Tensor"].duration_us)
    assert rows["aten.relu.default"]["source"] == "model"
    assert note["overlay"]["covered"] == {"overlay": 1, "model+overlay": 1} and note["overlay"]["modelled"] == 1
    # another hardware's overlay, or a CPU target, is refused before any work
    with pytest.raises(ValueError, match="not 'h100-sxm-80gb'"):
        run_profile(load_hardware("h100-sxm-80gb"), trace, tmp_path / "o2" / "kernels.parquet", overlay=overlay)
    with pytest.raises(ValueError, match="timed here"):
        run_profile(load_hardware("local-cpu"), trace, tmp_path / "o3" / "kernels.parquet", overlay=overlay)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_explain_beside_a_simulated_workload(tmp_path, hw):
    """With the job's simulated step, the step-level rows carry Echo's predictions."""
    from echo.report.explain import explain

    imp = gpu_import.import_traces(_small_job(tmp_path), hw)
    sim = {"workload": "w", "topology": "t", "step_time_s": 1e-3, "compute_s": 2e-5, "exposed_comm_s": 1e-4,
           "bubble_s": 3e-4}
    rows = {r["phase"]: r for r in explain(imp.activity, imp.summary, hw, None, sim).to_pylist()}
    assert rows["step"]["predicted_ms"] == pytest.approx(1.0) and rows["step"]["measured_ms"] == pytest.approx(1.0)
    assert rows["compute"]["measured_ms"] == pytest.approx(0.040)  # the mm kernel, 40 us
    assert rows["compute"]["predicted_ms"] == pytest.approx(0.020)
    # 200 us of all-reduce, 20 of them beside the mm: 180 us exposed
    assert rows["exposed_comm"]["measured_ms"] == pytest.approx(0.180)
    assert rows["exposed_comm"]["predicted_ms"] == pytest.approx(0.1)
    assert rows["idle"]["measured_ms"] == pytest.approx(1.0 - 0.220) and rows["idle"]["predicted_ms"] == pytest.approx(0.3)
