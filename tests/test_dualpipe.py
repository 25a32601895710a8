"""DualPipeV (DeepSeek's DualPipe cut in half; deepseek-ai/DualPipe's dualpipev.py) and DualPipe
itself (micro-batches fed from both ends, dualpipe.py): their stage orders, their bubble against
the DualPipe README's formulas, their memory, the config checks, and real MoE traces in both modes
with their overlapped expert all-to-alls (DualPipe's: two copies of each stage, their gradients
summed over the pair of ranks)."""

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


@pytest.mark.parametrize("schedule,stages,m,chunks,reason", [
    ("dualpipev", 4, 7, 2, "2 x stages micro-batches"), ("dualpipev", 4, 8, 1, "two chunks"),
    ("dualpipe", 3, 8, 2, "even number of stages"), ("dualpipe", 4, 7, 2, "at least 2 x stages")])
def test_orders_refused(schedule, stages, m, chunks, reason):
    with pytest.raises(ValueError, match=reason):
        stage_orders(schedule, stages, m, chunks)


def test_refusals():
    base = two_chunk_workload("dualpipev")
    w = parse_workload(base, Path("config/workloads/dpv.yaml"))
    assert w.parallel.placement == "v" and len(orders_of(w.parallel, w.micro_batches)) == 2
    refused(base, {("training", "global_batch"): 3}, "training.global_batch")
    refused(base, {("parallel", "virtual_stages"): 1}, "parallel.schedule")


def two_chunk_workload(schedule: str) -> dict:
    """A small Llama on 2 pipeline ranks with two chunks each, 4 micro-batches, under ``schedule``."""
    return {"model": {"arch": "llama", "layers": 8, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
            "parallel": {"tp": 1, "pp": 2, "dp": 1, "zero": 1, "schedule": schedule, "virtual_stages": 2},
            "training": {"global_batch": 4, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}


def refused(base: dict, changes: dict, key: str) -> None:
    """``base`` with ``changes`` ((section, key) -> value) is refused, naming ``key``."""
    spec = json.loads(json.dumps(base))
    for (section, name), value in changes.items():
        spec[section][name] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_workload(spec, Path("config/workloads/refused.yaml"))


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


# --- DualPipe: micro-batches from both ends ---------------------------------------------------------

DUAL_LAYOUTS = [(2, 4), (2, 6), (4, 8), (4, 12), (8, 16), (8, 22)]


@pytest.mark.parametrize("n,m", DUAL_LAYOUTS)
def test_dualpipe_runs_each_half_of_the_batch_from_its_end(n, m):
    for r, order in enumerate(stage_orders("dualpipe", n, m, 2)):
        passes = sorted((t.kind, t.microbatch, t.chunk) for t in order if t.kind != "W")
        # the first half of the micro-batches only through chunk 0, the second only through chunk 1
        assert passes == sorted((k, i, int(i >= m // 2)) for k in "FB" for i in range(m))
        pos = {(t.kind, t.microbatch, t.chunk): i for i, t in enumerate(order)}
        for i in range(m):
            c = int(i >= m // 2)
            assert pos[("F", i, c)] < pos[("B", i, c)]
            assert (("W", i, c) in pos) != order[pos[("B", i, c)]].whole
        # step 1: the rank's first-half way (chunk 0 below the middle, chunk 1 above) warms up alone
        h, c0 = min(r, n - 1 - r), int(r >= n // 2)
        lead = [(t.kind, t.chunk) for t in order[:2 * (n // 2 - h - 1) + 2]]
        assert lead == [("F", c0)] * (2 * (n // 2 - h - 1) + 1) + [("F", 1 - c0)]
        pairs = [(t, order[i + 1]) for i, t in enumerate(order) if t.combined]
        assert all(b.kind == "B" and b.whole and (f.microbatch, f.chunk) != (b.microbatch, b.chunk) for f, b in pairs)


@pytest.mark.parametrize("F,W", [(1.0, 1.0), (1.0, 0.5), (2.0, 0.5), (1.0, 0.25)])
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 20), (8, 16), (8, 32)])
def test_dualpipe_bubble_follows_its_formula(F, W, n, m):
    """DeepSeek-V3 report, Table 2 (and the DualPipe README): DualPipe over PP ranks idles
    (PP/2 - 1)(F&B + B - 3W) per rank, B a whole backward (B_in + W), F&B an overlapped pair (here
    F + B: no all-to-all to overlap), the same for every rank and every batch; each rank runs m
    passes (half of the batch through each of its two chunks)."""
    b_in = F
    B = b_in + W
    bubble = (n // 2 - 1) * ((F + B) + B - 3 * W)
    r = simulate(pipeline_v(n, F, b_in, W, "dual"), stage_orders("dualpipe", n, m, 2),
                 EngineOptions(post_validation=True, placement="dual"))
    check_split(r)
    assert r.step_us == pytest.approx(m * (F + b_in + W) + bubble)
    assert all(st.bubble_us == pytest.approx(bubble) for st in r.stages)


@pytest.mark.parametrize("n,m", DUAL_LAYOUTS)
def test_dualpipe_memory_is_pp_plus_one(n, m):
    """DeepSeek-V3 report, Table 2: DualPipe holds PP + 1 stages' activations at most (the two
    middle ranks, where the ways cross and the first pair runs unpaired); the others PP. Its
    parameters are twice a stage's (checked on a real trace below)."""
    orders = stage_orders("dualpipe", n, m, 2)
    assert [in_flight(o) for o in orders] == [n + (r in (n // 2 - 1, n // 2)) for r in range(n)]


def test_dualpipe_refusals():
    base = two_chunk_workload("dualpipe")
    w = parse_workload(base, Path("config/workloads/dp.yaml"))
    assert w.parallel.placement == "dual" and w.parallel.model_stages == 2 and w.parallel.layers_of(8) == [4, 4]
    assert w.traced().parallel.schedule == "dualpipe"  # the two ways are traced
    refused(base, {("training", "global_batch"): 5}, "training.global_batch")  # an odd number of micro-batches
    # an odd pipeline, everything else valid
    refused(base, {("parallel", "pp"): 3, ("training", "global_batch"): 12, ("model", "layers"): 6}, "parallel.schedule")
    refused(base, {("parallel", "zero"): 3}, "parallel.zero")
    refused(base, {("parallel", "stage_layers"): [2, 2, 2, 2]}, "parallel.stage_layers")  # pp entries, not 2 pp


MOE = {"arch": "llama", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32, "experts": 4, "top_k": 2}


@pytest.fixture(scope="module")
def moe_dual_trace(tmp_path_factory):
    """The small MoE Llama traced for real under DualPipe: PP2 x DP2, EP2, two chunks a rank."""
    return traced(tmp_path_factory.mktemp("dp"), {
        "model": MOE,
        "parallel": {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "zero": 1, "schedule": "dualpipe", "virtual_stages": 2},
        "training": {"global_batch": 16, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}, "dp-moe")


@pytest.mark.slow
def test_dualpipe_on_a_real_moe_trace(moe_dual_trace, tmp_path):
    """Each rank holds both stages (twice 1F1B's parameters per rank: the two stages' together),
    its p2p goes both ways, the two copies' gradients are all-reduced over the pair of ranks
    (kind pp) before the data-parallel reduce-scatter; both modes agree and the pairs overlap their
    expert all-to-alls on the ep stream."""
    import pyarrow.parquet as pq

    w, root = moe_dual_trace
    comms = pq.read_table(root / "trace" / "comms.parquet").to_pylist()
    sync = {(c["rank"], c["op"], c["group_kind"], tuple(c["group"])) for c in comms if c["phase"] == "grad_sync"}
    assert {(0, "all_reduce", "pp", (0, 2)), (2, "all_reduce", "pp", (0, 2)), (0, "reduce_scatter", "dp", (0, 1))} <= sync
    # rank 0 (stage 0 on the way from rank 0, stage 1 on the way back) sends chunk 0's activations
    # to rank 2 and receives chunk 1's from it
    p2p = {(c["op"], c["phase"], c["chunk"]) for c in comms if c["rank"] == 0 and c["op"] in ("send", "recv")}
    assert {("send", "forward", 0), ("recv", "forward", 1), ("recv", "backward", 0), ("send", "backward", 1)} <= p2p
    one = traced(tmp_path, {"model": MOE, "parallel": {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "zero": 1},
                            "training": {"global_batch": 16, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}},
                 "1f1b-moe")[1]
    dual = {r["rank"]: r["param_bytes"] for r in pq.read_table(root / "trace" / "ranks.parquet").to_pylist()}
    single = {r["rank"]: r["param_bytes"] for r in pq.read_table(one / "trace" / "ranks.parquet").to_pylist()}
    assert dual[0] == dual[2] == single[0] + single[2]
    out = {mode: _simulate(w, root, f"dp-{mode}", mode=mode) for mode in ("symmetric", "full")}
    assert_same(out["symmetric"], out["full"])
    timeline = pq.read_table(root / "dp-symmetric" / "timeline.parquet").to_pylist()
    assert any(r["stream"] == "ep" for r in timeline)
