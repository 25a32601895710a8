"""Megatron-style tensor parallelism, with or without sequence parallelism, as DTensor plans.

Column-parallel QKV and fc1, row-parallel proj and fc2, a vocabulary-parallel token embedding,
and a column-parallel LM head whose logits stay sharded for a vocabulary-parallel loss.
Without sequence parallelism the residual stream is replicated: one all-reduce after attention
and one after the MLP in forward, mirrored in backward. With it (Korthikanti et al. 2022) the
residual stream, norms included, holds 1/tp of the sequence: each all-reduce becomes an
all-gather before the column-parallel GEMM and a reduce-scatter after the row-parallel one.
As in Megatron-LM, a column-parallel GEMM keeps only its input's shard for backward and gathers
it again there (DTensor's own redistribution would keep the gathered input, tp times larger).
"""

from __future__ import annotations

import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from echo.training import fp8
from echo.training.hf_parallel import parallelize_hf_block


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    """Column-parallel input projections, row-parallel output projections of attention and MLP
    (each module lists its own in COLWISE / ROWWISE)."""
    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {}
    for part in ("attn", "mlp"):
        module = getattr(block, part)
        plan |= {f"{part}.{n}": ColwiseParallel() for n in module.COLWISE}
        plan |= {f"{part}.{n}": RowwiseParallel(**out) for n in module.ROWWISE}
    if sequence_parallel:  # norms on the local shard; attention and MLP receive the shard
        plan |= {"ln1": SequenceParallel(use_local_output=True), "ln2": SequenceParallel(use_local_output=True)}
    return plan


def apply_tensor_parallel(chunk: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard ``chunk`` (a ModelChunk or an hf.HFChunk) in place over the 1-D tensor-parallel ``mesh``."""
    hf = getattr(chunk, "hf", False)
    for block in chunk.blocks:
        if hf:
            parallelize_hf_block(block, mesh, sequence_parallel, chunk.hf_tp_plan)
            continue
        if getattr(chunk, "custom", False):  # a user's module: its own plan (custom.py)
            parallelize_module(block, mesh, {n: ColwiseParallel() if s == "colwise" else RowwiseParallel()
                                             for n, s in chunk.tp_plan.items()})
            continue
        parallelize_module(block, mesh, _block_plan(block, sequence_parallel))
        if sequence_parallel:
            for part in (block.attn, block.mlp):
                for name in part.COLWISE:
                    gather_in_linear(getattr(part, name), mesh, block.hook)
    seq = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        chunk.seq_shard = (mesh.get_local_rank(), mesh.size())
    if chunk.first:
        parallelize_module(chunk, mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)})
    if chunk.last:
        head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        final = {"ln_f": SequenceParallel()} if sequence_parallel else {}
        parallelize_module(chunk, mesh, {**final, "head": head})


class _GatherLinear(torch.autograd.Function):
    """y = all_gather(x_shard) @ W^T (+ b), saving only x_shard; backward gathers x again
    (recorded as recompute), then reduce-scatters the input gradient back to shards."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, hook, fp8_state=None):
        ctx.group, ctx.hook, ctx.has_bias, ctx.fp8 = group, hook, bias is not None, fp8_state
        if fp8_state is not None:
            return _GatherLinear._fp8_forward(ctx, x_shard, weight, bias)
        ctx.save_for_backward(x_shard, weight)
        return F.linear(funcol.all_gather_tensor(x_shard, 1, group), weight, bias)

    @staticmethod
    def _fp8_forward(ctx, x_shard, weight, bias):
        """Transformer Engine's sequence-parallel FP8 linear: the shard is quantized (one scale
        for the whole tensor: current scaling all-reduces the amax first) and gathered in FP8;
        backward gathers the saved FP8 shard again and transposes it for the weight gradient."""
        s, (b, n, h) = ctx.fp8, x_shard.shape
        q, sq, x8, sx = fp8.gather_shard(s, x_shard.reshape(b * n, h), ctx.group)
        y = fp8.forward_gemm(s, (x8, sx), weight)
        y = y + bias if bias is not None else y
        ctx.save_for_backward(q, sq, weight)
        ctx.x_shape = (b, n * (x8.shape[0] // q.shape[0]), h)
        return y.view(*ctx.x_shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        if ctx.fp8 is not None:
            q, _, weight = ctx.saved_tensors
            with ctx.hook():
                xt = fp8.regather_transposed(ctx.fp8, q, ctx.group, ctx.x_shape[-1])
            dx, grad_w = fp8.backward_gemms(ctx.fp8, grad.flatten(0, -2), xt, weight, True, True)
            grad_x = funcol.reduce_scatter_tensor(dx.view(*grad.shape[:-1], -1), "sum", 1, ctx.group)
            return grad_x, grad_w, grad_b, None, None, None
        x_shard, weight = ctx.saved_tensors
        with ctx.hook():
            x = funcol.all_gather_tensor(x_shard, 1, ctx.group)
        grad_x = funcol.reduce_scatter_tensor(grad.matmul(weight), "sum", 1, ctx.group)
        grad_w = grad.flatten(0, -2).t().matmul(x.flatten(0, -2))
        return grad_x, grad_w, grad_b, None, None, None


def gather_in_linear(linear: torch.nn.Linear, mesh: DeviceMesh, hook) -> None:
    """Make a ColwiseParallel linear take the sequence shard and gather it itself (see above)."""
    group = mesh.get_group()

    def forward(self, x):
        local = x.to_local() if isinstance(x, DTensor) else x  # the hook only wrapped the shard
        bias = self.bias.to_local() if self.bias is not None else None
        state = fp8.active() if getattr(self, "echo_fp8", False) else None
        y = _GatherLinear.apply(local, self.weight.to_local(), bias, group, hook, state)
        return DTensor.from_local(y, mesh, [Shard(-1)], run_check=False)

    linear.forward = types.MethodType(forward, linear)
