"""Megatron-style tensor and sequence parallelism for transformers' decoder layers.

transformers keeps q, k and v (and gate and up) as separate linears that all read the layer's
normed input; Megatron fuses them, so it enters a tensor-parallel region once per attention and
once per MLP. Echo does the same around transformers' modules: a region entry at the input of
attention and of the dense MLP or shared experts (an MoE layer's router and routed experts take
the rank's own tokens) all-gathers the sequence shard (sequence parallelism; identity without)
and, backward, reduce-scatters (all-reduces) the summed input gradient: one collective each way
however many projections read the input. Inside, the linears compute on plain local tensors.

With sequence parallelism, as Megatron-LM, the gathered input is not kept for backward: the
linears that read it save the rank's shard and the first of them to run backward gathers it
again (recorded as recompute), which the others reuse.

In FP8 (a region whose linears all run in FP8), as Transformer Engine's sequence-parallel
LayerNormLinear: the shard is quantized once (current scaling all-reduces its amax over the TP
group first, so that the gathered tensor has one scale), the FP8 shard is all-gathered (half the
bytes of bf16) and every linear of the region runs its forward GEMM on it; backward the saved
FP8 shard (1 byte per element, not the bf16 one) is gathered again and transposed once for the
weight gradients. The module itself receives a storage-less stand-in of the gathered input's
shape: its linears read the FP8 copy, as in Megatron nothing reads a bf16 gathered input.
"""

from __future__ import annotations

import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from echo.training import fp8

# transformers' linear names -> style, where a model's own tp_plan does not cover them (DeepSeek's
# has no attention entries): the up-projections of attention (MLA's q_b_proj / kv_b_proj after
# its replicated low-rank down-projections) and of the MLP are column-parallel, their output
# projections row-parallel, as Megatron-Core shards them
_DERIVED = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "q_b_proj": "colwise",
            "kv_b_proj": "colwise", "gate_proj": "colwise", "up_proj": "colwise",
            "o_proj": "rowwise", "down_proj": "rowwise"}


def linear_styles(block: nn.Module, model_plan: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Linear of a decoder layer -> (colwise | rowwise, "model" | "derived"): the model's own
    ``base_model_tp_plan`` entries that name a linear of this layer, then the derived style of
    every other known linear. Routed experts are not tensor-parallel (Megatron-Core's expert
    tensor parallel size 1); other linears (routers, MLA's down-projections) stay replicated."""
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


class _Region:
    """One entry into a tensor-parallel region during one forward: the shard it gathered, and
    the gathered input backward re-creates once for every linear that read it."""

    def __init__(self, shard: torch.Tensor | None, gathered: torch.Tensor, group, hook, fp8_input=None):
        self.shard, self.group, self.hook = shard, group, hook
        self.storage = gathered.untyped_storage()._cdata
        self.readers, self.again = 0, None
        # FP8: (FP8 shard, its scale, the gathered FP8 input while forward readers remain, their count)
        self.fp8_input = fp8_input

    def reads(self, x: torch.Tensor) -> bool:
        return x.untyped_storage()._cdata == self.storage

    def regather(self) -> torch.Tensor:
        if self.again is None:
            with self.hook():
                self.again = funcol.all_gather_tensor(self.shard, 1, self.group)
        return self._release()

    def regather_fp8(self, s, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The saved FP8 shard gathered again and transposed for the weight-gradient GEMMs."""
        if self.again is None:
            with self.hook():
                self.again = fp8.regather_transposed(s, self.fp8_input[0], self.group, hidden)
        return self._release()

    def forward_fp8(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gathered FP8 input, its scale, the FP8 shard) for one forward reader; the gathered
        copy is dropped after the region's last reader, as Transformer Engine's is."""
        q, sq, x8, left = self.fp8_input
        self.fp8_input = (q, sq, x8 if left > 1 else None, left - 1)
        return x8, sq, q

    def _release(self):
        out = self.again
        self.readers -= 1
        if not self.readers:
            self.again = None  # the last reader is done with it
        return out


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel):
        ctx.group, ctx.sp = group, sequence_parallel
        return funcol.all_gather_tensor(x.contiguous(), 1, group) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 1, ctx.group), None, None
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None, None


class _EnterFP8(torch.autograd.Function):
    """A sequence-parallel region entry whose linears run in FP8 (module docstring): quantize the
    shard, all-gather it in FP8; backward reduce-scatters the summed input gradient as ``_Enter``."""

    @staticmethod
    def forward(ctx, x, group, s, readers, out: list):
        ctx.group, (b, n, h) = group, x.shape
        q, _, x8, sx = fp8.gather_shard(s, x.contiguous().reshape(b * n, h), group)
        out.append((q, sx, x8, readers))  # the region's fp8_input
        # the gathered input's shape without storage: the region's linears read x8
        return x.new_empty((1, 1, 1)).expand(b, n * (x8.shape[0] // q.shape[0]), h)

    @staticmethod
    def backward(ctx, grad):
        return funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 1, ctx.group), None, None, None, None


class _RegatherLinear(torch.autograd.Function):
    """y = x @ W^T (+ b) where x is a region's gathered input, saving only the region's shard."""

    @staticmethod
    def forward(ctx, x, weight, bias, region, fp8_state):
        region.readers += 1
        ctx.region, ctx.has_bias, ctx.fp8 = region, bias is not None, fp8_state
        if region.fp8_input is not None:  # the region gathered FP8: read it, keep the FP8 shard
            x8, sx, q = region.forward_fp8()
            ctx.save_for_backward(q, weight)
            y = fp8.forward_gemm(fp8_state, (x8, sx), weight)
            y = y + bias if bias is not None else y
            return y.view(*x.shape[:-1], y.shape[-1])
        ctx.save_for_backward(region.shard, weight)
        if fp8_state is None:
            return F.linear(x, weight, bias)
        # FP8: the gathered input is quantized row-wise only; backward quantizes the regathered one
        q, sq, _, _ = fp8.quantize_input(fp8_state, x.reshape(-1, x.shape[-1]), columnwise=False)
        y = fp8.forward_gemm(fp8_state, (q, sq), weight)
        y = y + bias if bias is not None else y
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        _, weight = ctx.saved_tensors
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        if ctx.region.fp8_input is not None:
            xt = ctx.region.regather_fp8(ctx.fp8, weight.shape[1])
            grad_x, grad_w = fp8.backward_gemms(ctx.fp8, grad.flatten(0, -2), xt, weight, True, True)
            return grad_x.view(*grad.shape[:-1], -1), grad_w, grad_b, None, None
        x = ctx.region.regather()
        if ctx.fp8 is not None:
            _, _, qt, sqt = fp8.quantize_input(ctx.fp8, x.flatten(0, -2), rowwise=False)
            grad_x, grad_w = fp8.backward_gemms(ctx.fp8, grad.flatten(0, -2), (qt, sqt), weight, True, True)
            return grad_x.view(*grad.shape[:-1], -1), grad_w, grad_b, None, None
        grad_x = grad.matmul(weight)
        grad_w = grad.flatten(0, -2).t().matmul(x.flatten(0, -2))
        return grad_x, grad_w, grad_b, None, None


def _linear(self: nn.Linear, x: torch.Tensor, mesh: DeviceMesh, colwise: bool) -> torch.Tensor:
    """A column-parallel or replicated linear inside a region, on plain local tensors
    (ColwiseParallel's input hook wraps x as a replicated DTensor; its gradient needs no
    collective of its own, the region's exit has it). A column-parallel linear that reads
    something else than the region's input (MLA's q_b_proj / kv_b_proj after the replicated
    down-projections) enters a region of its own, as Megatron's ColumnParallelLinear: its input
    gradient is all-reduced, so that the down-projection's weight gradient is whole."""
    local = x.to_local() if isinstance(x, DTensor) else x
    region = getattr(self, "echo_region", None)
    if colwise and not (region is not None and region.reads(local)) and getattr(self, "echo_inner", False):
        local = _Enter.apply(local, mesh.get_group(), False)
    weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
    bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
    if region is not None and region.reads(local):
        y = _RegatherLinear.apply(local, weight, bias, region, fp8.active() if getattr(self, "echo_fp8", False) else None)
    else:
        y = fp8.linear(self, local, weight, bias)
    return DTensor.from_local(y, mesh, [Shard(-1)], run_check=False) if colwise else y


def parallelize_hf_block(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, model_plan: dict[str, str]) -> None:
    """Shard one transformers decoder layer in place over the 1-D tensor-parallel ``mesh``."""
    styles = linear_styles(block, model_plan)
    out = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan = {n: ColwiseParallel() if style == "colwise" else RowwiseParallel(**out) for n, (style, _) in styles.items()}
    if sequence_parallel:  # the norms run on the shard; their weight gradients are all-reduced
        plan |= {"input_layernorm": SequenceParallel(use_local_output=True),
                 "post_attention_layernorm": SequenceParallel(use_local_output=True)}
    parallelize_module(block, mesh, plan)
    group, hook = mesh.get_group(), getattr(block, "hook", None)
    moe = any(".experts" in f".{n}" for n, _ in block.mlp.named_modules() if n)
    regions = [block.self_attn] + ([block.mlp] if not moe else [getattr(block.mlp, "shared_experts", None)])
    for module in filter(None, regions):
        readers = [m for n, m in module.named_modules() if isinstance(m, nn.Linear)
                   and styles.get(_name_in(block, m), ("replicated",))[0] != "rowwise" and ".experts." not in f".{n}."]
        module.register_forward_pre_hook(_entry(group, sequence_parallel, hook, readers), with_kwargs=True)
        # a region with replicated linears (MLA's down-projections) has column-parallel linears
        # that read their output, not the region's input
        inner = any(styles.get(_name_in(block, m), ("",))[0] != "colwise" for m in readers)
        for m in readers:
            colwise = styles.get(_name_in(block, m), ("",))[0] == "colwise"
            m.echo_inner = inner
            m.forward = types.MethodType(lambda self, x, c=colwise: _linear(self, x, mesh, c), m)
    for m in (m for module in filter(None, regions) for m in module.modules()):
        for param in m.parameters(recurse=False):
            # read the whole sequence inside a region: not partial over tp (data_parallel's
            # sequence-parallel gradient all-reduce leaves them out)
            param.echo_tp_whole = not isinstance(param, DTensor)


def _name_in(block: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in block.named_modules() if m is module)


def _entry(group, sequence_parallel: bool, hook, readers: list[nn.Module]):
    """The forward pre-hook entering a region (hidden_states as transformers passes it: by
    keyword to attention, positionally to an MLP)."""
    all_fp8 = bool(readers) and all(getattr(m, "echo_fp8", False) for m in readers)

    def enter(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        s = fp8.active()
        if sequence_parallel and hook is not None and s is not None and all_fp8:
            gathered: list = []
            y = _EnterFP8.apply(x, group, s, len(readers), gathered)
            region = _Region(None, y, group, hook, fp8_input=gathered[0])
        else:
            y = _Enter.apply(x, group, sequence_parallel)
            region = _Region(x.contiguous(), y, group, hook) if sequence_parallel and hook is not None else None
        for m in readers:
            m.echo_region = region
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": y}
        return (y, *args[1:]), kwargs
    return enter
