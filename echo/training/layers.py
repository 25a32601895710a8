"""Layers the reference models share: activation checkpointing that labels recomputed ops, GPU-style
dropout, and causal attention (fused or unfused, with context-parallel key/value gathering)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
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


class RecomputedOutputs:
    """Megatron-Core's CheckpointWithoutOutput (``recompute_modules``: layernorm, moe_act): a
    module's output is not kept for backward by the ops that read it; backward recomputes it from
    the module's inputs (which stay saved by the module's own backward) the first time one of
    them needs it, under ``hook()`` so that the tracer labels it recompute.

    ``keep(y, fn)`` registers ``y``, made by ``fn()``; ``saving()`` is the saved-tensors context
    under which its readers run: a tensor of a registered output's storage is saved as a handle,
    every other one goes to the hooks outside (the memory meter's, checkpointing's)."""

    def __init__(self, hook: RecomputeHook):
        self.hook = hook
        # storage -> (fn, its recomputed value); an entry goes with its output (storage
        # addresses are reused once freed)
        self.pending: dict[int, tuple[Callable, list]] = {}

    def keep(self, y: torch.Tensor, fn: Callable) -> torch.Tensor:
        if type(y) is not torch.Tensor and not isinstance(y, torch._subclasses.FakeTensor):
            return y  # a DTensor (a sequence-parallel shard) stays saved as it is
        key = y.untyped_storage()._cdata
        self.pending[key] = (fn, [])
        weakref.finalize(y, self.pending.pop, key, None)
        return y

    def saving(self) -> AbstractContextManager:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack_out, unpack_out = outer if outer is not None else (lambda t: t, lambda t: t)

        def pack(t: torch.Tensor):
            plain = type(t) is torch.Tensor or isinstance(t, torch._subclasses.FakeTensor)
            entry = self.pending.get(t.untyped_storage()._cdata) if plain and self.pending else None
            if entry is None:
                return ("saved", pack_out(t))
            return ("recompute", entry, t.shape, t.stride(), t.storage_offset())

        def unpack(packed):
            if packed[0] == "saved":
                return unpack_out(packed[1])
            _, (fn, value), shape, stride, offset = packed
            if not value:  # the first reader's backward recomputes it; the others share it
                with torch.no_grad(), self.hook():
                    value.append(fn())
            return value[0].as_strided(shape, stride, offset)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout as GPUs run it: native_dropout keeps a 1-byte mask for backward (the CPU's
    F.dropout keeps a scaled noise tensor in the input's dtype instead)."""
    return torch.native_dropout(x, p, True)[0] if p else x


# Megatron-LM's bias-dropout-add fusion (--bias-dropout-fusion, on by default; SC21 section 4.2):
# the residual add runs inside the dropout kernel, one pass over x and the residual instead of a
# dropout pass and an add pass (the bias rides in the GEMM's epilogue here, as costly as nothing).
@torch.library.custom_op("echo::dropout_add", mutates_args=())
def _dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + dropout(x), the 1-byte keep mask) in one pass."""
    y, mask = torch.native_dropout(x, p, True)
    return residual + y, mask


@_dropout_add.register_fake
def _(x, residual, p):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _dropout_add_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.p = inputs[2]


def _dropout_add_backward(ctx, grad, _grad_mask):
    (mask,) = ctx.saved_tensors
    # the residual's gradient passes through unchanged (no kernel); x's is native_dropout's backward
    return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - ctx.p)), grad, None


_dropout_add.register_autograd(_dropout_add_backward, setup_context=_dropout_add_setup)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float) -> torch.Tensor:
    """residual + dropout(x): one fused kernel when p > 0, else the plain add. Sequence-parallel
    shards (DTensors placed alike) run it on their local rows."""
    if not p:
        return residual + x
    if isinstance(x, DTensor) or isinstance(residual, DTensor):
        if not (isinstance(x, DTensor) and isinstance(residual, DTensor) and x.placements == residual.placements):
            return residual + dropout(x, p)
        y = _dropout_add(x.to_local().contiguous(), residual.to_local().contiguous(), p)[0]
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False)
    return _dropout_add(x.contiguous(), residual.contiguous(), p)[0]


# --- Megatron-LM's fused scale-mask-softmax --------------------------------------------------
# Megatron-LM runs the scaling, causal mask and softmax of unfused attention as one kernel each way
# (scaled_upper_triang_masked_softmax, --masked-softmax-fusion, on by default since 2020; SC21
# section 4.2 names it among the fused kernels of the runs it reports): one read and one write of
# the s x s scores forward, where eager PyTorch runs mul, masked_fill and softmax (three passes),
# and one kernel backward. A custom op, so the trace records that one kernel; its CPU code
# computes the real values (the measure stage trains for real).
@torch.library.custom_op("echo::scaled_causal_softmax", mutates_args=())
def scaled_causal_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * x) over the last dim, keys after the query masked (at least fp32 inside)."""
    s_q, s_k = x.shape[-2:]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=x.device).triu(1)
    wide = torch.promote_types(x.dtype, torch.float32)
    return torch.softmax((x.to(wide) * scale).masked_fill(mask, float("-inf")), -1).to(x.dtype)


@scaled_causal_softmax.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("echo::scaled_causal_softmax_backward", mutates_args=())
def scaled_causal_softmax_backward(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """d(scores) from the probabilities y alone: scale * y * (grad - sum(grad * y))."""
    wide = torch.promote_types(y.dtype, torch.float32)
    g, yf = grad.to(wide), y.to(wide)
    return (scale * yf * (g - (g * yf).sum(-1, keepdim=True))).to(y.dtype)


@scaled_causal_softmax_backward.register_fake
def _(grad, y, scale):
    return torch.empty_like(y)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)  # the kernel keeps only its output, as Megatron's does
    ctx.scale = inputs[1]


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return scaled_causal_softmax_backward(grad.contiguous(), y, ctx.scale), None


scaled_causal_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def math_attention(q, k, v, p_drop: float) -> torch.Tensor:
    """Unfused causal attention as Megatron-LM runs it: the QK^T GEMM, one fused scale-mask-softmax
    kernel, dropout, the PV GEMM (the s x s probabilities kept for backward, as Korthikanti et al.
    count them)."""
    scores = torch.matmul(q, k.transpose(-2, -1))
    probs = scaled_causal_softmax(scores.contiguous(), q.shape[-1] ** -0.5)
    return torch.matmul(dropout(probs, p_drop), v)


def attention_core(q, k, v, selective: bool, hook: RecomputeHook, cp_group=None,
                   kind: str = "flash", dropout: float = 0.0) -> torch.Tensor:
    """Causal attention; selective recompute (Korthikanti et al.) re-runs it inside backward.

    Context parallelism (``cp_group``): each rank holds 1/cp of the sequence and all-gathers the
    keys and values of the whole sequence (Llama 3's all-gather CP; backward reduce-scatters their
    gradients). Its queries then attend to all keys; with Megatron's load-balanced assignment
    (chunks i and 2cp-1-i per rank) the causal work per rank is half of that block, which is what
    ``is_causal`` tells the kernel and the cost model (the mask's alignment is not modelled).

    Grouped-query attention (``k`` and ``v`` with fewer heads than ``q``): the fused kernel takes
    the key / value heads as they are, as FlashAttention, cuDNN and Transformer Engine do (SDPA's
    ``enable_gqa``: no repeated copy of K / V is made, saved or, under context parallelism,
    gathered); the unfused path repeats them first, as a GEMM of each query head needs them."""
    if cp_group is not None:
        k = funcol.all_gather_tensor_autograd(k.contiguous(), 2, cp_group)
        v = funcol.all_gather_tensor_autograd(v.contiguous(), 2, cp_group)
    group = q.shape[1] // k.shape[1]
    if kind == "math":
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        core = lambda q, k, v: math_attention(q, k, v, dropout)  # noqa: E731
    elif group > 1:
        core = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    else:
        # A fused kernel drops attention weights inside itself (FlashAttention's dropout_p: its RNG
        # runs in the kernel, its cost is not modelled) and saves no s x s tensor. On the tracing
        # CPU, SDPA with dropout_p > 0 would fall back to the unfused path (scores, probabilities
        # and mask materialized), which no GPU flash kernel runs: the fused kernel is traced alone.
        core = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return recomputed(core, hook)(q, k, v) if selective else core(q, k, v)
