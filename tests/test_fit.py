"""The GPU compute model fitted to published measurements (echo.fit).

- the GEMM model's best case against hardware.csv, and the drop for badly shaped GEMMs;
- Korthikanti et al. 2022 Table 4 (one 22B GPT layer, TP8, DGX A100): each row traced by Echo and
  costed with the A100 file's parameters, within 10%; the fit reproduces the file's parameter and
  its held-out rows stay within 10%;
- the step-time fit (H100), on a small traced job and, where the workflow traced them, on the
  Megatron-Core rows;
- the provenance the hardware files carry, and the fit each names (none stale).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import edit_yaml

from echo import fit
from echo.config import load_hardware
from echo.errors import ConfigError
from echo.fit import compute as cal
from echo.fit import step as steps
from echo.fit.common import network_model, with_params
from echo.workflow import paths
from echo.workflow.versions import code_version

GPUS = sorted(cal.BEST_GEMM_TFLOPS)


# --- reference figures -----------------------------------------------------------------------
def test_copied_figures_match_the_reference_files(reference):
    assert cal.check_reference(reference) == []


# --- GEMM ceiling and shape sweep ---------------------------------------------------------------
@pytest.mark.parametrize("name", GPUS)
def test_best_case_gemm_is_within_5pct_of_the_measured_ceiling(name):
    hw = load_hardware(name)
    best, shape = cal.best_gemm(hw)
    measured = cal.BEST_GEMM_TFLOPS[name]
    assert abs(best / measured - 1) < 0.05, (name, best, measured, shape)
    # and the file holds what the closed-form fit gives (so it cannot drift from the measurement)
    assert hw.compute_model.matmul_efficiency == pytest.approx(cal.fit_matmul_efficiency(hw, measured), abs=2e-4)
    assert hw.compute_model.provenance["matmul_efficiency"].status == "fitted"


def test_fit_matmul_efficiency_recovers_a_known_value():
    hw = with_params(load_hardware("a100-sxm-80gb"), matmul_efficiency=0.7)
    target, _ = cal.best_gemm(hw)
    assert cal.fit_matmul_efficiency(with_params(hw, matmul_efficiency=0.95), target) == pytest.approx(0.7, abs=1e-3)


@pytest.mark.parametrize("name", ["a100-sxm-80gb", "h100-sxm-80gb", "b200-sxm"])
def test_gemm_shape_sweep_shows_the_expected_drop(name):
    """Throughput against shape: small M or K starve the GPU, odd sizes waste tiles and waves."""
    hw = load_hardware(name)
    best, _ = cal.best_gemm(hw)
    m_sweep = [cal.gemm_tflops(hw, m, 8192, 8192) for m in (16, 64, 256, 1024, 4096, 16384)]
    k_sweep = [cal.gemm_tflops(hw, 8192, 8192, k) for k in (32, 128, 512, 4096, 16384)]
    assert m_sweep == sorted(m_sweep) and k_sweep == sorted(k_sweep)  # more work per launch never hurts
    assert m_sweep[0] < 0.1 * best            # M=16: a GEMV-like shape is bandwidth-bound
    assert m_sweep[-1] > 0.95 * best          # a large square-ish GEMM is near the ceiling
    assert k_sweep[0] < 0.3 * best            # K=32: tile pipeline fill is not amortised
    aligned, odd = cal.gemm_tflops(hw, 4096, 4096, 4096), cal.gemm_tflops(hw, 4097, 4097, 4096)
    assert odd < 0.93 * aligned               # one row/column more: a whole extra row of tiles
    assert all(t <= best * 1.0001 for t in m_sweep + k_sweep + [aligned, odd])


def test_batched_attention_sized_gemms_lose_to_large_ones():
    """The unfused attention GEMMs of Table 4's layer (32 heads x 2048 x 2048 x 96): short K."""
    hw = load_hardware("a100-sxm-80gb")
    scores = cal.gemm_tflops(hw, 2048, 2048, 96, batch=32)
    assert scores < 0.75 * cal.gemm_tflops(hw, 8192, 2304, 6144)


# --- Korthikanti Table 4 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def layer_traces():
    """Every Table 4 row traced (1 and 2 layers, rank 0), or skipped when the tracer refuses."""
    rows = [r for r in cal.KORTHIKANTI_TABLE4 if cal.traceable(r) is None]
    if len(rows) < len(cal.KORTHIKANTI_TABLE4):
        missing = {r.experiment: cal.traceable(r) for r in cal.KORTHIKANTI_TABLE4 if r not in rows}
        print(f"not traceable yet: {missing}")
    return cal.trace_layers(rows)


@pytest.fixture(scope="module")
def network():
    return network_model(cal.KORTHIKANTI_TOPOLOGY)


def test_every_table4_row_is_traceable():
    assert {r.experiment: cal.traceable(r) for r in cal.KORTHIKANTI_TABLE4} == \
        {r.experiment: None for r in cal.KORTHIKANTI_TABLE4}


@pytest.mark.slow
def test_each_table4_row_is_reproduced_within_10pct(layer_traces, network):
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    rows = cal.evaluate(hw, layer_traces, network)
    assert {r.experiment for r in rows} == {r.experiment for r in cal.KORTHIKANTI_TABLE4}
    table = "\n".join(cal.layer_lines(rows))
    print(table)
    for r in rows:
        fwd, bwd = r.errors_pct
        assert abs(fwd) < 10 and abs(bwd) < 10, table


def test_layer_structure_matches_the_paper(layer_traces, network):
    """What the rows differ by: full recompute replays the forward (TP all-reduces included) inside
    backward; selective recompute replays only the attention core; sequence parallelism swaps each
    all-reduce for an all-gather + reduce-scatter of the same bytes."""
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    t = {lt.row.experiment: cal.layer_time(hw, lt, network) for lt in layer_traces}
    base, full = t["baseline no recompute"], t["baseline with full recompute"]
    sel, sp = t["selective recompute"], t["sequence parallelism"]
    assert full.backward_ms == pytest.approx(base.backward_ms + base.forward_ms, rel=0.02)
    assert full.backward_parts["comm:all_reduce"] == pytest.approx(2 * base.backward_parts["comm:all_reduce"])
    extra = sel.backward_ms - base.backward_ms
    assert 0.05 * base.forward_ms < extra < 0.4 * base.forward_ms
    assert sel.forward_ms == pytest.approx(base.forward_ms)
    assert "comm:all_reduce" not in sp.forward_parts
    assert sp.forward_parts["comm:all_gather"] + sp.forward_parts["comm:reduce_scatter"] == \
        pytest.approx(base.forward_parts["comm:all_reduce"], rel=0.05)


def test_layer_sum_equals_the_simulators_op_level_replay(layer_traces, network):
    """The per-layer figures are what the simulator would compute: its replay of the traced chunk
    (blocking TP collectives) gives the same forward and backward times."""
    from echo.profile.stage import distinct_kernels
    from echo.simulate.costing import CommTimer, OpContext, reduce_rank

    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    lt = next(t for t in layer_traces if t.row.experiment == "selective recompute")
    sims = {}
    for layers in (1, 2):
        ops, comms = lt.ops[layers], lt.comms[layers]
        kernels = {k.kernel_key: cal.roofline.estimate(hw, k).duration_us for k in distinct_kernels(ops)}
        rc = reduce_rank(ops.to_pylist(), {r["comm_id"]: r for r in comms.to_pylist()},
                         OpContext(kernels, CommTimer(network)))
        sims[layers] = (rc.forward[0].cost.duration_us, rc.backward[0].cost.duration_us)
    ours = cal.layer_time(hw, lt, network)
    assert ours.forward_ms == pytest.approx((sims[2][0] - sims[1][0]) / 1e3, rel=1e-6)
    assert ours.backward_ms == pytest.approx((sims[2][1] - sims[1][1]) / 1e3, rel=1e-6)


def test_refit_reproduces_the_file_and_the_held_out_rows_stay_within_10pct(layer_traces, network):
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    fitted_gemm, _ = cal.fit_gemm(hw)
    report = cal.fit_layers(fitted_gemm, network, traces=layer_traces)
    print("\n".join(cal.layer_lines(report.rows)))
    # a trace or network model change moves the fit: re-run `make fit` and copy its figures into
    # config/hardware/*.yaml (values, provenance and fitted_by.code)
    assert report.fitted["hbm_efficiency"] == pytest.approx(hw.compute_model.hbm_efficiency, abs=0.01)
    assert fitted_gemm.compute_model.matmul_efficiency == pytest.approx(hw.compute_model.matmul_efficiency, abs=2e-4)
    held = [r for r in report.rows if r.split == "held-out"]
    assert len(held) >= len(cal.KORTHIKANTI_TABLE4) - len(cal.FIT_ROWS)
    assert all(abs(e) < 10 for r in held for e in r.errors_pct)
    # the fit is not an artefact of the split: fitting on the other rows instead lands close by,
    # and reproduces the rows held out then within 10% too
    other = [r.experiment for r in cal.KORTHIKANTI_TABLE4 if r.experiment not in cal.FIT_ROWS]
    swapped = cal.fit_layers(fitted_gemm, network, fit_rows=other, traces=layer_traces)
    print("\n".join(cal.layer_lines(swapped.rows)))
    assert swapped.fitted["hbm_efficiency"] == pytest.approx(report.fitted["hbm_efficiency"], abs=0.06)
    assert all(abs(e) < 10 for r in swapped.rows if r.split == "held-out" for e in r.errors_pct)


def test_the_fit_moves_the_prediction(layer_traces, network):
    """hbm_efficiency is identifiable from the rows: a lower value makes every row slower."""
    hw = load_hardware(cal.KORTHIKANTI_HARDWARE)
    slow = cal.evaluate(with_params(hw, hbm_efficiency=0.5), layer_traces, network)
    fast = cal.evaluate(hw, layer_traces, network)
    for s, f in zip(slow, fast, strict=True):
        assert s.predicted_forward_ms > 1.05 * f.predicted_forward_ms


# --- whole jobs' step times (H100) ----------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small_case(tmp_path_factory):
    """A small sequence-parallel job traced for real, as a step-time case (its 'measurement' is set
    by the test)."""
    import pyarrow.parquet as pq

    from echo.artifacts import RANK_CLASSES
    from echo.config import parse_workload
    from echo.dedup import rank_classes
    from echo.io import read_parquet, write_parquet
    from echo.profile.stage import distinct_kernels
    from echo.trace import run_trace

    root = tmp_path_factory.mktemp("step")
    w = parse_workload({
        "model": {"arch": "gpt", "layers": 2, "hidden": 512, "heads": 8, "vocab": 1024, "seq_len": 512},
        "parallel": {"tp": 2, "pp": 1, "dp": 2, "zero": 1, "sequence_parallel": True, "tp_comm_overlap": True,
                     "overlap_grad_reduce": True, "overlap_param_gather": True},
        "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}},
        Path("step-4.yaml"))
    run_trace(w, root / "trace")
    write_parquet(rank_classes(w, pq.read_table(root / "trace" / "ranks.parquet")), root / "rank_classes.parquet",
                  RANK_CLASSES)
    kernels = tuple(distinct_kernels(read_parquet(root / "trace" / "ops.parquet")))
    return steps.StepCase("small", w, 1.0, root / "trace", root / "rank_classes.parquet", kernels)


def test_step_time_fit_recovers_a_known_value(small_case):
    import dataclasses

    network = network_model(steps.STEP_TOPOLOGY)
    hw = load_hardware(steps.STEP_HARDWARE)
    truth = steps.step_times(with_params(hw, sustained_compute=0.6), [small_case], network)["small"]
    faster = steps.step_times(with_params(hw, sustained_compute=0.9), [small_case], network)["small"]
    assert faster < truth  # the parameter moves the simulated step
    case = dataclasses.replace(small_case, measured_step_s=truth)
    assert steps.fit_step_times(hw, [case], network) == pytest.approx({"sustained_compute": 0.6}, abs=0.002)
    with pytest.raises(ValueError, match="at most half"):
        steps.fit_steps(hw, [case], network, fit_rows=["small"])


@pytest.mark.slow
def test_step_time_fit_reproduces_the_file_and_holds_out_the_odd_rows(reference):
    """The stored H100 sustained_compute is the fit on the Megatron-Core table's even rows (needs the
    workflow's traces of those rows: snakemake results/dedup/mcore-h100-gpt-*/rank_classes.parquet)."""
    results = REPO / paths.RESULTS
    traces = {w: (Path(paths.TRACE(workload=w, results=results)),
                  Path(paths.DEDUP("rank_classes.parquet", workload=w, results=results)))
              for w in fit.step_workloads(steps.STEP_HARDWARE)}
    try:
        cases = steps.step_cases(traces, config_dir=REPO / "config")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    network_json = Path(paths.CALIBRATE("network.json", topology=steps.STEP_TOPOLOGY, results=results))
    hw, _ = cal.fit_gemm(load_hardware(steps.STEP_HARDWARE))
    report = steps.fit_steps(hw, cases, network_model(steps.STEP_TOPOLOGY, network_json if network_json.is_file() else None))
    print("\n".join(steps.step_lines(report.rows)))
    # a trace, network model or simulator change moves the fit: re-run `make fit` and update the file
    # (value, provenance and fitted_by.code)
    assert report.fitted["sustained_compute"] == pytest.approx(hw.compute_model.sustained_compute, abs=0.005)
    assert report.split["fit"] == ["7.1B", "32B", "119B", "314B"]
    assert len(report.split["held_out"]) == 5
    held = [abs(r["error_pct"]) for r in report.rows if r["split"] == "held-out"]
    assert sum(held) / len(held) < 15


# --- the fit's report and the files ---------------------------------------------------------------
def test_fit_of_a_gpu_without_layer_measurements_reports_values_inputs_and_code():
    doc = json.loads(json.dumps(fit.fit_hardware("b200-sxm", "0123456789ab")))  # as the rule writes it
    assert doc["code"] == "0123456789ab" and doc["hardware"] == "b200-sxm"
    assert abs(doc["gemm"]["error_pct"]) < 5
    assert math.isclose(doc["fitted"]["matmul_efficiency"], load_hardware("b200-sxm").compute_model.matmul_efficiency,
                        abs_tol=2e-4)
    assert doc["params"]["matmul_efficiency"] == doc["fitted"]["matmul_efficiency"]
    # what it read: the hardware file without what the fit gives (so writing the values back does
    # not re-run it), and the reference table it reproduced
    config = doc["inputs"]["config"]["hardware"]["compute_model"]
    assert "matmul_efficiency" not in config and "fitted_by" not in config and config["hbm_efficiency"] == 0.886
    assert doc["inputs"]["reference"].keys() <= {"hardware.csv"}


@pytest.mark.parametrize("name", GPUS)
def test_every_gpu_file_says_what_is_fitted_and_what_is_assumed(name):
    cm = load_hardware(name).compute_model
    params = {"matmul_efficiency", "sustained_compute", "hbm_efficiency", "kernel_launch_us", "sm_count"}
    assert set(cm.provenance) == params
    # the burst rate a job sustains: fitted on H100 step times (the only GPU with such a table here)
    expected_sustained = {steps.STEP_HARDWARE: "fitted", "h200-sxm-141gb": "transferred"}.get(name, "assumed")
    assert cm.provenance["sustained_compute"].status == expected_sustained
    assert cm.provenance["kernel_launch_us"].status == "assumed"
    expected_hbm = "fitted" if name == cal.KORTHIKANTI_HARDWARE else "transferred"
    assert cm.provenance["hbm_efficiency"].status == expected_hbm
    if expected_hbm == "transferred":  # carried over from the A100 fit, as said
        assert cm.hbm_efficiency == load_hardware(cal.KORTHIKANTI_HARDWARE).compute_model.hbm_efficiency
    if expected_sustained == "transferred":
        assert cm.sustained_compute == load_hardware(steps.STEP_HARDWARE).compute_model.sustained_compute
    assert cm.fitted_by.parameters == fit.fitted_parameters(name)
    assert cm.fitted_by.fit == paths.fit(name)


def test_no_shipped_fit_is_stale():
    """Each hardware file's fitted values came from today's fit code. When this fails, the fit's
    code (or what it imports: tracer, profile, network model, simulator) changed: run `make fit`,
    then copy each results/fit/<hardware>.json's values (with their provenance) and code into the
    file. A test above re-fits the A100 from scratch, and the H100 where its traces exist."""
    assert fit.stale_fits(code_version("fit")) == []


def test_a_stale_or_mismatched_fit_is_reported(config_root: Path):
    path = config_root / "hardware" / "b200-sxm.yaml"

    def stale_b200() -> list[str]:
        return [line for line in fit.stale_fits(code_version("fit"), config_root) if line.startswith(str(path))]

    edit_yaml(path, **{"compute_model.fitted_by.code": "0" * 12})
    assert "fitted by fit code 000000000000" in stale_b200()[0]
    assert [line.split(":")[0] for line in fit.stale_fits("1" * 12, config_root)] == \
        [str(config_root / "hardware" / f"{g}.yaml") for g in GPUS]  # every fitted file, against other code
    edit_yaml(path, **{"compute_model.fitted_by": None})
    with pytest.raises(ConfigError, match="provenance says fitted for .'matmul_efficiency'., fitted_by names ..") as err:
        load_hardware("b200-sxm", root=config_root)
    assert "compute_model" in str(err.value)
    edit_yaml(path, **{"compute_model.provenance.matmul_efficiency.status": "assumed"})
    assert "fitted_by names None" in stale_b200()[0]


def test_provenance_of_an_unknown_parameter_is_refused(config_root: Path):
    path = config_root / "hardware" / "a100-sxm-80gb.yaml"
    edit_yaml(path, **{"compute_model.provenance.matmul_eficiency": {"status": "assumed", "basis": "x"}})
    with pytest.raises(ConfigError) as err:
        load_hardware("a100-sxm-80gb", root=config_root)
    assert "matmul_eficiency" in str(err.value) and "compute_model" in str(err.value)
    edit_yaml(path, **{"compute_model.provenance.matmul_eficiency": None,
                       "compute_model.provenance.sm_count.status": "guessed"})
    with pytest.raises(ConfigError) as err:
        load_hardware("a100-sxm-80gb", root=config_root)
    assert "status" in str(err.value)
