"""Megatron-Core's module recompute (training.recompute_modules) and the routed experts' fused
weighted activation: numerics of the fused kernels, bytes kept for backward against hand-computed
figures, the recompute ops in the trace, bad input refused with its key, and the Megatron-Bridge
presets mapped onto it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch

from echo.config.loader import parse_workload
from echo.errors import ConfigError
from echo.trace.step import trace_rank
from echo.training import fused
from echo.validate.bridge import recompute_modules

REPO = Path(__file__).resolve().parents[1]
H, F, EXPERTS, TOP_K, SEQ, LAYERS = 256, 128, 8, 4, 256, 2
GPT_OSS = {"num_hidden_layers": LAYERS, "layer_types": ["sliding_attention", "full_attention"],
           "hidden_size": H, "intermediate_size": F, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 32, "num_local_experts": EXPERTS, "vocab_size": 1024}


def _workload(modules: list[str] | None, config: str = "gpt-oss-120b", overrides: dict = GPT_OSS,
              dispatcher: str = "alltoall"):
    training = {"global_batch": 2, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}
    if modules is not None:
        training |= {"recompute": "selective", "recompute_modules": modules}
    return parse_workload({"name": "rc", "model": {"hf_config": f"config/models/{config}.json", "seq_len": SEQ,
                                                   "hf_overrides": overrides},
                           "parallel": {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "zero": 1,
                                        "moe_dispatcher": dispatcher},
                           "training": training}, REPO / "config/workloads/rc.yaml")


@pytest.mark.parametrize("kind, args", [("swiglu", ()), ("clamped", (0.7, 1.702, 1.0))])
def test_weighted_glu_matches_its_reference_forward_and_backward(kind, args):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(2, 6, 1, dtype=torch.float64, requires_grad=True)
    y = fused.fused_weighted_glu(x, w, kind, *args)
    ref = fused._glu_reference(x, w, kind, *(args or (0.0, 1.0, 0.0)))
    g = torch.randn_like(y)
    assert torch.allclose(y, ref, atol=1e-6)
    for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(ref, (x, w), g), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def _saved(w) -> tuple[int, Counter]:
    out = trace_rank(w, 0)
    ops = out["ops"]
    recomputed = Counter(ops.filter(pc.equal(ops["phase"], "recompute"))["name"].to_pylist())
    return out["ranks"]["activation_bytes_per_microbatch"][0].as_py(), recomputed


def test_layernorm_and_moe_act_recompute_drop_their_outputs():
    """Per layer, layernorm recompute drops the two norm outputs (tokens x h bf16 each) and moe_act
    the experts' activation output (tokens x top_k routed rows x f bf16, balanced routing over
    ep 2: each rank's experts receive as many rows as it sends); backward recomputes each once."""
    base, none = _saved(_workload(None))
    tokens = SEQ
    norm, act = 2 * tokens * H * 2, tokens * TOP_K * F * 2
    assert not none
    saved, rc = _saved(_workload(["layernorm"]))
    assert base - saved == LAYERS * norm and rc == {"echo.rms_norm.default": 2 * LAYERS}
    saved, rc = _saved(_workload(["moe_act"]))
    assert base - saved == LAYERS * act and rc == {"echo.weighted_glu.default": LAYERS}
    saved, rc = _saved(_workload(["layernorm", "moe_act"]))
    assert base - saved == LAYERS * (norm + act)


DEEPSEEK = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": H, "intermediate_size": 2 * H,
            "moe_intermediate_size": F, "n_routed_experts": EXPERTS, "num_experts_per_tok": 2, "n_group": 1,
            "topk_group": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
            "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "vocab_size": 1024}


def test_mla_up_proj_recompute_keeps_the_latents_only():
    """mla_up_proj: Echo's MLA forward runs transformers' ops in forward (the same ops; both
    down-projections before the up-projections, as Megatron-Core orders them); the attention kernel's queries, keys and values (4 heads x (48 + 48 + 32) bf16 per
    token and layer; the values counted unpadded) are no longer kept, and backward runs the two
    up-projections again per layer."""
    def forward_ops(w):
        out = trace_rank(w, 0)
        ops = out["ops"]
        fwd = ops.filter(pc.equal(ops["phase"], "forward"))["name"].to_pylist()
        return out["ranks"]["activation_bytes_per_microbatch"][0].as_py(), fwd, ops
    base, fwd_base, _ = forward_ops(_workload(None, "deepseek-v3", DEEPSEEK))
    saved, fwd, ops = forward_ops(_workload(["mla_up_proj"], "deepseek-v3", DEEPSEEK))
    assert Counter(fwd) == Counter(fwd_base)
    assert base - saved == LAYERS * SEQ * 4 * (48 + 48 + 32) * 2
    recomputed = ops.filter(pc.equal(ops["phase"], "recompute"))["name"].to_pylist()
    assert Counter(recomputed)["aten.mm.default"] == 2 * LAYERS


def test_mlp_recompute_checkpoints_the_dense_mlps_only():
    """DeepSeek-V3 shrunk to one dense and one MoE layer: mlp recompute re-runs the dense MLP's
    three GEMMs in backward and keeps only its input (the norm output, which attention also
    reads); the MoE layer is untouched."""
    overrides = DEEPSEEK
    base, _ = _saved(_workload(None, "deepseek-v3", overrides))
    saved, rc = _saved(_workload(["mlp"], "deepseek-v3", overrides))
    # gate, up and the SwiGLU output ([tokens, 2H] each, bf16) are no longer kept
    assert base - saved == 3 * SEQ * 2 * H * 2
    assert rc["aten.mm.default"] == 3 and rc["echo.swiglu.default"] == 1


@pytest.mark.parametrize("training, key", [
    ({"recompute": "none", "recompute_modules": ["layernorm"]}, "training.recompute_modules"),
    ({"recompute": "selective", "recompute_modules": ["layernorm", "layernorm"]}, "training.recompute_modules"),
    ({"recompute": "selective", "recompute_modules": ["mla_up_proj"]}, "training.recompute_modules"),  # no MLA
    ({"recompute": "selective", "recompute_modules": ["shared_experts"]}, "training.recompute_modules"),
])
def test_bad_recompute_modules_are_refused_with_their_key(training, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_workload({"name": "rc", "model": {"hf_config": "config/models/gpt-oss-120b.json", "seq_len": SEQ,
                                                "hf_overrides": GPT_OSS},
                        "parallel": {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "zero": 1},
                        "training": {"global_batch": 2, "micro_batch": 1, "dtype": "bf16", **training}},
                       REPO / "config/workloads/rc.yaml")


def test_moe_act_on_a_dense_model_and_modules_on_a_builtin_model_are_refused():
    dense = {"hidden_size": H, "intermediate_size": 2 * H, "num_attention_heads": 4, "num_key_value_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 1024}
    with pytest.raises(ConfigError, match="no experts"):
        parse_workload({"name": "rc", "model": {"hf_config": "config/models/llama-3.1-8b.json", "seq_len": SEQ,
                                                "hf_overrides": dense},
                        "parallel": {"dp": 2}, "training": {"global_batch": 2, "recompute": "selective",
                                                            "recompute_modules": ["moe_act"]}},
                       REPO / "config/workloads/rc.yaml")
    with pytest.raises(ConfigError, match="hf_config models only"):
        parse_workload({"name": "rc", "model": {"arch": "gpt", "layers": 2, "hidden": 64, "heads": 4, "seq_len": 64,
                                                "vocab": 128},
                        "parallel": {"dp": 2}, "training": {"global_batch": 2, "recompute": "selective",
                                                            "recompute_modules": ["layernorm"]}},
                       REPO / "config/workloads/rc.yaml")


@pytest.mark.parametrize("settings, expected", [
    ({"recompute": "selective", "recompute_modules": "['layernorm', 'moe_act']"}, (["layernorm", "moe_act"], [])),
    ({"recompute": "selective", "recompute_modules": "['mla_up_proj', 'mlp']"}, (["mla_up_proj", "mlp"], [])),
    ({"recompute": "selective", "recompute_modules": "['moe', 'mlp']"}, (["mlp"], ["moe"])),
    # a list the preset sets while the granularity stays unset recomputes nothing
    ({"recompute": "none", "recompute_modules": "['layernorm', 'moe_act'] set by preset but inert"}, ([], [])),
    ({"recompute": "selective (DeepSeek common config) ; modules unknown", "recompute_modules": "unknown"}, ([], [])),
])
def test_bridge_presets_map_to_recompute_modules(settings, expected):
    assert recompute_modules(settings) == expected


def test_alltoall_dispatcher_sorts_the_received_chunks_and_flex_deduplicates():
    """Megatron's alltoall dispatcher sends one row per chosen expert and sorts the received
    [source rank][local expert] chunks into expert order and back (copies); the flex dispatcher
    (DeepEP / HybridEP) sends each token once to each rank holding one of its experts and sums
    its local experts' rows before the combine. Here 8 experts, top 4, ep 2 (4 a rank): a token
    misses a rank with probability C(4, 4) / C(8, 4) = 1/70, so 256 tokens send
    round(256 * 69 / 70) = 252 rows to each rank instead of 256 * 4 / 2 = 512. The GEMMs are the
    same; flex keeps its index maps (int64) for backward besides."""
    from echo.training.hf_moe import hit_probability

    def trace(dispatcher):
        out = trace_rank(_workload(None, dispatcher=dispatcher), 0)
        ops, comms = out["ops"], out["comms"].to_pylist()
        mm = pc.sum(ops.filter(pc.equal(ops["op_class"], "gemm"))["flops"]).as_py()
        sent = [c["bytes"] for c in comms if c["group_kind"] == "ep" and c["phase"] == "forward"]
        return ops, mm, out["ranks"]["activation_bytes_per_microbatch"][0].as_py(), sent
    assert hit_probability(EXPERTS, TOP_K, 2) == pytest.approx(69 / 70)
    sorted_ops, mm_sorted, saved_sorted, sent_sorted = trace("alltoall")
    flex_ops, mm_flex, saved_flex, sent_flex = trace("flex")
    assert mm_sorted == mm_flex
    unique, rows = 2 * 252, SEQ * TOP_K
    # per layer: dispatch (the tokens, their weights), combine; bf16 rows of H, the weights bf16
    assert sent_sorted == [rows * H * 2, rows * 2, rows * H * 2] * LAYERS
    assert sent_flex == [unique * H * 2, unique * TOP_K * 2, unique * H * 2] * LAYERS
    # the flex path keeps its index maps (int64; one buffer, the send map and the row map views of it)
    assert saved_flex - saved_sorted == LAYERS * 8 * max(unique, rows)
    copies = lambda ops: Counter(n for n in ops["name"].to_pylist() if n in ("aten.clone.default", "aten.copy_.default"))  # noqa: E731
    assert sum(copies(sorted_ops).values()) > sum(copies(flex_ops).values())
    # its gathers and sums are one kernel each (echo::gather_rows, echo::rows_sum, their backwards):
    # no more launches than the alltoall path's
    assert flex_ops.num_rows <= sorted_ops.num_rows

def test_a_token_hits_a_rank_as_balanced_routing_draws_its_experts():
    """hit_probability by hand: uniform top-k (Qwen3-30B, 128 experts, top 8, ep 8: a rank's 16 are
    missed with C(112, 8) / C(128, 8)); DeepSeek-V3's group-limited routing (8 groups of 32, the
    token picks 4 groups, then 8 experts among their 128): at ep 8 a rank is one group, chosen
    with 4/8; at ep 4 it is two groups."""
    from math import comb

    from echo.training.hf_moe import hit_probability

    assert hit_probability(128, 8, 8) == pytest.approx(1 - comb(112, 8) / comb(128, 8))
    assert hit_probability(128, 8, 1) == 1.0
    assert hit_probability(256, 8, 8, (8, 4)) == pytest.approx(0.5 * (1 - comb(96, 8) / comb(128, 8)))
    two_groups = (comb(6, 4) + comb(2, 1) * comb(6, 3) * comb(96, 8) / comb(128, 8)
                  + comb(6, 2) * comb(64, 8) / comb(128, 8)) / comb(8, 4)
    assert hit_probability(256, 8, 4, (8, 4)) == pytest.approx(1 - two_groups)
    assert 0 < hit_probability(8, 8, 2, (8, 4)) <= 1  # top_k above the chosen groups' experts: no division by 0


def test_rows_sum_adds_rows_by_index_and_gathers_the_gradient_back():
    from echo.training.hf_moe import rows_sum

    x = torch.arange(12.0).reshape(4, 3).requires_grad_()
    index = torch.tensor([2, 0, 2, 1])
    out = rows_sum(x, index, 3)
    assert torch.equal(out, torch.tensor([[3.0, 4, 5], [9, 10, 11], [6, 8, 10]]))
    g = torch.tensor([[1.0, 1, 1], [2, 2, 2], [3, 3, 3]])
    (dx,) = torch.autograd.grad(out, x, g)
    assert torch.equal(dx, g[index])
