"""Sliding-window causal attention as one fused kernel (``echo::sliding_attention`` and its backward).

Query i attends to keys i - window + 1 .. i (gpt-oss's sliding layers, Mistral). FlashAttention-2/3
and cuDNN run it as their causal kernel with a window: each CTA takes one block of 128 queries
(forward) or 128 keys (backward) of a (batch, head) and loops only over the other side's blocks
that the band touches, about window / 128 + 1 of them. Tracing it as one op over the whole
sequence lets the cost model see that structure (echo.profile.attention_model: ``window``): the
same CTAs as the full causal kernel, each with a short loop. (Cutting the sequence into blocks of
``window`` queries against their two key blocks would give the backward twice the kernel's CTAs.)

The CPU implementation computes the real values (the measure stage trains for real): scores with
the band mask, softmax, and the flash backward from the saved log-sum-exp. Inputs are
[batch, heads, seq, head_dim] with as many key / value heads as query heads (the caller repeats
grouped-query heads); dropout is not applied, as with Echo's other fused attention.
"""

from __future__ import annotations

import math

import torch


def band_pairs(seq: int, window: int) -> int:
    """(query, key) pairs of the causal band: query i sees min(i + 1, window) keys."""
    w = min(window, seq)
    return seq * w - w * (w - 1) // 2


def _scores(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    s = q.shape[-2]
    i = torch.arange(s, device=q.device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~band, float("-inf"))


@torch.library.custom_op("echo::sliding_attention", mutates_args=())
def sliding_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, s, d], log-sum-exp of each query's scores [b, h, s], fp32)."""
    scores = _scores(q, k, window)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ v.float()
    return out.to(q.dtype), lse


@sliding_attention.register_fake
def _(q, k, v, window):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("echo::sliding_attention_backward", mutates_args=())
def sliding_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor,
                               window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): the flash backward, probabilities rebuilt from the log-sum-exp."""
    p = torch.exp(_scores(q, k, window) - lse[..., None])
    g = grad.float()
    dv = p.transpose(-1, -2) @ g
    dp = g @ v.float().transpose(-1, -2)
    ds = p * (dp - (g * out.float()).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@sliding_attention_backward.register_fake
def _(grad, q, k, v, out, lse, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, window = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.window = window


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = sliding_attention_backward(grad.contiguous(), q, k, v, out, lse, ctx.window)
    return dq, dk, dv, None


sliding_attention.register_autograd(_backward, setup_context=_setup)
