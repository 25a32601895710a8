"""DualPipeV (DeepSeek's DualPipe cut in half; deepseek-ai/DualPipe's dualpipev.py): its stage
orders, its bubble against the DualPipe README's formula, its memory, the config checks, and a
real MoE trace in both modes with its overlapped expert all-to-alls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_simulate import check_split
from test_simulate_modes import assert_same, traced
from test_simulate_overlap_flags import _simulate
from test_zero_bubble import pipeline_v

from echo.config import parse_workload
from echo.errors import ConfigError
from echo.simulate import EngineOptions, simulate
from echo.training.schedule import in_flight, orders_of, stage_orders, w_pending

LAYOUTS = [(2, 4), (2, 9), (4, 8), (4, 10), (8, 16), (8, 21)]


@pytest.mark.parametrize("n,m", LAYOUTS)
def test_orders_run_every_pass_once_in_dualpipes_steps(n, m):
    for r, order in enumerate(stage_orders("dualpipev", n, m, 2)):
        passes = sorted((t.kind, t.microbatch, t.chunk) for t in order if t.kind != "W")
        assert passes == sorted((k, i, c) for k in "FB" for i in range(m) for c in range(2))
        pos = {(t.kind, t.microbatch, t.chunk): i for i, t in enumerate(order)}
        for i in range(m):
            for c in range(2):
                assert pos[("F", i, c)] < pos[("B", i, c)]
                b = order[pos[("B", i, c)]]
                # a deferred W runs once, after its B; a whole backward has none
                assert (("W", i, c) in pos) != b.whole
                assert not b.whole and pos[("B", i, c)] < pos[("W", i, c)] or b.whole
        for kind in "FB":  # each chunk's passes in micro-batch order
            for c in range(2):
                mbs = [t.microbatch for t in order if t.kind == kind and t.chunk == c]
                assert mbs == sorted(mbs)
        # step 1: 2 (n - r - 1) chunk-0 forwards; step 2 starts the chunk-1 forwards
        lead = [(t.kind, t.chunk) for t in order[:2 * (n - r - 1) + 2]]
        assert lead == [("F", 0)] * (2 * (n - r - 1) + 1) + [("F", 1)]
        # the overlapped pairs (step 4 and 5): a forward and the whole backward of another micro-batch
        pairs = [(t, order[i + 1]) for i, t in enumerate(order) if t.combined]
        assert len(pairs) == 2 * (m - 2 * n + r + 1) + (n - r - 1) - (r == n - 1)
        assert all(b.kind == "B" and b.whole and (f.microbatch, f.chunk) != (b.microbatch, b.chunk) for f, b in pairs)
        assert w_pending(order) <= n  # the WeightGradStore never holds more than a stage's worth


@pytest.mark.parametrize("F,W", [(1.0, 1.0), (1.0, 0.5), (2.0, 0.5), (1.0, 0.25)])
@pytest.mark.parametrize("n,m", [(2, 4), (4, 10), (4, 20), (8, 16)])
def test_bubble_follows_the_dualpipe_formula(F, W, n, m):
    """DualPipe README: DualPipeV over PP = 2n stages on n devices idles (PP/2 - 1)(F&B + B - 3W)
    per device, B a whole backward (B_in + W) and F&B an overlapped pair (here F + B: no
    all-to-all to overlap). Its grid draws a chunk's forward and input gradient alike (F = B_in),
    as here; the bubble does not grow with the micro-batches."""
    b_in = F
    B = b_in + W
    bubble = (n - 1) * ((F + B) + B - 3 * W)
    r = simulate(pipeline_v(n, F, b_in, W), stage_orders("dualpipev", n, m, 2),
                 EngineOptions(post_validation=True, placement="v"))
    check_split(r)
    assert r.step_us == pytest.approx(2 * m * (F + b_in + W) + bubble)
    assert all(st.bubble_us == pytest.approx(bubble) for st in r.stages)


def test_a_hand_sized_case():
    """2 devices, 4 micro-batches, F = B_in = W = 1: a whole backward 2, a pair 3 (F + whole
    backward). By hand (DualPipe's semantics: a pair waits for both inputs and sends both outputs
    when done), device 0 runs F0 F1 F2 (chunk 0) F0 B0 W0 F1 (chunk 1) to 7, pair F3.c0 + B1.c1
    to 10, then waits for device 1's pair F2.c0 + B0.c1... outputs: [10, 11] and [16, 17]; device 1
    waits [0, 1] for its first input and [21, 22] for B3.c1's gradient. Each idles 2 and the step
    is 24 of work + 2: the formula's (n - 1)(3 + 2 - 3) = 2."""
    r = simulate(pipeline_v(2, 1.0, 1.0, 1.0), stage_orders("dualpipev", 2, 4, 2),
                 EngineOptions(post_validation=True, placement="v"))
    assert r.step_us == pytest.approx(26.0)
    assert [st.bubble_us for st in r.stages] == pytest.approx([2.0, 2.0])


@pytest.mark.parametrize("n,m", LAYOUTS)
def test_memory_is_dualpipes_pp_plus_one(n, m):
    """DualPipe README: DualPipeV holds PP + 1 chunks' activations per device (PP = 2n stages) at
    most: the last device (the V's turn, which runs its first pair unpaired) holds 2n + 1 chunk
    micro-batches at its peak, the others 2n (a pair's backward frees its chunk as its forward
    fills one)."""
    orders = stage_orders("dualpipev", n, m, 2)
    assert [in_flight(o) for o in orders] == [2 * n] * (n - 1) + [2 * n + 1]


def test_refusals():
    with pytest.raises(ValueError, match="2 x stages micro-batches"):
        stage_orders("dualpipev", 4, 7, 2)
    with pytest.raises(ValueError, match="two chunks"):
        stage_orders("dualpipev", 4, 8, 1)
    base = {"model": {"arch": "llama", "layers": 8, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
            "parallel": {"tp": 1, "pp": 2, "dp": 1, "zero": 1, "schedule": "dualpipev", "virtual_stages": 2},
            "training": {"global_batch": 4, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}
    w = parse_workload(base, Path("config/workloads/dpv.yaml"))
    assert w.parallel.placement == "v" and len(orders_of(w.parallel, w.micro_batches)) == 2
    for change, key in ((("training", "global_batch", 3), "training.global_batch"),
                        (("parallel", "virtual_stages", 1), "parallel.schedule")):
        spec = json.loads(json.dumps(base))
        spec[change[0]][change[1]] = change[2]
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_workload(spec, Path("config/workloads/dpv.yaml"))


@pytest.fixture(scope="module")
def moe_v_trace(tmp_path_factory):
    """A small MoE Llama traced for real in DualPipeV's V: PP2 x DP2, EP2, two chunks a rank."""
    return traced(tmp_path_factory.mktemp("dpv"), {
        "model": {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32,
                  "experts": 4, "top_k": 2},
        "parallel": {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "zero": 1, "schedule": "dualpipev", "virtual_stages": 2},
        "training": {"global_batch": 16, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}, "dpv-moe")


@pytest.mark.slow
def test_dualpipev_on_a_real_moe_trace(moe_v_trace):
    """Both modes agree; the pairs overlap their expert all-to-alls (issued on the ep stream, in the
    timeline and in the Perfetto trace's own thread), so less of them is exposed than when the same
    order runs unpaired; the bubble is ZB-V's order of size, not 1F1B's."""
    w, root = moe_v_trace
    out = {mode: _simulate(w, root, f"dpv-{mode}", mode=mode) for mode in ("symmetric", "full")}
    assert_same(out["symmetric"], out["full"])
    import pyarrow.parquet as pq

    timeline = pq.read_table(root / "dpv-symmetric" / "timeline.parquet").to_pylist()
    assert any(r["stream"] == "ep" for r in timeline)
    trace = json.loads((root / "dpv-symmetric" / "trace.json").read_text())
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert any("ep" in t for t in threads)
    zbv = w.model_copy(update={"parallel": w.parallel.model_copy(update={"schedule": "zb-v"})})
    other = _simulate(zbv, root, "zbv")
    assert out["symmetric"]["exposed_ep_s"] < other["exposed_ep_s"]
    assert out["symmetric"]["executed_flops"] == other["executed_flops"]
