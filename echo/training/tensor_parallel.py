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


# transformers' linear names -> style, where a model's own tp_plan does not cover them (DeepSeek's
# has no attention entries): the up-projections of attention (MLA's q_b_proj / kv_b_proj after
# its replicated low-rank down-projections) and of the MLP are column-parallel, their output
# projections row-parallel, as Megatron-Core shards them
_DERIVED = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "q_b_proj": "colwise",
            "kv_b_proj": "colwise", "gate_proj": "colwise", "up_proj": "colwise",
            "o_proj": "rowwise", "down_proj": "rowwise"}


def hf_linear_styles(block: nn.Module, model_plan: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Linear of a transformers decoder layer -> (colwise | rowwise, "model" | "derived"): the
    model's own ``base_model_tp_plan`` entries that name a linear of this layer, then the derived
    style of every other known linear. Routed experts are not tensor-parallel (Megatron-Core's
    expert tensor parallel size 1); other linears (routers, MLA's down-projections) stay replicated."""
    linears = {n for n, m in block.named_modules() if isinstance(m, nn.Linear) and ".experts." not in f".{n}."}
    out = {}
    for key, style in model_plan.items():
        name = key.removeprefix("layers.*.")
        if name in linears and style in ("colwise", "rowwise"):
            out[name] = (style, "model")
    for name in sorted(linears - set(out)):
        style = _DERIVED.get(name.rsplit(".", 1)[-1])
        if style:
            out[name] = (style, "derived")
    return out


def _hf_block_plan(block: nn.Module, model_plan: dict[str, str], sequence_parallel: bool) -> dict:
    """A transformers decoder layer's plan: its column- and row-parallel linears, and with
    sequence parallelism its two norms on the sequence shard (their weight gradients all-reduced)."""
    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {n: ColwiseParallel() if style == "colwise" else RowwiseParallel(**out)
            for n, (style, _) in hf_linear_styles(block, model_plan).items()}
    if sequence_parallel:
        plan |= {"input_layernorm": SequenceParallel(use_local_output=True),
                 "post_attention_layernorm": SequenceParallel(use_local_output=True)}
    return plan


class _EnterRegion(torch.autograd.Function):
    """Megatron's entry into a tensor-parallel region, on plain tensors: with sequence parallelism
    all-gather the sequence forward and reduce-scatter the summed input gradient backward;
    without, identity forward and all-reduce backward. One collective per region each way,
    however many column-parallel projections read the input (q, k, v; MLA's down-projections)."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        return funcol.all_gather_tensor(x.contiguous(), 1, group) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 1, ctx.group), None, None
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None, None


def _hf_regions(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, colwise: list[str]) -> None:
    """Enter a tensor-parallel region at the input of attention and of the dense MLP or shared
    experts (an MoE layer's router and routed experts take the rank's own tokens), and let the
    column-parallel linears compute on plain local tensors inside it."""
    group = mesh.get_group()

    def enter(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": _EnterRegion.apply(kwargs["hidden_states"], group, sequence_parallel)}
        else:
            args = (_EnterRegion.apply(args[0], group, sequence_parallel), *args[1:])
        return args, kwargs

    moe = any(".experts" in f".{n}" for n, _ in block.mlp.named_modules() if n)
    regions = [block.self_attn] + ([block.mlp] if not moe else [getattr(block.mlp, "shared_experts", None)])
    for region in filter(None, regions):
        region.register_forward_pre_hook(enter, with_kwargs=True)
    for name in colwise:
        linear = block.get_submodule(name)
        linear.forward = types.MethodType(lambda self, x, mesh=mesh: _local_linear(self, x, mesh), linear)


def _local_linear(self, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A column-parallel linear on the plain input the region entry made whole (ColwiseParallel's
    input hook wraps it as a replicated DTensor, whose gradient then needs no collective of its own)."""
    local = x.to_local() if isinstance(x, DTensor) else x
    bias = self.bias.to_local() if self.bias is not None else None
    return DTensor.from_local(F.linear(local, self.weight.to_local(), bias), mesh, [Shard(-1)], run_check=False)


def apply_tensor_parallel(chunk: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard ``chunk`` (a ModelChunk or an hf.HFChunk) in place over the 1-D tensor-parallel ``mesh``."""
    hf = getattr(chunk, "hf", False)
    for block in chunk.blocks:
        plan = _hf_block_plan(block, chunk.hf_tp_plan, sequence_parallel) if hf else _block_plan(block, sequence_parallel)
        parallelize_module(block, mesh, plan)
        if hf:
            colwise = [n for n, (style, _) in hf_linear_styles(block, chunk.hf_tp_plan).items() if style == "colwise"]
            _hf_regions(block, mesh, sequence_parallel, colwise)
        elif sequence_parallel:
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
    def forward(ctx, x_shard, weight, bias, group, hook):
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.hook, ctx.has_bias = group, hook, bias is not None
        return F.linear(funcol.all_gather_tensor(x_shard, 1, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        with ctx.hook():
            x = funcol.all_gather_tensor(x_shard, 1, ctx.group)
        grad_x = funcol.reduce_scatter_tensor(grad.matmul(weight), "sum", 1, ctx.group)
        grad_w = grad.flatten(0, -2).t().matmul(x.flatten(0, -2))
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None


def gather_in_linear(linear: torch.nn.Linear, mesh: DeviceMesh, hook) -> None:
    """Make a ColwiseParallel linear take the sequence shard and gather it itself (see above)."""
    group = mesh.get_group()

    def forward(self, x):
        local = x.to_local() if isinstance(x, DTensor) else x  # the hook only wrapped the shard
        bias = self.bias.to_local() if self.bias is not None else None
        y = _GatherLinear.apply(local, self.weight.to_local(), bias, group, hook)
        return DTensor.from_local(y, mesh, [Shard(-1)], run_check=False)

    linear.forward = types.MethodType(forward, linear)
