"""Models given as Hugging Face configs (echo.config.hf, echo.training.hf): the shipped tiny
workloads of each architecture trace end to end under TP2 + SP, EP2 and PP2; a transformers Llama
and the built-in llama of the same shape trace the same FLOPs and collectives; bad input is
refused before tracing with file, key and reason."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pytest
import yaml

from echo.config import load_workload
from echo.config.loader import parse_workload
from echo.errors import ConfigError
from echo.io import read_parquet
from echo.trace.runner import check_traceable, run_trace

REPO = Path(__file__).resolve().parents[1]
TINY = ["tiny-hf-llama", "tiny-hf-deepseek-v3", "tiny-hf-qwen3-moe", "tiny-hf-mixtral", "tiny-hf-gpt-oss"]
LLAMA = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1024}


def _rank0(trace: Path, table: str):
    t = read_parquet(trace / f"{table}.parquet")
    return t.filter(pc.equal(t["rank"], 0)).to_pylist()


# tracing takes 5-10 s a workload: `make test-fast` keeps the parity and bad-input tests only
@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_tiny_config_of_each_architecture_traces(name, tmp_path):
    w = load_workload(name)
    assert w.model.arch == "hf" and w.parallel.tp == 2 and w.parallel.pp == 2
    run_trace(w, tmp_path)
    ops = read_parquet(tmp_path / "ops.parquet")
    comms = read_parquet(tmp_path / "comms.parquet").to_pylist()
    assert set(ops.column("rank").to_pylist()) == {0, 4}  # one rank per pipeline stage (the roles)
    kinds = Counter((c["op"], c["group_size"]) for c in comms if c["rank"] == 0)
    assert kinds[("all_gather", 2)] and kinds[("reduce_scatter", 2)]  # sequence parallelism
    # the fused attention kernel, not its unfused decomposition (MLA's v is padded to fit it)
    names = set(ops.column("name").to_pylist())
    assert any("flash_attention" in n for n in names) and "aten._safe_softmax.default" not in names
    if w.model.experts:
        a2a = [c for c in comms if c["op"] == "all_to_all"]
        # dispatch (tokens, and their routing weights) and combine, forward and backward, on
        # every MoE layer of the rank
        assert a2a and len(a2a) % 6 == 0
        assert {c["group_size"] for c in a2a} == {w.parallel.ep}


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hf_llama_traces_like_the_builtin_llama(tmp_path, sp):
    """Same shape through both definitions: equal matmul FLOPs per phase and equal collectives
    (counts and bytes) under TP2 x DP2, with sequence parallelism (where both gather the shard
    again in backward, as Megatron-LM) and without."""
    (tmp_path / "llama.json").write_text(json.dumps({**json.loads((REPO / "config/models/llama-3.1-8b.json").read_text()), **LLAMA}))
    models = {"hf": {"hf_config": str(tmp_path / "llama.json"), "seq_len": 256},
              "builtin": {"arch": "llama", "layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 512,
                          "vocab": 1024, "seq_len": 256}}
    seen = {}
    for name, model in models.items():
        w = parse_workload({"model": model, "parallel": {"tp": 2, "dp": 2, "sequence_parallel": sp},
                            "training": {"global_batch": 4, "micro_batch": 1}}, tmp_path / f"{name}.yaml")
        run_trace(w, tmp_path / name)
        flops = Counter()
        for op in _rank0(tmp_path / name, "ops"):
            flops[op["phase"]] += op["flops"]
        comms = Counter()
        for c in _rank0(tmp_path / name, "comms"):
            comms[(c["op"], c["group_kind"], c["bytes"])] += 1
        seen[name] = (flops, comms)
    assert seen["hf"][0]["forward"] > 0
    assert {k: v for k, v in seen["hf"][0].items() if v} == {k: v for k, v in seen["builtin"][0].items() if v}
    assert seen["hf"][1] == seen["builtin"][1]


def _workload(tmp_path: Path, config: dict, parallel: dict | None = None, **model):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(config))
    return parse_workload({"model": {"hf_config": str(path), "seq_len": 128, **model}, "parallel": parallel or {},
                           "training": {"global_batch": 4}}, tmp_path / "w.yaml")


def _llama(**changes) -> dict:
    return {**json.loads((REPO / "config/models/llama-3.1-8b.json").read_text()), **LLAMA, **changes}


def test_unknown_architecture_is_refused_before_tracing(tmp_path):
    w = _workload(tmp_path, _llama(model_type="not-a-model"))
    with pytest.raises(ConfigError, match="model.json.*model_type.*cannot build"):
        check_traceable(w)


def test_config_missing_a_key_is_refused(tmp_path):
    config = _llama()
    del config["num_attention_heads"]
    with pytest.raises(ConfigError, match="model.json.*num_attention_heads.*missing"):
        _workload(tmp_path, config)


def test_plan_that_does_not_divide_the_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="parallel.tp.*heads 8 is not divisible by tp 3"):
        _workload(tmp_path, _llama(), {"tp": 3})
    with pytest.raises(ConfigError, match="parallel.ep.*experts"):
        _workload(tmp_path, _llama(), {"dp": 2, "ep": 2})


def test_shape_keys_come_from_the_config_and_overrides_must_name_its_keys(tmp_path):
    with pytest.raises(ConfigError, match="model.layers.*comes from hf_config"):
        _workload(tmp_path, _llama(), layers=2)
    with pytest.raises(ConfigError, match="hf_overrides.num_layers.*not a key"):
        _workload(tmp_path, _llama(), hf_overrides={"num_layers": 2})
    w = _workload(tmp_path, _llama(), hf_overrides={"num_hidden_layers": 2})
    assert w.model.layers == 2 and w.model.hf_config["num_hidden_layers"] == 2
    with pytest.raises(ConfigError, match="hf_config.*no such file"):
        parse_workload({"model": {"hf_config": "config/models/none.json", "seq_len": 8}, "parallel": {},
                        "training": {"global_batch": 1}}, tmp_path / "w.yaml")


def test_shipped_configs_derive_their_shape(tmp_path):
    w = load_workload("tiny-hf-deepseek-v3")
    assert (w.model.experts, w.model.top_k, w.model.hidden) == (8, 2, 256)
    full = json.loads((REPO / "config/models/deepseek-v3.json").read_text())
    assert (full["n_routed_experts"], full["num_experts_per_tok"]) == (256, 8)


@pytest.mark.slow
def test_a_users_module_traces_with_tp_and_pp(tmp_path):
    w = load_workload("example-module")
    assert w.model.arch == "module" and len(w.model.module_digest) == 64
    run_trace(w, tmp_path)
    comms = Counter((c["op"], c["group_kind"]) for c in read_parquet(tmp_path / "comms.parquet").to_pylist())
    # TP2: an all-reduce after attention and after the MLP, forward and backward, per layer and rank
    assert comms[("all_reduce", "tp")] >= 2 * 2 * 2 and comms[("send", "pp")] and comms[("reduce_scatter", "dp")]


def test_a_users_module_is_checked_before_tracing(tmp_path):
    base = yaml.safe_load((REPO / "config/workloads/example-module.yaml").read_text())

    def workload(model=None, parallel=None):
        data = {**base, "model": {**base["model"], **(model or {})}, "parallel": {**base["parallel"], **(parallel or {})}}
        return parse_workload(data, tmp_path / "w.yaml")

    with pytest.raises(ConfigError, match="model.module.*no such file"):
        workload({"module": "examples/none.py:build"})
    with pytest.raises(ConfigError, match="tiny_model.py.*nope.*no such function"):
        check_traceable(workload({"module": "examples/tiny_model.py:nope"}))
    with pytest.raises(ConfigError, match="model.layers.*is 8, the module has 4"):
        check_traceable(workload({"layers": 8}))
    with pytest.raises(ConfigError, match="sequence_parallel.*user's module"):
        check_traceable(workload(parallel={"sequence_parallel": True}))


def _deepseek_forward_flops(hf: dict, s: int, tp: int, layers: range, first: bool, last: bool) -> float:
    """Matmul FLOPs of one rank's forward of one sequence, counted from the architecture: MLA's
    low-rank projections (down-projections replicated, up-projections and the output
    column/row-parallel), attention over the whole sequence (Echo's count: 4 b h s_q s_k d, MLA's
    v padded to the q/k head size), the dense MLP, and the MoE layer's router and routed experts on
    the rank's sequence shard (k rows per token after dispatch) and shared experts on the whole
    sequence (tensor-parallel)."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"] // tp
    qk, v, rope = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"], hf["qk_rope_head_dim"]
    t, t_local = s, s // tp
    mla = 2 * t * (h * hf["q_lora_rank"] + hf["q_lora_rank"] * heads * qk + h * (hf["kv_lora_rank"] + rope)
                   + hf["kv_lora_rank"] * heads * (hf["qk_nope_head_dim"] + v) + heads * v * h)
    mla += 4 * heads * s * s * qk
    f, k = hf["moe_intermediate_size"], hf["num_experts_per_tok"]
    moe = 2 * t_local * h * hf["n_routed_experts"] + 6 * t_local * k * h * f + 6 * t * h * f * hf["n_shared_experts"] // tp
    dense = 6 * t * h * hf["intermediate_size"] // tp
    total = sum(mla + (dense if i < hf["first_k_dense_replace"] else moe) for i in layers)
    return total + (2 * t * h * hf["vocab_size"] // tp if last else 0)


@pytest.mark.slow
def test_deepseek_traced_flops_equal_the_architectures_count(tmp_path):
    """MLA and MoE under TP2 + SP, EP2 and PP2: every rank's traced forward FLOPs are the analytic
    count within 1%, and its backward twice that (no recompute)."""
    w = load_workload("tiny-hf-deepseek-v3")
    run_trace(w, tmp_path)
    ops = read_parquet(tmp_path / "ops.parquet").to_pylist()
    for rank, pp_rank in ((0, 0), (4, 1)):
        layers = range(2 * pp_rank, 2 * pp_rank + 2)  # 4 layers over pp 2
        want = _deepseek_forward_flops(w.model.hf_config, w.model.seq_len, w.parallel.tp, layers,
                                       first=pp_rank == 0, last=pp_rank == 1)
        forward = sum(o["flops"] for o in ops if o["rank"] == rank and o["phase"] == "forward")
        backward = sum(o["flops"] for o in ops if o["rank"] == rank and o["phase"] == "backward")
        assert forward == pytest.approx(want, rel=0.01), rank
        assert backward == pytest.approx(2 * forward, rel=0.01), rank


@pytest.mark.slow
def test_llama_traced_flops_under_context_parallelism(tmp_path):
    """CP2 x TP2: each rank projects its half of the sequence and attends to the whole of it
    (all-gathered keys and values); its forward FLOPs are that count within 1%."""
    (tmp_path / "llama.json").write_text(json.dumps(_llama()))
    w = parse_workload({"model": {"hf_config": str(tmp_path / "llama.json"), "seq_len": 256},
                        "parallel": {"tp": 2, "cp": 2}, "training": {"global_batch": 1}}, tmp_path / "w.yaml")
    run_trace(w, tmp_path / "trace")
    h, heads, kv, d = 256, 8 // 2, 4 // 2, 32
    t, s = 256 // 2, 256
    layer = 2 * t * h * (heads * d + 2 * kv * d) + 2 * t * heads * d * h + 6 * t * h * 512 // 2 + 4 * heads * t * s * d
    want = 4 * layer + 2 * t * h * 1024 // 2
    ops = _rank0(tmp_path / "trace", "ops")
    assert sum(o["flops"] for o in ops if o["phase"] == "forward") == pytest.approx(want, rel=0.01)
    gathers = [c for c in _rank0(tmp_path / "trace", "comms") if c["group_kind"] == "cp"]
    assert len(gathers) >= 2 * 4  # keys and values of every layer
    # grouped-query attention: the key / value heads are gathered as they are (kv / tp = 2 heads of
    # the whole sequence, bf16), not repeated to the query heads first, as TE's context
    # parallelism exchanges them; forward repeats no K / V
    fwd = [c for c in gathers if c["op"] == "all_gather" and c["phase"] == "forward"]
    assert {c["bytes"] for c in fwd} == {1 * kv * s * d * 2}
    assert not any("repeat_interleave" in o["name"] or o["name"].startswith("aten.index_select")
                   for o in ops if o["phase"] == "forward")


@pytest.mark.slow
def test_expert_parallelism_wider_than_data_parallelism(tmp_path):
    """EP4 over TP2 x DP2 (ep > dp, as DeepSeek-V3's published layouts): the all-to-alls span the
    four ranks of the stage, each holds a quarter of the experts, none shares its experts."""
    d = yaml.safe_load((REPO / "config/workloads/tiny-hf-deepseek-v3.yaml").read_text())
    d["parallel"] |= {"pp": 1, "ep": 4}
    w = parse_workload(d, tmp_path / "w.yaml")
    run_trace(w, tmp_path / "trace")
    comms = _rank0(tmp_path / "trace", "comms")
    assert {c["group_size"] for c in comms if c["op"] == "all_to_all"} == {4}
    assert not [c for c in comms if c["group_kind"] == "edp"]  # tp x dp / ep = 1: nothing to reduce


@pytest.mark.slow
def test_hf_llama_under_fsdp_with_tp(tmp_path):
    """ZeRO 3 (FSDP2) over dp with TP2: every decoder layer is an FSDP unit, all-gathered in forward
    and backward and reduce-scattered in backward."""
    d = yaml.safe_load((REPO / "config/workloads/tiny-hf-llama.yaml").read_text())
    d["parallel"] |= {"pp": 1, "zero": 3, "sequence_parallel": False}
    w = parse_workload(d, tmp_path / "w.yaml")
    run_trace(w, tmp_path / "trace")
    dp = Counter((c["op"], c["phase"]) for c in _rank0(tmp_path / "trace", "comms") if c["group_kind"] == "dp")
    layers = w.model.layers
    assert dp[("all_gather", "forward")] >= layers and dp[("all_gather", "backward")] >= layers
    assert dp[("reduce_scatter", "backward")] >= layers


@pytest.mark.slow
def test_fsdp_shards_over_data_and_context_parallel_ranks(tmp_path):
    """ZeRO 3 with CP2 x DP2 (torchtitan's dp_shard_cp): parameters are sharded over the four
    ranks that hold the same parameters, so the layers' gathers and reduce-scatters run over that
    group, and each rank keeps a quarter of the fp32 state."""
    d = yaml.safe_load((REPO / "config/workloads/tiny-hf-llama.yaml").read_text())
    d["parallel"] = {"tp": 1, "pp": 1, "dp": 2, "cp": 2, "zero": 3}
    w = parse_workload(d, tmp_path / "w.yaml")
    run_trace(w, tmp_path / "trace")
    comms = _rank0(tmp_path / "trace", "comms")
    shard = Counter((c["op"], c["phase"]) for c in comms if c["group_kind"] == "dpcp" and c["group_size"] == 4)
    assert shard[("all_gather", "forward")] >= w.model.layers and shard[("reduce_scatter", "backward")] >= w.model.layers
    assert not [c for c in comms if c["group_kind"] == "dp"]
    # 2,885,888 parameters (embedding and head 1024 x 256 each, 4 layers of 590,336, final norm),
    # fp32 gradients sharded four ways: one byte per parameter
    assert _rank0(tmp_path / "trace", "ranks")[0]["grad_bytes"] == 2_885_888


@pytest.mark.slow
def test_imbalanced_routing_loads_the_traced_rank_with_the_heaviest_experts(tmp_path):
    """A router histogram with one hot expert: under EP2 the traced rank holds the heavier half
    (11 of 15 units of load instead of 8 of 16), so its expert GEMMs do 11/15 / (1/2) = 1.47x the
    balanced work, one GEMM per expert."""
    d = yaml.safe_load((REPO / "config/workloads/tiny-hf-deepseek-v3.yaml").read_text())
    d["parallel"] |= {"pp": 1}
    flops = {}
    for name, load in (("balanced", None), ("hot", [8, 1, 1, 1, 1, 1, 1, 1])):
        model = {**d["model"], **({"expert_load": load} if load else {})}
        w = parse_workload({**d, "model": model}, tmp_path / f"{name}.yaml")
        run_trace(w, tmp_path / name)
        flops[name] = sum(o["flops"] for o in _rank0(tmp_path / name, "ops") if o["phase"] == "forward")
    hf = w.model.hf_config
    moe_layers = hf["num_hidden_layers"] - hf["first_k_dense_replace"]
    # balanced routed-expert FLOPs of the rank: its shard's tokens x top_k rows, three projections
    routed = moe_layers * 6 * (w.model.seq_len // 2) * hf["num_experts_per_tok"] * hf["hidden_size"] * hf["moe_intermediate_size"]
    assert flops["hot"] - flops["balanced"] == pytest.approx(((11 / 15) / (1 / 2) - 1) * routed, rel=0.02)


def test_expert_load_is_checked(tmp_path):
    d = yaml.safe_load((REPO / "config/workloads/tiny-hf-deepseek-v3.yaml").read_text())
    with pytest.raises(ConfigError, match="model.expert_load.*3 entries for 8 experts"):
        parse_workload({**d, "model": {**d["model"], "expert_load": [1, 2, 3]}}, tmp_path / "w.yaml")


def test_a_loaded_workload_reloads_from_its_dump(tmp_path):
    """Sweeps write a loaded workload back out (every key, unset ones as None) and load it again."""
    for name in ("tiny-hf-deepseek-v3", "example-module", "tiny-tp2"):
        w = load_workload(name)
        again = parse_workload({k: v for k, v in w.model_dump().items() if k != "name"}, tmp_path / f"{name}.yaml")
        assert again.model == w.model
