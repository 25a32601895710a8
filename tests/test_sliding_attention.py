"""Sliding-window attention as one fused kernel (echo/training/sliding_attention.py): its values
against PyTorch's attention with the band mask, the FLOPs of the band counted by hand, the
trace of gpt-oss's sliding layers, and the cost model's CTAs (echo/profile/attention_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch

from echo.config import load_hardware
from echo.config.loader import parse_workload
from echo.profile.attention_model import AttentionCall, attention_time, ctas
from echo.trace.step import trace_rank
from echo.training.sliding_attention import band_pairs, sliding_attention

REPO = Path(__file__).resolve().parents[1]


def test_values_and_gradients_match_attention_with_the_band_mask():
    torch.manual_seed(0)
    b, h, s, d, w = 2, 3, 10, 4, 3
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    i = torch.arange(s)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    out = sliding_attention(q, k, v, w)[0]
    assert torch.allclose(out, ref, atol=1e-5)  # the kernel computes in fp32
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        assert torch.allclose(a, r, atol=1e-5)
    assert band_pairs(s, w) == int(band.sum()) == 27  # 1 + 2 + 3 x 8
    assert band_pairs(5, 10) == 15                    # a window past the sequence: the triangle


def test_gpt_oss_sliding_layers_trace_one_band_kernel_each_way(tmp_path):
    cfg = {**json.loads((REPO / "config/models/gpt-oss-120b.json").read_text()),
           "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "hidden_size": 256,
           "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
           "num_local_experts": 4, "vocab_size": 1024, "sliding_window": 128}
    (tmp_path / "oss.json").write_text(json.dumps(cfg))
    w = parse_workload({"name": "oss", "model": {"hf_config": str(tmp_path / "oss.json"), "seq_len": 512},
                        "parallel": {"dp": 1}, "training": {"global_batch": 1, "dtype": "bf16"}},
                       tmp_path / "oss.yaml")
    ops = trace_rank(w, 0)["ops"]
    band = ops.filter(pc.match_substring(ops["name"], "sliding_attention")).to_pylist()
    assert [o["name"] for o in band] == ["echo.sliding_attention.default", "echo.sliding_attention_backward.default"]
    assert {o["op_class"] for o in band} == {"attention"}
    forward = 4.0 * 8 * 32 * band_pairs(512, 128)  # batch 1, 8 heads, head dim 32
    assert [o["flops"] for o in band] == [forward, 2 * forward]
    full = ops.filter(pc.match_substring(ops["name"], "flash_attention")).to_pylist()
    assert len(full) == 2  # the full layer keeps the causal flash kernel


@pytest.mark.parametrize("backward", [False, True])
def test_a_window_keeps_the_kernels_ctas_and_shortens_their_loops(backward):
    hw = load_hardware("h100-sxm-80gb")
    cm = hw.compute_model

    def time(window, s=4096):
        call = AttentionCall(1, 64, s, s, 64, backward, True, False, window)
        return call, attention_time(cm.attention, cm.gemm.bf16.peak_fraction, hw.peak_tflops.bf16, cm.sm_count,
                                    cm.kernel_launch_us, call, hw.hbm_GBps * cm.hbm_efficiency)
    band_call, band = time(128)
    full_call, full = time(0)
    # gpt-oss's layers: as many CTAs as the causal kernel (a block of 128 queries / keys of each head) ...
    assert ctas(band_call) == ctas(full_call) == 64 * 4096 // 128
    # ... each looping over about 2 blocks instead of 16.5 on average: past the CTAs' fixed cost
    # (the same in both) the band's loops take under a third of the triangle's (the backward's
    # side kernels, the same in both, included)
    cta_us = cm.attention.bwd_cta_us if backward else cm.attention.fwd_cta_us
    fixed = ctas(band_call) * cta_us / cm.sm_count
    assert 0 < band - fixed < (full - fixed) / 3
    assert time(4096)[1] == pytest.approx(full)  # a window as long as the sequence is the triangle
