"""trace + dedup: FLOPs, collectives, p2p, memory and class hashes checked against hand counts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from echo.config.workload import Workload
from echo.dedup import AsymmetryError, rank_classes, verify
from echo.io import write_parquet
from echo.trace import trace_ranks
from echo.training.layout import Coords, Layout

B, S, H, L, V, HEADS = 2, 32, 64, 4, 256, 4


def workload(**parallel) -> Workload:
    return Workload.model_validate({
        "name": "t", "verify": 1,
        "model": {"arch": "gpt", "layers": L, "hidden": H, "heads": HEADS, "vocab": V, "seq_len": S},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 0, **parallel},
        "training": {"global_batch": 8 * parallel.get("dp", 1), "micro_batch": B, "dtype": "bf16"},
    })


def analytic_flops(layers: int, tp: int, embed_head: bool) -> float:
    """Megatron's count for fwd+bwd of one micro-batch: 72 B s l h^2 (1 + s/6h) + 6 B s h V."""
    body = 72 * B * S * layers * H * H * (1 + S / (6 * H))
    return (body + (6 * B * S * H * V if embed_head else 0)) / tp


@pytest.fixture(scope="module")
def tp_pp_dp(tmp_path_factory):
    w = workload(tp=2, pp=2, dp=2, zero=1)
    reps = sorted(Layout(w.parallel).representatives().values())
    # rank 7 is a stage-1 rank with tp 1 and dp 1: it must hash like the stage-1 representative
    return w, trace_ranks(w, reps + [7], tmp_path_factory.mktemp("trace"))


def _rank(tables, name, rank):
    t = tables[name]
    return t.filter(pc.equal(t["rank"], rank))


def test_layout_round_trip_and_groups():
    lay = Layout(workload(tp=2, pp=2, dp=2).parallel)
    assert [lay.rank(lay.coords(r)) for r in range(8)] == list(range(8))
    assert lay.coords(7) == Coords(pp=1, dp=1, cp=0, tp=1)
    assert lay.group(5, "tp") == [4, 5] and lay.group(5, "dp") == [5, 7] and lay.group(5, "pp") == [1, 5]
    assert lay.stage_peer(1, 1) == 5 and lay.stage_peer(5, 1) is None


def test_expert_parallelism_folds_over_tp_cp_dp():
    """Megatron-Core's layout: ep consecutive ranks of a stage share out the experts, and ep may
    exceed dp (DeepSeek-V3's TP2 x DP32 with EP64 has one expert group per stage)."""
    from echo.config.workload import ParallelConfig

    lay = Layout(ParallelConfig(tp=2, pp=2, dp=4, ep=2))
    assert lay.expert_group(9, "ep") == [8, 9] and lay.expert_group(9, "edp") == [9, 11, 13, 15]
    wide = Layout(ParallelConfig(tp=2, pp=2, dp=32, ep=64))
    assert wide.expert_group(70, "ep") == list(range(64, 128)) and wide.expert_group(70, "edp") == [70]


def test_per_rank_flops_equal_the_analytic_count(tp_pp_dp):
    _, tables = tp_pp_dp
    for rank in (0, 4):  # stage 0 holds the embedding, stage 1 the LM head; both half the layers
        ops = _rank(tables, "ops", rank)
        fwd_bwd = pc.sum(ops.filter(pc.is_in(ops["phase"], pa.array(["forward", "backward"])))["flops"]).as_py()
        # the LM head's 6BshV/tp sits on the last stage only
        assert fwd_bwd == pytest.approx(analytic_flops(L // 2, 2, rank == 4), rel=1e-9)


def test_tensor_parallel_all_reduces_per_layer(tp_pp_dp):
    _, tables = tp_pp_dp
    comms = _rank(tables, "comms", 0)
    tp = comms.filter(pc.equal(comms["group_kind"], "tp"))
    activation = B * S * H * 2  # bf16
    fwd = tp.filter(pc.and_(pc.equal(tp["phase"], "forward"), pc.equal(tp["bytes"], activation)))
    bwd = tp.filter(pc.and_(pc.equal(tp["phase"], "backward"), pc.equal(tp["bytes"], activation)))
    # 2 per layer (after attention, after the MLP) + the vocabulary-parallel embedding in forward;
    # 2 per layer (into QKV and fc1) in backward
    assert fwd.num_rows == 2 * (L // 2) + 1
    assert bwd.num_rows == 2 * (L // 2)
    assert set(tp["op"].to_pylist()) == {"all_reduce"} and set(tp["group_size"].to_pylist()) == {2}
    assert all(tp["blocking"].to_pylist())


def test_zero1_reduce_scatters_grads_and_all_gathers_params(tp_pp_dp):
    _, tables = tp_pp_dp
    ranks = tables["ranks"].to_pylist()
    for rank in (0, 4):
        comms = _rank(tables, "comms", rank)
        dp = comms.filter(pc.equal(comms["group_kind"], "dp"))
        numel = next(r["param_bytes"] for r in ranks if r["rank"] == rank) // 2  # bf16 params
        rs = dp.filter(pc.equal(dp["op"], "reduce_scatter"))
        ag = dp.filter(pc.equal(dp["op"], "all_gather"))
        # one small bucket: fp32 gradients in, bf16 parameters back, padded to a multiple of dp
        assert rs.num_rows == 1 and ag.num_rows == 1
        assert rs["bytes"][0].as_py() == 4 * (numel + numel % 2)
        assert ag["bytes"][0].as_py() == 2 * (numel + numel % 2)
        assert set(rs["phase"].to_pylist()) == {"grad_sync"} and not rs["blocking"][0].as_py()


def test_bf16_gradient_buffers_halve_the_reduce_scatter(tmp_path):
    """training.grad_reduce_in_fp32 off: the buckets and their reduce-scatter in bf16, the
    optimizer casting its shard to fp32 before Adam."""
    w = Workload.model_validate({**workload(dp=2, zero=1).model_dump(), "training": {
        "global_batch": 16, "micro_batch": B, "dtype": "bf16", "grad_reduce_in_fp32": False}})
    tables = trace_ranks(w, [0], tmp_path)
    comms, ops, rank = tables["comms"], tables["ops"], tables["ranks"].to_pylist()[0]
    numel = rank["param_bytes"] // 2
    rs = comms.filter(pc.equal(comms["op"], "reduce_scatter"))
    assert rs.num_rows == 1 and rs["bytes"][0].as_py() == 2 * (numel + numel % 2)
    assert rank["grad_bytes"] == 2 * numel
    opt = ops.filter(pc.equal(ops["phase"], "optimizer"))
    assert any(n.startswith("aten.copy_") for n in opt["name"].to_pylist())


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_cross_entropy_keeps_no_fp32_logits(tmp_path, tp):
    """training.cross_entropy_fusion: one echo::cross_entropy kernel over the bf16 logits (with
    Megatron's two small all-reduces over TP when vocabulary-parallel) instead of the loss on an
    fp32 copy; the step's peak drops by at least that copy (tokens x vocab / tp x 4 B)."""
    def traced(fused):
        w = Workload.model_validate({**workload(tp=tp).model_dump(), "training": {
            "global_batch": 8, "micro_batch": B, "dtype": "bf16", "cross_entropy_fusion": fused}})
        return trace_ranks(w, [0], tmp_path / str(fused))
    plain, fused = traced(False), traced(True)
    names = fused["ops"]["name"].to_pylist()
    assert sum(n.startswith("echo.cross_entropy") for n in names) == 1
    assert not any(n.startswith("echo.cross_entropy") for n in plain["ops"]["name"].to_pylist())
    small = [c for c in fused["comms"].to_pylist() if c["group_kind"] == "tp" and c["bytes"] <= B * S * 8]
    assert len(small) == (2 if tp > 1 else 0)
    peak = {k: t["ranks"].to_pylist()[0]["peak_bytes_per_microbatch"] for k, t in (("plain", plain), ("fused", fused))}
    assert peak["plain"] - peak["fused"] >= B * S * V // tp * 4


def test_a_steps_collectives_are_megatrons(tp_pp_dp):
    """Every collective rank 0 of TP2 x PP2 x DP2 (ZeRO 1, no sequence parallelism) runs in one
    step, with its bytes, as Megatron-Core runs them: per layer two TP all-reduces in forward and
    two in backward (plus the vocabulary-parallel embedding's), the pipeline's send and recv, one
    fp32 reduce-scatter per gradient bucket, the gradient norm's fp32 all-reduce over all 8 ranks,
    one parameter all-gather per bucket."""
    _, tables = tp_pp_dp
    comms = _rank(tables, "comms", 0).to_pylist()
    numel = next(r["param_bytes"] for r in tables["ranks"].to_pylist() if r["rank"] == 0) // 2
    act, padded = B * S * H * 2, numel + numel % 2
    got = sorted((c["phase"], c["op"], c["group_kind"], c["group_size"], c["bytes"]) for c in comms)
    want = sorted([("forward", "all_reduce", "tp", 2, act)] * (2 * (L // 2) + 1)
                  + [("backward", "all_reduce", "tp", 2, act)] * (2 * (L // 2))
                  + [("forward", "send", "pp", 2, act), ("backward", "recv", "pp", 2, act)]
                  + [("grad_sync", "reduce_scatter", "dp", 2, 4 * padded)]
                  + [("optimizer", "all_reduce", "world", 8, 4)]
                  + [("optimizer", "all_gather", "dp", 2, 2 * padded)])
    assert got == want


def test_pipeline_p2p_peers_and_sizes(tp_pp_dp):
    _, tables = tp_pp_dp
    first, last = _rank(tables, "comms", 0), _rank(tables, "comms", 4)
    def p2p(t):
        return [(r["op"], r["phase"], r["peer"], r["bytes"]) for r in t.to_pylist() if r["group_kind"] == "pp"]
    act = B * S * H * 2
    assert p2p(first) == [("send", "forward", 4, act), ("recv", "backward", 4, act)]
    assert p2p(last) == [("recv", "forward", 0, act), ("send", "backward", 0, act)]


def test_memory_model(tp_pp_dp):
    _, tables = tp_pp_dp
    r0 = next(r for r in tables["ranks"].to_pylist() if r["rank"] == 0)
    numel = r0["param_bytes"] // 2
    assert r0["grad_bytes"] == 4 * numel                         # fp32 gradient buffer
    assert r0["optimizer_bytes"] == (4 + 8) * numel // 2         # master + Adam moments over dp 2
    # saved activations of one layer without recompute, bf16, tp 2, no attention matrix (flash):
    # ln1 in/out 2bsh*2, qkv out 3bsh/t*2, attention out + proj in 2*bsh/t*2, ln2 in/out 2bsh*2,
    # fc1 out and gelu out 2*4bsh/t*2  ->  about 17 bsh bytes per layer for t = 2
    per_layer = r0["activation_bytes_per_microbatch"] / (L // 2)
    assert 14 * B * S * H < per_layer < 22 * B * S * H


def test_dedup_classes_cover_the_world_and_ignore_rank_ids(tp_pp_dp, tmp_path):
    w, tables = tp_pp_dp
    reps = tables["ranks"].filter(pc.is_in(tables["ranks"]["rank"], pa.array([0, 4])))
    classes = rank_classes(w, reps)
    assert classes.num_rows == 8
    assert classes["class_id"].to_pylist() == [0, 0, 0, 0, 1, 1, 1, 1]
    hashes = {r["rank"]: r["graph_hash"] for r in tables["ranks"].to_pylist()}
    assert hashes[7] == hashes[4] != hashes[0]


def test_verify_catches_a_planted_asymmetry(tp_pp_dp, tmp_path):
    w, tables = tp_pp_dp
    reps = tables["ranks"].filter(pc.is_in(tables["ranks"]["rank"], pa.array([0, 4])))
    write_parquet(reps, tmp_path / "ranks.parquet")
    classes = rank_classes(w, reps)
    checked = verify(w, classes, tmp_path, 1)
    assert len(checked) == 1
    planted = classes.set_column(classes.schema.get_field_index("graph_hash"), "graph_hash",
                                 pa.array(["planted"] * classes.num_rows))
    with pytest.raises(AsymmetryError, match="do not run the same graph"):
        verify(w, planted, tmp_path, 1)


def test_unsupported_options_are_refused_before_tracing():
    from echo.errors import ConfigError
    from echo.trace import check_traceable

    moe = llama_workload(dp=2, zero=3).model_dump()
    moe["model"] |= {"experts": 4, "top_k": 2}
    with pytest.raises(ConfigError, match="parallel.zero"):
        check_traceable(Workload.model_validate(moe))
    with pytest.raises(ConfigError, match="model.kv_heads"):
        check_traceable(llama_workload(tp=4))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_replays_forward_ops_in_backward(recompute, tmp_path):
    d = workload(tp=2).model_dump()
    d["training"]["recompute"] = recompute
    w = Workload.model_validate(d)
    tables = trace_ranks(w, [0], tmp_path)
    ops, comms = tables["ops"], tables["comms"]
    re = ops.filter(pc.equal(ops["phase"], "recompute"))
    per_layer_attention = 4 * B * (HEADS // 2) * S * S * (H // HEADS)
    if recompute == "selective":  # the attention core only: no GEMMs, no collectives
        assert pc.sum(re["flops"]).as_py() == per_layer_attention * L
        assert set(re["op_class"].to_pylist()) == {"attention"}
    else:  # every layer's forward again, with its two TP all-reduces
        assert pc.sum(re["flops"]).as_py() == pytest.approx(analytic_flops(L, 2, False) / 3, rel=1e-9)
        assert pc.sum(pc.equal(comms["phase"], "recompute")).as_py() == 2 * L


def test_sequence_parallel_turns_all_reduces_into_gather_and_scatter(tmp_path):
    w = workload(tp=2, pp=2, sequence_parallel=True)
    tables = trace_ranks(w, [0], tmp_path)
    comms, layers = tables["comms"], L // 2
    activation = B * S * H * 2  # bf16, whole sequence: nccl-tests counts gather output / scatter input

    def count(op, phase):
        return sum(1 for r in comms.to_pylist()
                   if (r["op"], r["phase"], r["group_kind"], r["bytes"]) == (op, phase, "tp", activation))

    # per layer: all-gather before QKV and fc1, reduce-scatter after proj and fc2; + the embedding
    assert count("all_gather", "forward") == 2 * layers
    assert count("reduce_scatter", "forward") == 2 * layers + 1
    assert count("all_gather", "backward") == 2 * layers + 1
    assert count("reduce_scatter", "backward") == 2 * layers
    assert not any(r["op"] == "all_reduce" and r["phase"] in ("forward", "backward") for r in comms.to_pylist())
    # stages exchange their sequence shard
    p2p = [r["bytes"] for r in comms.to_pylist() if r["group_kind"] == "pp"]
    assert p2p == [activation // 2, activation // 2]
    # norm weights + biases (2 per layer) and the position embedding saw 1/tp of the sequence:
    # their gradients are all-reduced over tp once per step
    norm = [r for r in comms.to_pylist() if r["phase"] == "grad_sync" and r["group_kind"] == "tp"]
    assert [r["bytes"] for r in norm] == [4 * (layers * 4 * H + S * H)]


def llama_workload(**parallel) -> Workload:
    d = workload(**parallel).model_dump()
    d["model"] |= {"arch": "llama", "kv_heads": 2, "ffn_hidden": 160}
    return Workload.model_validate(d)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_llama_flops_and_tp_collectives(sequence_parallel, tmp_path):
    tp, kv, ffn, d = 2, 2, 160, H // HEADS
    w = llama_workload(tp=tp, sequence_parallel=sequence_parallel)
    tables = trace_ranks(w, [0], tmp_path)
    ops, comms = tables["ops"], tables["comms"]
    # per layer forward: q and o projections 2*2bsh^2, k and v 2*2bsh*kv*d (GQA),
    # SwiGLU 3*2bsh*ffn, attention 4bs^2h; backward twice that; the LM head 6bshV
    per_layer = 2 * B * S * (2 * H * H + 2 * H * kv * d + 3 * H * ffn) + 4 * B * S * S * H
    expected = (3 * L * per_layer + 6 * B * S * H * V) / tp
    assert pc.sum(ops["flops"]).as_py() == pytest.approx(expected, rel=1e-9)
    ops_by_kind = {r["op"] for r in comms.to_pylist() if r["group_kind"] == "tp" and r["phase"] == "forward"}
    assert ops_by_kind == ({"all_gather", "reduce_scatter", "all_reduce"} if sequence_parallel else {"all_reduce"})
    # no position embedding: RoPE is elementwise work inside attention
    forward = ops.filter(pc.equal(ops["phase"], "forward"))["name"].to_pylist()
    assert forward.count("aten.embedding.default") == 1


def test_zero3_gathers_each_layer_twice_and_reduce_scatters_it_once(tmp_path):
    # pp 1: under pipelining FSDP2 keeps the stage gathered all step (torchtitan), which changes
    # what the rank holds (tests/test_memory_model.py)
    w = workload(tp=2, pp=1, dp=2, zero=3)
    tables = trace_ranks(w, [0], tmp_path)
    dp = [r for r in tables["comms"].to_pylist() if r["group_kind"] == "dp"]
    layers = L
    # one block's local parameters under tp 2: qkv, proj, fc1, fc2 (+ biases) and two norms
    block = (3 * H * H + H * H + 4 * H * H + 4 * H * H) // 2 + (3 * H + 4 * H) // 2 + 2 * H + 4 * H
    gathers = [(r["phase"], r["bytes"]) for r in dp if r["op"] == "all_gather"]
    scatters = [(r["phase"], r["bytes"]) for r in dp if r["op"] == "reduce_scatter"]
    # bf16 gathers (nccl-tests size = whole output), fp32 gradient reduce-scatters (whole input)
    assert gathers.count(("forward", 2 * block)) == layers
    assert gathers.count(("backward", 2 * block)) == layers
    assert scatters.count(("backward", 4 * block)) == layers
    assert not any(r["phase"] == "grad_sync" for r in dp)  # FSDP reduced them inside backward
    assert all(not r["blocking"] and pc.equal(pa.scalar(r["group_size"]), 2).as_py() for r in dp)
    r0 = tables["ranks"].to_pylist()[0]
    assert r0["grad_bytes"] * 2 == r0["optimizer_bytes"]  # fp32 sharded grads, two fp32 moments


def test_moe_dispatch_combine_and_expert_gradients(tmp_path):
    d = llama_workload(tp=2, dp=4, ep=2, sequence_parallel=True, zero=1).model_dump()
    experts, top_k, ffn = 4, 2, 96
    d["model"] |= {"experts": experts, "top_k": top_k, "ffn_hidden": ffn}
    w = Workload.model_validate(d)
    tables = trace_ranks(w, [0], tmp_path)
    comms, ops = tables["comms"].to_pylist(), tables["ops"]
    tokens = B * S // 2  # the rank's sequence-parallel shard
    routed = tokens * top_k * H * 2  # bf16 copies of tokens, one per chosen expert
    a2a = [(r["phase"], r["bytes"], r["group_size"]) for r in comms if r["op"] == "all_to_all"]
    # dispatch + combine per layer, mirrored in backward, over the expert-parallel group of 2:
    # folded over tp x dp as Megatron-Core does, it is the rank and its TP peer (distinct shards)
    assert a2a.count(("forward", routed, 2)) == 2 * L and a2a.count(("backward", routed, 2)) == 2 * L
    ep_group = {tuple(r["group"]) for r in comms if r["op"] == "all_to_all"}
    assert ep_group == {tuple(next(r["group"] for r in comms if r["group_kind"] == "tp"))}
    # balanced routing: the local experts' grouped GEMMs run tokens*top_k rows through 3 projections
    bmm = ops.filter(pc.equal(ops["name"], "aten.bmm.default"))
    assert pc.sum(bmm["flops"]).as_py() == 3 * L * 3 * 2 * tokens * top_k * H * ffn
    # expert gradients reduce over the ranks holding the same experts (tp x dp / ep = 4), dense over dp
    kinds = {(r["group_kind"], r["group_size"]) for r in comms if r["phase"] == "grad_sync" and r["op"] == "reduce_scatter"}
    assert kinds == {("dp", 4), ("edp", 4)}
    expert_grads = next(r["bytes"] for r in comms if r["group_kind"] == "edp" and r["op"] == "reduce_scatter")
    assert expert_grads == 4 * L * (experts // 2) * 3 * H * ffn


def test_context_parallel_splits_the_sequence_and_exchanges_kv(tmp_path):
    w = workload(cp=2, dp=2, pp=2, zero=1)
    tables = trace_ranks(w, [0], tmp_path)
    comms, ops = tables["comms"].to_pylist(), tables["ops"]
    layers = L // 2
    kv = B * S * H * 2  # keys (or values) of the whole sequence, bf16: the all-gather's output
    cp = [(r["op"], r["phase"], r["bytes"]) for r in comms if r["group_kind"] == "cp"]
    assert cp.count(("all_gather", "forward", kv)) == 2 * layers
    assert cp.count(("reduce_scatter", "backward", kv)) == 2 * layers
    # each cp rank does half of the work of the whole sequence
    fwd_bwd = pc.sum(ops.filter(pc.is_in(ops["phase"], pa.array(["forward", "backward"])))["flops"]).as_py()
    assert fwd_bwd == pytest.approx(analytic_flops(layers, 2, False), rel=1e-9)
    # stages exchange half a sequence; gradients reduce over the 4 ranks that hold these parameters
    assert [r["bytes"] for r in comms if r["group_kind"] == "pp"] == [B * S * H, B * S * H]
    assert {r["group_size"] for r in comms if r["phase"] == "grad_sync"} == {4}


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_schedule_table_follows_the_schedule_definition(schedule, virtual, tmp_path):
    from echo.simulate.schedule_table import schedule_table
    from echo.training.schedule import stage_orders

    d = workload(pp=2, schedule=schedule, virtual_stages=virtual).model_dump()
    d["training"]["global_batch"] = 3 * B if virtual == 1 else 4 * B  # 3 (or 4) micro-batches
    w = Workload.model_validate(d)
    orders = stage_orders(schedule, 2, w.micro_batches, virtual)
    table = schedule_table(w, trace_ranks(w, [0, 1], tmp_path)["comms"], orders).to_pylist()

    def seq(rank):
        return [(r["task"], r["microbatch"], r["chunk"], r["op"], r["peer"]) for r in table if r["rank"] == rank]

    if schedule == "1f1b":  # stage 0 warms up with p - 1 = 1 forward, stage 1 alternates at once
        assert seq(0) == [("F", 0, 0, "send", 1), ("F", 1, 0, "send", 1), ("B", 0, 0, "recv", 1),
                          ("F", 2, 0, "send", 1), ("B", 1, 0, "recv", 1), ("B", 2, 0, "recv", 1)]
        assert seq(1) == [("F", 0, 0, "recv", 0), ("B", 0, 0, "send", 0), ("F", 1, 0, "recv", 0),
                          ("B", 1, 0, "send", 0), ("F", 2, 0, "recv", 0), ("B", 2, 0, "send", 0)]
    elif schedule == "gpipe":
        assert [t[:2] for t in seq(0)] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    else:  # virtual stages 0..3 = (stage 0, chunk 0), (1, 0), (0, 1), (1, 1): the pipeline wraps once
        first = [t for t in seq(0) if t[0] == "F" and t[1] == 0]
        assert first == [("F", 0, 0, "send", 1), ("F", 0, 1, "recv", 1), ("F", 0, 1, "send", 1)]
        last = [t for t in seq(1) if t[0] == "F" and t[1] == 0]
        assert last == [("F", 0, 0, "recv", 0), ("F", 0, 0, "send", 0), ("F", 0, 1, "recv", 0)]


def test_graph_export_and_diff_of_zero1_vs_zero3(tmp_path):
    import networkx as nx

    from echo.dedup import run_dedup
    from echo.trace import run_trace
    from echo.trace.diff import diff
    from echo.trace.graph import class_graph, write_graph

    dirs = {}
    for zero in (1, 3):
        w = workload(dp=2, zero=zero)
        dirs[zero] = tmp_path / f"zero{zero}"
        run_trace(w, dirs[zero])
    d = workload(dp=2, zero=1).model_copy(update={"verify": 0})
    run_dedup(d, dirs[1], tmp_path / "classes.parquet")
    g = class_graph(dirs[1], tmp_path / "classes.parquet", 0)
    ops = pq.read_table(dirs[1] / "ops.parquet")
    assert g.number_of_nodes() == ops.num_rows and nx.is_directed_acyclic_graph(g)
    write_graph(g, tmp_path / "g.graphml", "graphml")
    assert nx.read_graphml(tmp_path / "g.graphml").number_of_nodes() == ops.num_rows
    rows = diff(dirs[1], dirs[3])
    gathers = [r for r in rows if r["what"] == "collective" and r["name"].startswith("all_gather dp")]
    # ZeRO 3 gathers every layer in forward and again in backward; ZeRO 1 once, after the step
    assert sum(r["count_b"] for r in gathers if r["phase"] == "forward") == L + 1
    assert sum(r["count_a"] for r in gathers if r["phase"] == "optimizer") == 1
    # the same through the command line, over a results folder laid out as the workflow writes it
    from echo.cli import main

    results = tmp_path / "results"
    for zero in (1, 3):
        (results / "trace").mkdir(parents=True, exist_ok=True)
        dirs[zero].rename(results / "trace" / f"z{zero}")
    (results / "dedup" / "z1").mkdir(parents=True)
    (tmp_path / "classes.parquet").rename(results / "dedup" / "z1" / "rank_classes.parquet")
    out = tmp_path / "g.dot"
    assert main(["graph", "--workload", "z1", "--class", "0", "--format", "dot", "--out", str(out),
                 "--results", str(results)]) == 0
    assert out.read_text().count(" -> ") == g.number_of_edges()
    assert main(["diff", "z1", "z3", "--results", str(results)]) == 0
    assert main(["graph", "--workload", "z3", "--class", "0", "--results", str(results)]) == 1  # no dedup yet


def test_dtensor_calls_flag_the_kernels_of_tensor_parallel_traces_only(tp_pp_dp, tmp_path):
    """Every DTensor-level call (the linears' view / t / addmm, ...) is charged to the next kernel,
    in its kernel key; a trace without tensor parallelism has none."""
    from echo.trace.hashing import dtensor_flags, kernel_key

    _, tables = tp_pp_dp
    plain = trace_ranks(workload(dp=2), [0], tmp_path)["ops"].to_pylist()
    assert sum(o["dtensor"] for o in plain) == 0
    assert all(o["kernel_key"] == kernel_key(o["name"], o["args"]) for o in plain)
    for rank in (0, 4):  # stage 0: embedding + 2 layers; stage 1: 2 layers + head and loss
        ops = _rank(tables, "ops", rank).to_pylist()
        kernels = [o for o in ops if o["kind"] in ("compute", "memcpy")]
        assert all(o["dtensor"] == 0 for o in ops if o["kind"] not in ("compute", "memcpy"))
        assert all(o["kernel_key"] == kernel_key(o["name"], o["args"], dtensor_flags(o["dtensor"])) for o in kernels)
        fwd = [o for o in kernels if o["phase"] == "forward"]
        # per layer 4 sharded linears, each at least view + t + addmm on DTensors, each giving a
        # kernel of its own (column-parallel: the addmm; row-parallel: the partial bias first)
        assert sum(o["dtensor"] for o in fwd) >= 3 * 4 * (L // 2)
        assert sum(o["dtensor"] > 0 for o in fwd) >= 4 * (L // 2)
        # backward runs through DTensor too; the optimizer works on local flat buffers
        assert sum(o["dtensor"] for o in kernels if o["phase"] == "backward") >= 3 * 4 * (L // 2)
        assert sum(o["dtensor"] for o in kernels if o["phase"] == "optimizer") == 0
