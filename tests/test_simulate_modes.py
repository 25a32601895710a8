"""Full mode (every rank replayed, collectives as rendezvous, p2p matched with its peer) against
symmetric mode (one timeline per pipeline stage), on synthetic traces and on a real one."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_simulate import HARDWARE, make_workload, run, topology

from echo.config import parse_workload
from echo.overlap import Slowdown
from echo.simulate import EngineOptions

SLOW = Slowdown({"gemm": 0.3, "optimizer": 0.6}, "test", 0.1)
SAME = ("step_time_s", "compute_s", "exposed_comm_s", "bubble_s", "slowdown_s", "exposed_tp_s", "exposed_dp_s",
        "exposed_pp_s", "executed_flops")


def both(tmp_path: Path, w, **kw) -> tuple[dict, dict]:
    sym = run(tmp_path, w, out="sym", **kw)
    full = run(tmp_path, w, out="full", mode="full", **kw)
    return sym, full


def assert_same(sym: dict, full: dict) -> None:
    for key in SAME:
        assert full[key] == pytest.approx(sym[key], rel=1e-9, abs=1e-15), key
    assert full["stage_step_time_s"] == pytest.approx(sym["stage_step_time_s"], rel=1e-9)
    assert full["critical_stage"] == sym["critical_stage"]
    assert (sym["mode"], full["mode"]) == ("symmetric", "full")


# (tp, pp, dp, schedule, virtual stages, global batch, gpus per node, overlap_grad_reduce, buckets)
LAYOUTS = [
    (2, 2, 2, "1f1b", 1, 8, 8, False, 1),
    (2, 2, 2, "1f1b", 1, 8, 2, True, 3),      # every transfer crosses nodes; buckets overlap backward
    (1, 4, 2, "gpipe", 1, 12, 4, False, 2),
    (2, 4, 2, "interleaved", 2, 16, 4, False, 1),
    (2, 4, 2, "interleaved", 3, 8, 4, True, 2),
    (4, 4, 4, "1f1b", 1, 32, 8, True, 4),     # 64 ranks
    (2, 8, 4, "1f1b", 1, 16, 8, False, 2),    # 64 ranks, middle stages in one class
    (1, 2, 32, "interleaved", 2, 64, 8, True, 2),  # 64 ranks, dp traffic across nodes
]


@pytest.mark.parametrize("tp,pp,dp,schedule,v,gb,gpn,overlap,buckets", LAYOUTS)
def test_full_mode_gives_the_symmetric_step(tmp_path, tp, pp, dp, schedule, v, gb, gpn, overlap, buckets):
    w = make_workload(tp=tp, pp=pp, dp=dp, schedule=schedule, v=v, global_batch=gb)
    sym, full = both(tmp_path, w, topo=topology(gpn), overlap=SLOW, buckets=buckets,
                     options=EngineOptions(overlap_grad_reduce=overlap), merge_middle=pp > 2)
    assert_same(sym, full)
    assert sym["slowdown_s"] > 0  # the comparison covers the overlap slowdown
    assert full["world_size"] == tp * pp * dp <= 64


def test_a_collective_waits_for_its_slowest_member(tmp_path):
    # TP2, one stage, 2 micro-batches; rank 1's kernels take twice as long. Each TP all-reduce
    # (10 us) starts when rank 1 arrives: forward all-reduce at 200 (rank 0 arrived at 100),
    # backward at 610 (rank 0 at 410); second micro-batch: 820 (720) and 1230 (1030). Then the
    # one-member dp reduce-scatter (30), adam (50 / 100) and all-gather (20): rank 1 ends at 1390,
    # rank 0 at 1340. Rank 0 waited 100 + 200 per micro-batch inside the all-reduces.
    w = make_workload(tp=2, pp=1, dp=1, global_batch=2)
    s = run(tmp_path, w, mode="full", compute_scale={1: 2.0}, out="full")
    assert s["step_time_s"] == pytest.approx(1390e-6) and s["critical_rank"] == 1
    timeline = pq.read_table(tmp_path / "full" / "timeline.parquet").to_pylist()
    ars = sorted((r["start_s"] * 1e6, r["rank"]) for r in timeline if r["name"] == "all_reduce tp")
    assert [t for t, _ in ars] == pytest.approx([200, 200, 610, 610, 820, 820, 1230, 1230])
    ends = {r["rank"]: r["end_s"] * 1e6 for r in timeline if r["kind"] == "optimizer"}
    assert ends == pytest.approx({0: 1340.0, 1: 1390.0})
    # symmetric mode (no straggler) and the straggler-free full mode agree; the straggler costs
    sym = run(tmp_path, w, out="sym")
    assert sym["step_time_s"] == pytest.approx(4 * 10e-6 + 2 * 300e-6 + 30e-6 + 50e-6 + 20e-6)
    # rank 0 is not the critical rank; its exposed tp time holds the waiting
    trace = json.loads((tmp_path / "full" / "trace.json").read_text())
    chains = [e for e in trace["traceEvents"] if e.get("cat") == "flow"]
    assert sum(1 for e in chains if e["ph"] == "s") == 4  # one flow per TP all-reduce (dp groups have one member)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 (class 0, pp stage 0)", "rank 1 (class 0, pp stage 0)"}


def test_full_mode_matches_p2p_with_peers(tmp_path):
    # PP2: every recv of stage 1 takes its stage-0 peer's send of the same tensor; in the Perfetto
    # trace each transfer is a flow from the sender's rank to the receiver's rank.
    w = make_workload(tp=1, pp=2, dp=2, global_batch=8)
    sym, full = both(tmp_path, w)
    assert_same(sym, full)
    trace = json.loads((tmp_path / "full" / "trace.json").read_text())
    pid_rank = {e["pid"]: int(e["args"]["name"].split()[1]) for e in trace["traceEvents"]
                if e["name"] == "process_name"}
    flows = [e for e in trace["traceEvents"] if e.get("cat") == "flow"]
    by_id: dict[int, list[dict]] = {}
    for e in flows:
        by_id.setdefault(e["id"], []).append(e)
    p2p = [sorted(v, key=lambda e: e["ph"] != "s") for v in by_id.values()
           if len(v) == 2 and {e["tid"] for e in v} & {4, 5}]
    assert len(p2p) == 2 * 2 * w.micro_batches  # 2 dp replicas x (forward + backward) per micro-batch
    for s, f in p2p:
        a, b = pid_rank[s["pid"]], pid_rank[f["pid"]]
        assert abs(a - b) == 2  # rank = dp + 2 * pp: the same dp replica on the other stage


def test_full_mode_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    from echo.config.limits import full_mode_estimate

    # 32,000 ranks in one data-parallel group: every collective's rendezvous visits 32,000 members
    # on each of 32,000 ranks, hours of replay (benchmarks/bench_full_mode.py measures the terms)
    w = make_workload(tp=1, pp=1, dp=32000, global_batch=32000)
    assert full_mode_estimate(w)["hours"] > 2.0
    with pytest.raises(ValueError, match=r"full mode replays every rank: .* 32,000 ranks .* h \(limits"):
        run(tmp_path, w, mode="full")
    # the same job at 8,000 ranks is admitted by the estimate, and a raised limit admits 32,000
    assert full_mode_estimate(make_workload(tp=1, pp=1, dp=8000, global_batch=8000))["hours"] < 2.0
    monkeypatch.setenv("ECHO_MAX_FULL_MODE_HOURS", "100")
    monkeypatch.setenv("ECHO_MAX_FULL_MODE_GIB", "64")
    from echo.config.limits import full_mode_refusal
    assert full_mode_refusal(w) is None


# --- a real trace --------------------------------------------------------------------------------


def traced(root: Path, spec: dict, name: str):
    """A small workload from ``spec`` traced for real into ``root`` (trace/), with its rank classes
    and kernels on HARDWARE: what run_simulate reads."""
    from echo.artifacts import RANK_CLASSES
    from echo.dedup import rank_classes
    from echo.io import write_parquet
    from echo.profile import run_profile
    from echo.trace import run_trace

    w = parse_workload(spec, Path(f"{name}.yaml"))
    run_trace(w, root / "trace")
    write_parquet(rank_classes(w, pq.read_table(root / "trace" / "ranks.parquet")), root / "rank_classes.parquet",
                  RANK_CLASSES)
    run_profile(HARDWARE, root / "trace", root / "kernels.parquet")
    return w, root


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    """A small GPT traced for real: TP2 PP2 DP2 (8 ranks), interleaved, 2 roles traced."""
    return traced(tmp_path_factory.mktemp("real"), {
        "model": {"arch": "gpt", "layers": 4, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 32},
        "parallel": {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "schedule": "interleaved", "virtual_stages": 2},
        "training": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "selective"}}, "real-8")


def test_full_mode_on_a_real_trace(real_trace):
    from echo.network import NetworkModel

    w, root = real_trace
    topo = topology(4)  # each pipeline stage on its own node: pp sends cross the NIC
    for overlap in (False, True):
        out = {}
        for mode in ("symmetric", "full"):
            from echo.simulate import run_simulate

            out[mode] = run_simulate(w, HARDWARE, topo, root / "trace", root / "rank_classes.parquet",
                                     root / "kernels.parquet", root, root / f"{mode}-{overlap}",
                                     network=NetworkModel(topo), overlap=SLOW, mode=mode,
                                     options=EngineOptions(overlap_grad_reduce=overlap)).to_pylist()[0]
        assert_same(out["symmetric"], out["full"])
        assert out["full"]["step_time_s"] > 0 and out["full"]["exposed_tp_s"] > 0
