"""Layers the reference models share: activation checkpointing that labels recomputed ops, GPU-style
dropout, and causal attention (fused or unfused, with context-parallel key/value gathering)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

RecomputeHook = Callable[[], AbstractContextManager]


def recomputed(fn: Callable, hook: RecomputeHook) -> Callable:
    """Activation checkpointing of ``fn`` whose second run (the recompute inside backward) runs
    under ``hook()``, so that the tracer labels those ops as recompute."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        with hook() if calls[0] > 1 else nullcontext():
            return fn(*args)

    def checkpointed(*args):
        # Megatron-LM recomputes the whole layer; PyTorch's early stop would skip its tail
        with set_checkpoint_early_stop(False):
            return checkpoint(run, *args, use_reentrant=False)

    return checkpointed


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout as GPUs run it: native_dropout keeps a 1-byte mask for backward (the CPU's
    F.dropout keeps a scaled noise tensor in the input's dtype instead)."""
    return torch.native_dropout(x, p, True)[0] if p else x


def math_attention(q, k, v, p_drop: float) -> torch.Tensor:
    """Unfused causal attention: scores, masked softmax, dropout, PV (each its own kernel, and
    the s x s probabilities kept for backward, as Korthikanti et al. count them)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s_q, s_k = scores.shape[-2:]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
    probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.matmul(dropout(probs, p_drop), v)


def attention_core(q, k, v, selective: bool, hook: RecomputeHook, cp_group=None,
                   kind: str = "flash", dropout: float = 0.0) -> torch.Tensor:
    """Causal attention; selective recompute (Korthikanti et al.) re-runs it inside backward.

    Context parallelism (``cp_group``): each rank holds 1/cp of the sequence and all-gathers the
    keys and values of the whole sequence (Llama 3's all-gather CP; backward reduce-scatters their
    gradients). Its queries then attend to all keys; with Megatron's load-balanced assignment
    (chunks i and 2cp-1-i per rank) the causal work per rank is half of that block, which is what
    ``is_causal`` tells the kernel and the cost model (the mask's alignment is not modelled)."""
    if cp_group is not None:
        k = funcol.all_gather_tensor_autograd(k.contiguous(), 2, cp_group)
        v = funcol.all_gather_tensor_autograd(v.contiguous(), 2, cp_group)
    if kind == "math":
        core = lambda q, k, v: math_attention(q, k, v, dropout)  # noqa: E731
    else:
        core = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)  # noqa: E731
    return recomputed(core, hook)(q, k, v) if selective else core(q, k, v)
