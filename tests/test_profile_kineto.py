"""Imported mode: kernel durations from a PyTorch profiler (Kineto) Chrome trace.

Unit tests on small hand-written traces (matching, nesting, GPU device time, errors), and one real
run here: a one-rank GPT trained for a few steps under torch.profiler, imported into the profile
of Echo's own trace of the same workload, whose simulated step must reproduce the run's step.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics

import pytest
from test_profile import ALL_REDUCE, T, kernel, ops_table, write_trace

from echo.config import load_hardware, load_topology
from echo.config.workload import Workload
from echo.io import read_parquet
from echo.profile import distinct_kernels, kineto, run_profile


def cpu_op(name, ts, dur, dims, types, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"Input Dims": dims, "Input type": types}}


def write_chrome(path, events):
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


MM = kernel("aten.mm.default", "gemm", [T([64, 32]), T([32, 16])], flops=2 * 64 * 32 * 16, nbytes=1)
ADD = kernel("aten.add.Tensor", "elementwise", [T([8, 64]), T([8, 64])], {"alpha": 1}, nbytes=1)
TO_COPY = kernel("aten._to_copy.default", "copy", [T([8, 64])], {"dtype": {"S": "torch.bfloat16"}}, nbytes=1)
ADAMW = kernel("aten._fused_adamw_.default", "optimizer",
               [[T([64])], [T([64])], [T([64])], [T([64])], [], [T([], "float32")]],
               {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8,
                "amsgrad": False, "maximize": False}, nbytes=1)


# --- signatures ---------------------------------------------------------------------------
def test_signature_of_a_kernel_equals_that_of_its_profiler_event():
    ev = cpu_op("aten::mm", 0, 5, [[64, 32], [32, 16]], ["float", "float"])
    assert kineto.kernel_signature(MM) == kineto.event_signature(ev)
    other_dtype = cpu_op("aten::mm", 0, 5, [[64, 32], [32, 16]], ["c10::BFloat16", "c10::BFloat16"])
    other_shape = cpu_op("aten::mm", 0, 5, [[64, 32], [32, 17]], ["float", "float"])
    assert kineto.event_signature(other_dtype) != kineto.kernel_signature(MM)
    assert kineto.event_signature(other_shape) != kineto.kernel_signature(MM)


def test_scalars_zero_dim_tensors_and_tensor_lists():
    # add(x, y, alpha=1): the profiler lists the scalar as [] / "Scalar"
    ev = cpu_op("aten::add", 0, 1, [[8, 64], [8, 64], []], ["float", "float", "Scalar"])
    assert kineto.event_signature(ev) == kineto.kernel_signature(ADD)
    # a Python number passed to a tensor op: a 0-d tensor for the profiler, a number in the trace
    arange_plus = kernel("aten.add.Tensor", "elementwise", [T([128], "int64"), 0])
    ev = cpu_op("aten::add", 0, 1, [[128], [], []], ["long int", "long int", "Scalar"])
    assert kineto.event_signature(ev) == kineto.kernel_signature(arange_plus)
    # fused AdamW: tensor lists, an empty list, a list of 0-d step tensors
    ev = cpu_op("aten::_fused_adamw_", 0, 9, [[[64]], [[64]], [[64]], [[64]], [], [[]]] + [[]] * 9,
                ["TensorList"] * 6 + ["Scalar"] * 7 + ["", ""])
    assert kineto.event_signature(ev) == kineto.kernel_signature(ADAMW)


def test_optional_tensor_lists_are_left_out_on_both_sides():
    """The profiler records index_put_'s indices (a Tensor?[] list) as nothing at all."""
    k = kernel("aten.index_put_.default", "other", [T([4, 8]), [T([2], "int64"), T([2], "int64")], T([2]), True])
    ev = cpu_op("aten::index_put_", 0, 1, [[4, 8], [], [2], []], ["float", "", "float", "Scalar"])
    assert kineto.kernel_signature(k) == kineto.event_signature(ev) == ("aten::index_put_", (((4, 8), "float32"),
                                                                                           ((2,), "float32")))


# --- import ---------------------------------------------------------------------------------
def test_import_takes_the_median_and_only_outermost_matches(tmp_path):
    events = [
        cpu_op("aten::linear", 0, 100, [[64, 32], [16, 32], []], ["float", "float", ""]),  # not traced
        cpu_op("aten::mm", 10, 50, [[64, 32], [32, 16]], ["float", "float"]),               # inside linear
        cpu_op("aten::mm", 200, 70, [[64, 32], [32, 16]], ["float", "float"]),
        cpu_op("aten::mm", 300, 10_000, [[64, 32], [32, 16]], ["float", "float"]),          # preempted
        cpu_op("aten::_to_copy", 20_000, 30, [[8, 64], [], [], [], [], [], []],
               ["float", "Scalar", "", "", "", "Scalar", ""]),
        # the copy_ the cast runs inside: part of _to_copy's time, not an ADD/anything of its own
        cpu_op("aten::copy_", 20_005, 20, [[8, 64], [8, 64], []], ["c10::BFloat16", "float", "Scalar"]),
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 1, "tid": 1, "ts": 0, "dur": 21_000},
    ]
    copy_ = kernel("aten.copy_.default", "copy", [T([8, 64], "bfloat16"), T([8, 64])], nbytes=1)
    imp = kineto.import_trace([MM, TO_COPY, copy_, ADD], write_chrome(tmp_path / "t.json", events))
    assert imp.device == "cpu"
    assert imp.durations_us[MM.kernel_key] == 70.0          # median of 50, 70, 10000
    assert imp.events[MM.kernel_key] == 3
    assert imp.durations_us[TO_COPY.kernel_key] == 30.0
    assert {k.kernel_key for k in imp.unmatched} == {copy_.kernel_key, ADD.kernel_key}
    assert imp.steps_us == [21_000.0]
    note = imp.note()
    assert note["unmatched_kernels"] == 2 and note["unmatched_by_op"] == {"aten.copy_.default": 1, "aten.add.Tensor": 1}


def test_a_gpu_trace_gives_device_time(tmp_path):
    """On a GPU trace the op's duration is its kernels' device time (launch -> kernel by
    correlation id), not the host time of the launch."""
    events = [
        cpu_op("aten::mm", 0, 8, [[64, 32], [32, 16]], ["c10::BFloat16", "c10::BFloat16"]),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 2, "dur": 4,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "sm80_xmma_gemm", "pid": 0, "tid": 7, "ts": 50, "dur": 120.5,
         "args": {"correlation": 7}},
        cpu_op("aten::mm", 100, 8, [[64, 32], [32, 16]], ["c10::BFloat16", "c10::BFloat16"]),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 101, "dur": 4,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "sm80_xmma_gemm", "pid": 0, "tid": 7, "ts": 180, "dur": 119.5,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "splitk_reduce", "pid": 0, "tid": 7, "ts": 300, "dur": 10.0,
         "args": {"correlation": 8}},
    ]
    mm16 = kernel("aten.mm.default", "gemm", [T([64, 32], "bfloat16"), T([32, 16], "bfloat16")], dtype="bfloat16")
    imp = kineto.import_trace([mm16], write_chrome(tmp_path / "g.json", events))
    assert imp.device == "gpu"
    assert imp.durations_us[mm16.kernel_key] == pytest.approx((120.5 + 129.5) / 2)


def test_unreadable_traces_are_refused_with_the_reason(tmp_path):
    with pytest.raises(kineto.KinetoError, match="no such file"):
        kineto.load_events(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(kineto.KinetoError, match="not a JSON"):
        kineto.load_events(tmp_path / "bad.json")
    no_shapes = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0, "dur": 1, "args": {}}]
    with pytest.raises(kineto.KinetoError, match="record_shapes=True"):
        kineto.load_events(write_chrome(tmp_path / "noshape.json", no_shapes))
    gz = tmp_path / "t.json.gz"
    with gzip.open(gz, "wt") as fh:
        json.dump({"traceEvents": [cpu_op("aten::mm", 0, 5, [[64, 32], [32, 16]], ["float", "float"])]}, fh)
    assert len(kineto.load_events(gz)) == 1


def test_the_stage_fills_imported_rows_and_falls_back_for_the_rest(tmp_path):
    """On a GPU target, kernels the import lacks are modelled, and profile.json counts them."""
    mm16 = kernel("aten.mm.default", "gemm", [T([4096, 4096], "bfloat16"), T([4096, 4096], "bfloat16")],
                  dtype="bfloat16", flops=2 * 4096**3, nbytes=3 * 2 * 4096**2)
    add = kernel("aten.add.Tensor", "elementwise", [T([64]), T([64])], nbytes=768)
    trace = write_trace(tmp_path, ops_table([mm16, add], repeat={0: 2}, extra_rows=[ALL_REDUCE]))
    events = [cpu_op("aten::mm", 0, 600.0, [[4096, 4096], [4096, 4096]], ["c10::BFloat16", "c10::BFloat16"])]
    note = run_profile(load_hardware("h100-sxm-80gb"), trace, tmp_path / "k.parquet",
                       imported=write_chrome(tmp_path / "run.json", events))
    rows = {r["name"]: r for r in read_parquet(tmp_path / "k.parquet").to_pylist()}
    assert rows["aten.mm.default"]["source"] == "imported" and rows["aten.mm.default"]["duration_us"] == 600.0
    assert rows["aten.mm.default"]["achieved_tflops"] == pytest.approx(2 * 4096**3 / 600.0 / 1e6)
    assert rows["aten.add.Tensor"]["source"] == "model"
    assert note["sources"] == {"imported": 1, "model": 1}
    assert note["imported"]["unmatched_kernels"] == 1
    assert note["imported"]["unmatched_by_op"] == {"aten.add.Tensor": 1}
    on_disk = json.loads((tmp_path / "profile.json").read_text())
    assert on_disk["imported"]["unmatched_kernels"] == 1


def test_dropped_in_trace_is_found_by_convention(tmp_path):
    assert kineto.dropped_in_trace("w", "h", tmp_path) == {}
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "h.json.gz").write_bytes(b"")
    assert kineto.dropped_in_trace("w", "h", tmp_path) == {"imported": str(tmp_path / "w" / "h.json.gz")}


# --- a real run here ------------------------------------------------------------------------
# Big enough that kernels, not Python, make up the step (with hidden 256 and 128 tokens the
# interpreter and autograd bookkeeping between ops were 17% of it), small enough for a test.
REAL = dict(name="kineto-gpt", model=dict(arch="gpt", layers=2, hidden=384, heads=6, vocab=2048, seq_len=256),
            parallel=dict(tp=1, pp=1, dp=1, zero=0), training=dict(global_batch=4, micro_batch=4, dtype="fp32"))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    from echo.dedup import run_dedup
    from echo.profile import realrun
    from echo.trace import run_trace

    w = Workload.model_validate(REAL)
    d = tmp_path_factory.mktemp("real")
    run_trace(w, d / "trace")
    run_dedup(w, d / "trace", d / "rank_classes.parquet")
    run = realrun.profile_step(w, d / "kineto.json", steps=4, warmup=2)
    return w, d, run


def test_a_real_runs_trace_covers_every_traced_kernel(real_run):
    w, d, run = real_run
    kernels = distinct_kernels(read_parquet(d / "trace" / "ops.parquet"))
    imp = kineto.import_trace(kernels, run.trace)
    assert imp.unmatched == [], [k.name for k in imp.unmatched]
    assert len(imp.steps_us) == 4
    # every traced kernel ran in every profiled step, at least as often as the trace has it, except
    # where autograd accumulates gradients in place in the real run (add_ instead of add)
    per_step = {k.kernel_key: imp.events[k.kernel_key] / 4 for k in kernels}
    short = {k.name for k in kernels if per_step[k.kernel_key] < k.count}
    assert short <= {"aten.add.Tensor"}, short


def test_imported_durations_reproduce_the_measured_step_within_10pct(real_run):
    """Echo's simulated step of the one-rank workload (its own trace's ops, durations imported from
    the real run) against the step time that run measured (median of the profiled steps)."""
    from echo.network import NetworkModel
    from echo.simulate import run_simulate

    w, d, run = real_run
    hw, topo = load_hardware("local-cpu"), load_topology("local-gloo")
    note = run_profile(hw, d / "trace", d / "kernels.parquet", cache_dir=d / "cache", imported=run.trace)
    assert note["sources"] == {"imported": note["kernels"]}
    summary = run_simulate(w, hw, topo, d / "trace", d / "rank_classes.parquet", d / "kernels.parquet", None,
                           d / "sim", network=NetworkModel(topo))
    simulated_us = summary["step_time_s"][0].as_py() * 1e6
    measured_us = statistics.median(run.profiled_step_us)
    print(f"simulated {simulated_us / 1e3:.1f} ms, measured (profiled) {measured_us / 1e3:.1f} ms "
          f"(its CPU time {statistics.median(run.profiled_step_cpu_us) / 1e3:.1f} ms), unprofiled "
          f"{run.median_unprofiled_us / 1e3:.1f} ms; 1-min load {run.load[0]:.1f} -> {run.load[1]:.1f}")
    if abs(simulated_us / measured_us - 1) > 0.10 and max(run.load) > 2 * (os.cpu_count() or 1):
        # a saturated machine stretches the step's wall time between ops (waiting for a core)
        # more than the ops' own spans
        pytest.skip(f"machine too busy (1-min load {max(run.load):.1f} on {os.cpu_count()} cores): "
                    f"simulated {simulated_us / 1e3:.1f} ms vs measured {measured_us / 1e3:.1f} ms")
    assert simulated_us == pytest.approx(measured_us, rel=0.10)
