"""FP8 training (training.dtype fp8, echo/training/fp8.py): what the trace records per recipe, and
the memory it reports, against numbers computed by hand."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pytest

from echo.config.loader import parse_workload
from echo.errors import ConfigError
from echo.io import read_parquet
from echo.trace.runner import run_trace

REPO = Path(__file__).resolve().parents[1]
# one rank, two GPT layers of hidden 256: the block linears are qkv 256x768, proj 256x256,
# fc1 256x1024 and fc2 1024x256 (biases stay bf16)
GPT = {"arch": "gpt", "layers": 2, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 256}
LINEAR_SHAPES = [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 2   # (out, in) per linear
LINEAR_PARAMS = sum(n * k for n, k in LINEAR_SHAPES)                      # 1,572,864


def _trace(tmp_path: Path, model: dict, parallel: dict | None = None, **training):
    w = parse_workload({"model": model, "parallel": parallel or {},
                        "training": {"global_batch": 1, "micro_batch": 1, **training}}, tmp_path / "w.yaml")
    out = tmp_path / (training.get("fp8_recipe") or "bf16")
    run_trace(w, out)
    rank = lambda t: t.filter(pc.equal(t["rank"], 0)).to_pylist()  # noqa: E731
    return (rank(read_parquet(out / "ops.parquet")), rank(read_parquet(out / "comms.parquet")),
            rank(read_parquet(out / "ranks.parquet"))[0])


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "blockwise", "nvfp4"])
def test_each_recipe_runs_every_block_gemm_in_low_precision(tmp_path, recipe):
    ops, comms, _ = _trace(tmp_path, GPT, dtype="fp8", fp8_recipe=recipe)
    gemms = Counter((o["phase"], o["name"], o["dtype"]) for o in ops if o["op_class"] == "gemm")
    low = "float4_e2m1fn_x2" if recipe == "nvfp4" else "float8_e4m3fn"
    grad = {"delayed": "float8_e5m2", "current": "float8_e5m2"}.get(recipe, low)
    # 8 linears: forward, and data- plus weight-gradient GEMMs in backward
    assert gemms[("forward", "aten._scaled_mm.default", low)] == 8
    assert gemms[("backward", "aten._scaled_mm.default", grad)] == 16
    # the LM head stays bf16 (one GEMM forward, two backward)
    assert gemms[("forward", "aten.mm.default", "bfloat16")] == 1
    quant = Counter(o["phase"] for o in ops if o["name"] == "echo.quantize.default")
    # inputs: qkv, proj, fc1, fc2 per layer; gradients: one per linear; weights: once per step
    assert quant == {"forward": 8, "backward": 8, "optimizer": 8}
    amax_passes = sum(o["name"] == "aten.linalg_vector_norm.default" for o in ops)
    assert amax_passes == (24 if recipe in ("current", "nvfp4") else 0)
    amax_reductions = [c for c in comms if c["group_kind"] == "stage"]
    # a single rank has no group to reduce over: delayed scaling's reductions need ranks (below)
    assert amax_reductions == []


@pytest.mark.slow
def test_fp8_memory_matches_hand_computed_figures(tmp_path):
    """Per-tensor FP8 (Transformer Engine on Hopper) keeps an FP8 copy and an FP8 transpose of every
    block weight across micro-batches: 2 bytes a parameter; master weights, gradients and Adam
    moments are as in bf16 training. MXFP8 adds one E8M0 scale per 32 values, padded to 128x4."""
    _, _, bf16 = _trace(tmp_path, GPT, dtype="bf16")
    _, _, delayed = _trace(tmp_path, GPT, dtype="fp8", fp8_recipe="delayed")
    _, _, mx = _trace(tmp_path, GPT, dtype="fp8", fp8_recipe="mxfp8")
    # plus one fp32 scale for each of the 16 copies
    assert delayed["param_bytes"] - bf16["param_bytes"] == 2 * LINEAR_PARAMS + 16 * 4 == 3_145_792
    scales = sum(_round_up(n, 128) * _round_up(k // 32, 4) + _round_up(k, 128) * _round_up(n // 32, 4)
                 for n, k in LINEAR_SHAPES)
    assert mx["param_bytes"] - bf16["param_bytes"] == 2 * LINEAR_PARAMS + scales
    for key in ("grad_bytes", "optimizer_bytes"):
        assert delayed[key] == mx[key] == bf16[key]
    # the linears' inputs are saved as FP8 transposes (1 byte) instead of bf16 (2 bytes), over
    # 256 tokens per layer: bf16 saves the qkv and fc1 inputs (256 wide) and the fc2 input (1024);
    # the proj input is attention's output, which attention's backward keeps in any case, so
    # FP8 adds its copy. Saved: 2 x (256 + 256 + 1024) - (256 + 256 + 256 + 1024) bytes per token
    saved = 2 * 256 * (2 * (256 + 256 + 1024) - (256 + 256 + 256 + 1024))
    assert bf16["activation_bytes_per_microbatch"] - delayed["activation_bytes_per_microbatch"] == pytest.approx(saved, abs=64)


@pytest.mark.slow
def test_sequence_parallel_fp8_gathers_in_fp8_and_reduces_amaxes(tmp_path):
    """Built-in GPT, TP2 + SP, DP2: current scaling all-reduces each gathered shard's amax over
    TP and gathers the shard in FP8 (half the bytes of bf16); delayed scaling all-reduces the
    amaxes once per chunk pass over the stage's tp x dp ranks."""
    par = {"tp": 2, "dp": 2, "sequence_parallel": True}
    _, bf16, _ = _trace(tmp_path, GPT, par, global_batch=2, dtype="bf16")
    _, cur, _ = _trace(tmp_path, GPT, par, global_batch=2, dtype="fp8", fp8_recipe="current")
    _, dly, _ = _trace(tmp_path, GPT, par, global_batch=2, dtype="fp8", fp8_recipe="delayed")
    gathers = lambda cs: [c for c in cs if c["op"] == "all_gather" and c["group_kind"] == "tp" and c["phase"] == "forward"]  # noqa: E731
    assert {c["dtype"] for c in gathers(cur)} >= {"float8_e4m3fn"}
    fp8_bytes = sorted(c["bytes"] for c in gathers(cur) if c["dtype"] == "float8_e4m3fn")
    bf16_bytes = sorted(c["bytes"] for c in gathers(bf16))[:len(fp8_bytes)]
    assert [2 * b for b in fp8_bytes] == bf16_bytes
    tp_amax = [c for c in cur if c["op"] == "all_reduce" and c["group_kind"] == "tp" and c["bytes"] == 4]
    assert len(tp_amax) == 4  # qkv and fc1 inputs of both layers
    stage = [c for c in dly if c["group_kind"] == "stage"]
    assert [c["phase"] for c in stage] == ["forward", "backward"] and {c["group_size"] for c in stage} == {4}


@pytest.mark.slow
def test_routed_experts_run_grouped_fp8_gemms_and_the_router_stays_bf16(tmp_path):
    cfg = {**json.loads((REPO / "config/models/qwen3-30b-a3b.json").read_text()),
           "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "num_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 1024}
    (tmp_path / "moe.json").write_text(json.dumps(cfg))
    model = {"hf_config": str(tmp_path / "moe.json"), "seq_len": 256}
    ops, _, _ = _trace(tmp_path, model, {"dp": 2, "ep": 2}, global_batch=2, dtype="fp8", fp8_recipe="delayed")
    grouped = Counter(o["phase"] for o in ops if o["name"] == "aten._scaled_grouped_mm.default")
    assert grouped == {"forward": 4, "backward": 8}  # gate_up and down of 2 layers
    flops = Counter()
    for o in ops:
        if o["name"] == "aten._scaled_grouped_mm.default":
            flops[o["phase"]] += o["flops"]
    assert flops["backward"] == 2 * flops["forward"] > 0  # data and weight gradient, each the forward's
    router = [o for o in ops if o["name"] == "aten.mm.default" and o["phase"] == "forward"
              and json.loads(o["shapes"])[1][-1] == 8]
    assert len(router) == 2 and {o["dtype"] for o in router} == {"bfloat16"}


def test_fp8_settings_are_checked(tmp_path):
    base = {"model": GPT, "parallel": {}, "training": {"global_batch": 1}}
    with pytest.raises(ConfigError, match="fp8_recipe"):
        parse_workload({**base, "training": {"global_batch": 1, "dtype": "fp8"}}, tmp_path / "w.yaml")
    with pytest.raises(ConfigError, match="fp8_recipe"):
        parse_workload({**base, "training": {"global_batch": 1, "fp8_recipe": "delayed"}}, tmp_path / "w.yaml")
    with pytest.raises(ConfigError, match="fp8_param_gather"):
        parse_workload({**base, "training": {"global_batch": 1, "dtype": "fp8", "fp8_recipe": "delayed",
                                             "fp8_param_gather": True}, "parallel": {"zero": 0}}, tmp_path / "w.yaml")


def test_a_recipe_the_gpu_lacks_is_refused(tmp_path):
    from echo.config import load_hardware
    from echo.config.loader import check_numerics

    w = parse_workload({"model": GPT, "parallel": {}, "training": {"global_batch": 1, "dtype": "fp8",
                                                                  "fp8_recipe": "mxfp8"}}, tmp_path / "w.yaml")
    check_numerics(w, load_hardware("b200-sxm"), "b200-sxm.yaml")  # Blackwell: block-scaled tensor cores
    with pytest.raises(ConfigError, match="peak_tflops.fp4"):
        check_numerics(w, load_hardware("h100-sxm-80gb"), "h100-sxm-80gb.yaml")
    delayed = w.model_copy(update={"training": w.training.model_copy(update={"fp8_recipe": "delayed"})})
    check_numerics(delayed, load_hardware("h100-sxm-80gb"), "h100-sxm-80gb.yaml")
    with pytest.raises(ConfigError, match="peak_tflops.fp8"):
        check_numerics(delayed, load_hardware("a100-sxm-80gb"), "a100-sxm-80gb.yaml")
    with pytest.raises(ConfigError, match="needs a GPU"):
        check_numerics(w, load_hardware("local-cpu"), "local-cpu.yaml")


@pytest.mark.slow
def test_hf_sequence_parallel_fp8_saves_and_gathers_the_fp8_shard(tmp_path):
    """A transformers Llama under TP2 + SP in FP8 (current scaling) runs as Transformer Engine's
    sequence-parallel LayerNormLinear: each region (attention, MLP) quantizes its input shard
    once, all-gathers the FP8 shard (half the bf16 bytes) and keeps that FP8 shard for backward
    (1 byte per element where bf16 training keeps the bf16 shard, 2 bytes)."""
    cfg = {**json.loads((REPO / "config/models/llama-3.1-8b.json").read_text()),
           "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
           "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024}
    (tmp_path / "llama.json").write_text(json.dumps(cfg))
    model = {"hf_config": str(tmp_path / "llama.json"), "seq_len": 256}
    par = {"tp": 2, "sequence_parallel": True}
    _, bf16_comms, bf16 = _trace(tmp_path, model, par, dtype="bf16")
    ops, comms, cur = _trace(tmp_path, model, par, dtype="fp8", fp8_recipe="current")
    tokens, shard, hidden, ffn = 256, 128, 256, 512
    gathers = lambda cs: [c for c in cs if c["op"] == "all_gather" and c["group_kind"] == "tp"  # noqa: E731
                          and c["phase"] == "forward" and c["bytes"] in (tokens * hidden, 2 * tokens * hidden)]
    # two regions per layer, and the LM head's bf16 gather on top in both
    assert sorted(c["bytes"] for c in gathers(comms)) == [tokens * hidden] * 4 + [2 * tokens * hidden]
    assert len(gathers(bf16_comms)) == 5
    # one quantize of each region's input, not one per projection (q, k, v; gate, up)
    forward_quant = [o for o in ops if o["name"] == "echo.quantize.default" and o["phase"] == "forward"]
    assert len(forward_quant) == 2 * (2 + 2)  # per layer: the two regions' shards, o_proj's and down_proj's inputs
    # per layer: each region's saved shard 2 -> 1 byte; down_proj's input 2 -> 1 byte (T x ffn / tp);
    # o_proj's input is attention's output, kept by attention anyway, so FP8 adds its 1-byte copy
    per_layer = 2 * shard * hidden + tokens * ffn // 2 - tokens * hidden // 2
    saved = bf16["activation_bytes_per_microbatch"] - cur["activation_bytes_per_microbatch"]
    assert saved == pytest.approx(2 * per_layer, abs=256)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "hf"])
@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "blockwise", "nvfp4"])
def test_sequence_parallel_gathers_every_recipe_in_low_precision(tmp_path, recipe, arch):
    """The sequence-parallel FP8 input (Echo's GPT blocks and a transformers Llama) with each
    recipe's scales: the block recipes' scales follow the gathered rows (the block-scaled GEMM
    checks their count), and every region gathers its shard in low precision."""
    cfg = {**json.loads((REPO / "config/models/llama-3.1-8b.json").read_text()),
           "num_hidden_layers": 1, "hidden_size": 512, "intermediate_size": 1024,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    (tmp_path / "llama.json").write_text(json.dumps(cfg))
    model = ({"arch": "gpt", "layers": 1, "hidden": 512, "heads": 4, "vocab": 1024, "seq_len": 256} if arch == "gpt"
             else {"hf_config": str(tmp_path / "llama.json"), "seq_len": 256})
    _, comms, _ = _trace(tmp_path, model, {"tp": 2, "sequence_parallel": True}, dtype="fp8", fp8_recipe=recipe)
    low = {c["dtype"] for c in comms if c["op"] == "all_gather" and c["group_kind"] == "tp"
           and c["phase"] == "forward" and c["dtype"] != "bfloat16"}
    assert low == {"float4_e2m1fn_x2" if recipe == "nvfp4" else "float8_e4m3fn"}
