"""Megatron-LM's fused kernels of unfused ("math") attention layers (SC21 section 4.2): one
scale-mask-softmax kernel each way and bias-dropout-add in one kernel. Numerics against eager
PyTorch, and the trace records one kernel where eager PyTorch would run a chain."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest
import torch

from echo.config.workload import Workload
from echo.trace import trace_ranks
from echo.training.layers import dropout_add, math_attention, scaled_causal_softmax

B, S, H, L, V, HEADS = 2, 32, 64, 2, 256, 4


def test_scaled_causal_softmax_matches_eager_forward_and_backward():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 7, 9, dtype=torch.float64, requires_grad=True)  # s_q 7, s_k 9
    mask = torch.ones(7, 9, dtype=torch.bool).triu(1)
    ref = torch.softmax((x * 0.3).masked_fill(mask, float("-inf")), -1)
    y = scaled_causal_softmax(x, 0.3)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (dref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(dx, dref)
    assert torch.all(dx.masked_select(mask.expand_as(dx)) == 0)  # masked scores get no gradient


def test_math_attention_equals_the_eager_chain():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
    ref = torch.softmax((q @ k.transpose(-2, -1) * 8 ** -0.5).masked_fill(mask, float("-inf")), -1) @ v
    y = math_attention(q, k, v, 0.0)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v)))


def test_dropout_add_keeps_the_dropped_elements_out_and_passes_the_residual_gradient():
    torch.manual_seed(2)
    x = torch.randn(64, 32, requires_grad=True)
    r = torch.randn(64, 32, requires_grad=True)
    y = dropout_add(x, r, 0.25)
    kept = (y - r).detach() != 0
    assert 0.6 < kept.float().mean() < 0.9  # about 3 in 4 kept
    torch.testing.assert_close((y - r)[kept], (x / 0.75)[kept])
    g = torch.randn_like(y)
    dx, dr = torch.autograd.grad(y, (x, r), g)
    torch.testing.assert_close(dr, g)
    torch.testing.assert_close(dx, torch.where(kept, g / 0.75, torch.zeros_like(g)))
    assert torch.equal(dropout_add(x, r, 0.0), r + x)  # no dropout: the plain add


@pytest.fixture(scope="module")
def math_trace(tmp_path_factory):
    w = Workload.model_validate({
        "name": "t",
        "model": {"arch": "gpt", "layers": L, "hidden": H, "heads": HEADS, "vocab": V, "seq_len": S,
                  "attention": "math", "dropout": 0.1},
        "parallel": {"tp": 2, "pp": 1, "dp": 1, "zero": 0},
        "training": {"global_batch": B, "micro_batch": B, "dtype": "fp16"},
    })
    return trace_ranks(w, [0], tmp_path_factory.mktemp("trace"))["ops"]


def _count(ops, phase: str, name: str) -> int:
    return pc.sum(pc.and_(pc.equal(ops["phase"], phase), pc.equal(ops["name"], name))).as_py() or 0


def test_a_math_layer_runs_one_softmax_kernel_each_way_and_fuses_its_residual_dropouts(math_trace):
    ops = math_trace
    assert _count(ops, "forward", "echo.scaled_causal_softmax.default") == L
    assert _count(ops, "backward", "echo.scaled_causal_softmax_backward.default") == L
    assert _count(ops, "forward", "echo.dropout_add.default") == 2 * L
    # the chain eager PyTorch would run instead is gone: no s x s scale or mask pass
    sxs = pc.match_substring(ops["shapes"], f"{S},{S}]")
    for name in ("aten.masked_fill.Scalar", "aten.mul.Tensor", "aten._softmax.default"):
        assert pc.sum(pc.and_(sxs, pc.equal(ops["name"], name))).as_py() in (None, 0), name
    # what stays on the s x s probabilities: the attention dropout (one pass, a 1-byte mask)
    assert pc.sum(pc.and_(sxs, pc.equal(ops["name"], "aten.native_dropout.default"))).as_py() == L
    classes = set(pc.filter(ops["op_class"], pc.match_substring(ops["name"], "scaled_causal_softmax")).to_pylist())
    assert classes == {"softmax"}
