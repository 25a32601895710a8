"""Fused kernels the training frameworks Echo stands for run where eager PyTorch on a CPU runs a
chain of small ops: RMSNorm (Transformer Engine's fused norm under Megatron-Core; PyTorch's
``_fused_rms_norm`` on CUDA, which on the tracing CPU decomposes into pow / mean / rsqrt / mul in
fp32) and rotary position embeddings (Megatron's ``apply_rope_fusion``; one kernel per tensor
where transformers' ``rotate_half`` runs slice, neg, cat, two muls and an add).

Each is a custom op (``echo::rms_norm``, ``echo::rope`` and their backwards) so that the trace
records one kernel reading its inputs and writing its outputs once, which is what the GPU runs;
their CPU implementations compute the real values (the measure stage trains for real). DTensor
inputs (sequence-parallel norms, tensor-parallel attention heads) run on their local shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial


# --- RMSNorm ------------------------------------------------------------------------------------
@torch.library.custom_op("echo::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x / rms(x) * weight over the last dim (fp32 statistics), and the per-row 1/rms."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("echo::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of rms_norm in one pass over grad and x."""
    xf, gf = x.float(), grad.float()
    xhat = xf * rstd
    gw = gf * weight.float()
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(grad.contiguous(), x, weight, rstd)
    return dx, dw, None


rms_norm.register_autograd(_norm_backward, setup_context=_norm_setup)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm on plain or DTensor inputs (a sequence-parallel norm: the shard's rows, the
    replicated weight's gradient partial over the group, as DTensor's own norm leaves it)."""
    if not isinstance(x, DTensor):
        return rms_norm(x, weight.to_local() if isinstance(weight, DTensor) else weight, eps)[0]
    w = weight.to_local(grad_placements=[Partial()]) if isinstance(weight, DTensor) else weight
    y = rms_norm(x.to_local(), w, eps)[0]
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False)


def is_rms_norm(m: nn.Module) -> bool:
    """A standard RMSNorm module: transformers' *RMSNorm (weight x x / rms(x), weight 1-D; not
    Gemma's 1 + weight) or torch's nn.RMSNorm."""
    name = type(m).__name__
    if isinstance(m, nn.RMSNorm):
        return m.weight is not None and m.weight.dim() == 1
    return (name.endswith("RMSNorm") and not name.startswith("Gemma") and hasattr(m, "variance_epsilon")
            and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every standard RMSNorm of ``model`` the fused kernel; returns how many."""
    n = 0
    for m in model.modules():
        if is_rms_norm(m) and "forward" not in m.__dict__:
            eps = m.variance_epsilon if hasattr(m, "variance_epsilon") else (m.eps or torch.finfo(torch.float32).eps)
            m.forward = (lambda self, x, eps=eps: fused_rms_norm(x, self.weight, eps)).__get__(m)
            n += 1
    return n


# --- rotary position embeddings ------------------------------------------------------------
@torch.library.custom_op("echo::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (inverse: with -sin, the backward), cos / sin broadcast."""
    x1, x2 = x.chunk(2, dim=-1)
    s = -sin if inverse else sin
    return x * cos + torch.cat((-x2, x1), dim=-1) * s


@rope.register_fake
def _(x, cos, sin, inverse):
    return torch.empty_like(x)


def _rope_setup(ctx, inputs, output):
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    # rotate_half is antisymmetric and sin repeats over the two halves: the adjoint is the
    # rotation by the opposite angle
    return rope(grad.contiguous(), cos, sin, not ctx.inverse), None, None, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup)


def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope on plain or DTensor x (tensor-parallel heads: the local heads, same placements)."""
    cos, sin = (t.to(x.dtype) for t in (cos, sin))
    if isinstance(x, DTensor):
        y = rope(x.to_local().contiguous(), cos, sin, False)
        return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False)
    return rope(x.contiguous(), cos, sin, False)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1):
    """transformers' standard apply_rotary_pos_emb (rotate_half RoPE), one fused kernel per tensor."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return fused_rope(q, cos, sin), fused_rope(k, cos, sin)


# --- SwiGLU -----------------------------------------------------------------------------------
@torch.library.custom_op("echo::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass (Megatron's bias_swiglu_fusion; TE's swiglu)."""
    return torch.nn.functional.silu(gate) * up


@swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("echo::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of swiglu in one pass over grad, gate and up."""
    g = gate.float()
    sig = torch.sigmoid(g)
    dup = grad.float() * g * sig
    dgate = grad.float() * up.float() * sig * (1 + g * (1 - sig))
    return dgate.to(gate.dtype), dup.to(up.dtype)


@swiglu_backward.register_fake
def _(grad, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return swiglu_backward(grad.contiguous(), gate, up)


swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """swiglu on plain or DTensor inputs (column-parallel outputs: the local shards)."""
    if isinstance(gate, DTensor):
        y = swiglu(gate.to_local().contiguous(), up.to_local().contiguous())
        return DTensor.from_local(y, gate.device_mesh, gate.placements, run_check=False)
    return swiglu(gate.contiguous(), up.contiguous())


def is_swiglu_mlp(m: nn.Module) -> bool:
    """transformers' gated MLP (gate_proj, up_proj, down_proj, a SiLU act_fn)."""
    return (all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))


def fuse_swiglu_mlps(model: nn.Module) -> int:
    """down_proj(swiglu(gate_proj(x), up_proj(x))) for every gated SiLU MLP of ``model``."""
    n = 0
    for m in model.modules():
        if is_swiglu_mlp(m) and "forward" not in m.__dict__:
            m.forward = (lambda self, x: self.down_proj(fused_swiglu(self.gate_proj(x), self.up_proj(x)))).__get__(m)
            n += 1
    return n


# --- routed experts' weighted gated activation -----------------------------------------------
# Megatron-Core's grouped experts apply the routing probability inside the fused activation
# (weighted_bias_swiglu_impl; weighted_bias_quick_geglu_impl for GPT-OSS's clamped gate with
# glu_linear_offset 1): one kernel keeps its input (the fc1 output) and the per-row weights, and
# the combine after the experts is a plain sum that keeps nothing.
GLU_KINDS = ("swiglu", "clamped")


def _glu_reference(x: torch.Tensor, w: torch.Tensor, kind: str, limit: float, alpha: float,
                   offset: float) -> torch.Tensor:
    if kind == "swiglu":  # [gate | up] halves: silu(gate) * up
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up * w
    # GPT-OSS (transformers' layout, gate and up interleaved): (clamp(up) + offset) * g * sigmoid(alpha g)
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + offset) * (gate * torch.sigmoid(gate * alpha)) * w


@torch.library.custom_op("echo::weighted_glu", mutates_args=())
def weighted_glu(x: torch.Tensor, w: torch.Tensor, kind: str, limit: float, alpha: float,
                 offset: float) -> torch.Tensor:
    """The gated activation of ``x`` ([rows, 2f]) times the rows' routing weights ``w`` ([rows, 1])."""
    return _glu_reference(x.float(), w.float(), kind, limit, alpha, offset).to(x.dtype)


@weighted_glu.register_fake
def _(x, w, kind, limit, alpha, offset):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("echo::weighted_glu_backward", mutates_args=())
def weighted_glu_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, kind: str, limit: float,
                          alpha: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of weighted_glu in one pass over grad, x and w."""
    g, xf, wf = grad.float(), x.float(), w.float()
    if kind == "swiglu":
        gate, up = xf.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        act = gate * sig
        dgate = g * up * wf * sig * (1 + gate * (1 - sig))
        dup = g * act * wf
        dx = torch.cat((dgate, dup), dim=-1)
        dw = (g * act * up).sum(-1, keepdim=True)
    else:
        gate, up = xf[..., ::2], xf[..., 1::2]
        gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(gc * alpha)
        act = gc * sig
        # clamp passes the gradient where the input is within its bounds
        dgate = g * (uc + offset) * wf * (sig + alpha * gc * sig * (1 - sig)) * (gate <= limit)
        dup = g * act * wf * ((up >= -limit) & (up <= limit))
        dx = torch.stack((dgate, dup), dim=-1).flatten(-2)
        dw = (g * (uc + offset) * act).sum(-1, keepdim=True)
    return dx.to(x.dtype), dw.to(w.dtype)


@weighted_glu_backward.register_fake
def _(grad, x, w, kind, limit, alpha, offset):
    return torch.empty_like(x), torch.empty_like(w)


def _glu_setup(ctx, inputs, output):
    x, w, *ctx.args = inputs
    ctx.save_for_backward(x, w)


def _glu_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return (*weighted_glu_backward(grad.contiguous(), x, w, *ctx.args), None, None, None, None)


weighted_glu.register_autograd(_glu_backward, setup_context=_glu_setup)


def fused_weighted_glu(x: torch.Tensor, w: torch.Tensor, kind: str = "swiglu", limit: float = 0.0,
                       alpha: float = 1.0, offset: float = 0.0) -> torch.Tensor:
    """weighted_glu on plain tensors (routed experts are not tensor-parallel); ``w`` broadcast
    over the last dim (shape [..., rows, 1])."""
    if kind not in GLU_KINDS:
        raise ValueError(f"gated activation '{kind}' is not one of {GLU_KINDS}")
    return weighted_glu(x.contiguous(), w.to(x.dtype).contiguous(), kind, float(limit), float(alpha), float(offset))


# --- cross entropy ------------------------------------------------------------------------------
@torch.library.custom_op("echo::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and the logits' gradient (softmax - one-hot, in the logits' dtype) in one
    pass over the logits, fp32 only in registers: Megatron's --cross-entropy-loss-fusion
    (Transformer Engine's parallel_cross_entropy writes the gradient during the forward)."""
    lf = logits.float()
    loss = torch.nn.functional.cross_entropy(lf.flatten(0, -2), labels.flatten(), reduction="none")
    grad = torch.softmax(lf, -1)
    grad.scatter_add_(-1, labels.unsqueeze(-1), -torch.ones_like(labels, dtype=grad.dtype).unsqueeze(-1))
    return loss.view(labels.shape), grad.to(logits.dtype)


@cross_entropy.register_fake
def _(logits, labels):
    return logits.new_empty(labels.shape, dtype=torch.float32), torch.empty_like(logits)


def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _ce_backward(ctx, grad_loss, _grad_grad):
    (grad,) = ctx.saved_tensors
    return grad * grad_loss.unsqueeze(-1).to(grad.dtype), None


cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)


def fused_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean loss by ``cross_entropy``; on vocabulary-parallel DTensor logits the local shard, with
    the two small all-reduces over the tensor-parallel group Megatron's fused kernel makes (the
    rows' max, then their sum of exponentials and target logit)."""
    import torch.distributed as dist

    if isinstance(logits, DTensor):
        group = logits.device_mesh.get_group()
        local = logits.to_local()
        rows = local.shape[:-1]
        dist.all_reduce(local.new_empty(rows, dtype=torch.float32), op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(local.new_empty((*rows, 2), dtype=torch.float32), group=group)
        logits = local
    return cross_entropy(logits, labels)[0].mean()
