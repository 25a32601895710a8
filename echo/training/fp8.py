"""FP8 (and FP4) linear layers, run the way Transformer Engine runs them under Megatron-Core and
torchao's Float8Linear under torchtitan (``training.dtype: fp8``, ``training.fp8_recipe``).

Only the linear layers of the transformer blocks run in low precision (attention projections, MLP
and expert projections); the embedding, the LM head, the router, norms, the attention core and the
optimizer stay as they are (bf16 compute, fp32 master weights). For each such linear, per
micro-batch:

- forward: the input is quantized (``echo::quantize``: one kernel reading bf16 and writing the
  FP8 data, its transpose or column-wise copy for the weight gradient, and the scales), then
  ``aten._scaled_mm`` (FP8 x FP8 -> bf16);
- backward: the output gradient is quantized the same way, then two ``_scaled_mm``: the data
  gradient (gradient x weight) and the weight gradient (gradient^T x input);
- the weights' FP8 copies: Megatron (ZeRO 0-2) casts each weight once per step, on the first
  micro-batch, and keeps the copies (and on Hopper their transposes) across micro-batches; the
  tracer records that cast once, after the optimizer step (phase optimizer), where a step's cast
  costs the same. FSDP (ZeRO 3, torchtitan) casts the gathered weight in every forward and again
  in backward (torchao keeps no FP8 weight between them).

The recipes (``RECIPES``) differ in formats, scale granularity and amax traffic:
- delayed: E4M3 forward, E5M2 gradients (TE's HYBRID format), one fp32 scale per tensor from an
  amax history; the quantize kernel also writes the amax, and at the end of each chunk's forward
  and backward the amaxes are all-reduced (max) over the amax reduction group (tp x cp x dp ranks
  of a stage, Megatron-Core's default);
- current: per-tensor scales from the tensor's own amax: an amax kernel (a full read) before each
  quantize; under sequence parallelism the input shard's amax is all-reduced over the TP group
  before quantizing, so that the gathered FP8 input has one scale (TE's current-scaling
  quantizer), and the input is all-gathered in FP8;
- mxfp8: E4M3 with one E8M0 scale per 1x32 block (Blackwell), row-wise and column-wise copies
  (the blocks follow the reduction dimension, so the weight gradient needs its own);
- blockwise: E4M3 with fp32 scales per 1x128 block of activations and gradients and per 128x128
  tile of weights (DeepSeek-V3);
- nvfp4: E2M1 values packed two per byte with one E4M3 scale per 1x16 block (16x16 tiles for
  weights; Blackwell). TE's random Hadamard transform of the weight-gradient inputs is fused into
  their quantize kernel.

Per-tensor FP8 GEMMs on Hopper take only the TN layout, so per-tensor and blockwise recipes write
transposed copies; mxfp8 and nvfp4 write column-wise copies of the same size instead.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

E4M3, E5M2, E8M0, FP4 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2


@dataclass(frozen=True)
class Recipe:
    """How one FP8 recipe quantizes."""

    name: str
    forward: torch.dtype      # activations and weights
    backward: torch.dtype     # output gradients
    block: int                # 1 x block scales of activations and gradients along the reduction dim; 0 = per tensor
    weight_tile: int          # tile x tile scales of weights; 0 = as activations (1 x block or per tensor)
    scale: torch.dtype        # dtype of the scales
    amax: str                 # history (reduced per chunk) | current (a pass before each quantize) | none

    @property
    def packed(self) -> int:
        """Values per stored element (FP4 packs two per byte)."""
        return 2 if self.forward == FP4 else 1


RECIPES = {
    "delayed": Recipe("delayed", E4M3, E5M2, 0, 0, torch.float32, "history"),
    "current": Recipe("current", E4M3, E5M2, 0, 0, torch.float32, "current"),
    "mxfp8": Recipe("mxfp8", E4M3, E4M3, 32, 0, E8M0, "none"),
    "blockwise": Recipe("blockwise", E4M3, E4M3, 128, 128, torch.float32, "none"),
    "nvfp4": Recipe("nvfp4", FP4, FP4, 16, 16, E4M3, "current"),
}


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _scale_shape(r: Recipe, rows: int, cols: int, weight: bool) -> tuple[int, ...]:
    """Scales of a (rows, cols) operand quantized along cols, in the layout ``_scaled_mm`` takes:
    MX / NV block scales swizzled into 128 x 4 tiles (flat), blockwise fp32 scales (rows, cols/128)
    or per 128 x 128 tile, per-tensor a scalar."""
    if r.block == 0:
        return ()
    if r.scale != torch.float32:  # MX / NVFP4: cuBLAS's swizzled, padded block-scale layout
        return (_round_up(rows, 128) * _round_up(cols // r.block, 4),)
    if weight and r.weight_tile:
        return (rows // r.weight_tile, cols // r.weight_tile)
    return (rows, cols // r.block)


# --- the quantize kernel ----------------------------------------------------------------------
@torch.library.custom_op("echo::quantize", mutates_args=())
def quantize(x: torch.Tensor, dtype: torch.dtype, recipe: str, weight: bool, rowwise: bool,
             columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fused kernel: read the 2-D bf16 ``x`` once, write its ``dtype`` copy (rowwise), its
    transposed or column-wise copy (columnwise) and their scales. Outputs: (data, scales,
    data^T, scales^T), the ones not asked for empty."""
    return _quantized(x, dtype, recipe, weight, rowwise, columnwise, real=True)


@quantize.register_fake
def _(x, dtype, recipe, weight, rowwise, columnwise):
    return _quantized(x, dtype, recipe, weight, rowwise, columnwise, real=False)


def _quantized(x, dtype, recipe, weight, rowwise, columnwise, real):
    r, (m, k) = RECIPES[recipe], x.shape
    none = x.new_empty((0,), dtype=dtype)

    def data(t: torch.Tensor) -> torch.Tensor:
        rows, cols = t.shape
        if real and dtype != FP4:  # the CPU's real cast (the local device runs traces for real)
            return t.to(dtype)
        return t.new_empty((rows, cols // r.packed), dtype=dtype)

    def scales(rows: int, cols: int) -> torch.Tensor:
        return x.new_empty(_scale_shape(r, rows, cols, weight), dtype=r.scale)

    q, s = (data(x), scales(m, k)) if rowwise else (none, x.new_empty((0,), dtype=r.scale))
    qt, st = (data(x.t()), scales(k, m)) if columnwise else (none, x.new_empty((0,), dtype=r.scale))
    if real and r.block == 0:
        s, st = (t.new_ones(t.shape) for t in (s, st))
    return q, s, qt, st


# --- which linears, and the step's state ------------------------------------------------------
@dataclass
class State:
    """What the FP8 linears of one traced rank share."""

    recipe: Recipe
    zero: int                             # ZeRO stage: 3 casts weights per pass (FSDP), else once per step
    fp8_gather: bool = False              # the distributed optimizer all-gathers FP8 parameters
    tp_group: object = None               # for current scaling's amax all-reduce of sequence shards
    amax_group: object = None             # delayed scaling's per-chunk amax reduction (tp x cp x dp)
    weights: dict = field(default_factory=dict)     # weight storage -> (weight, its cached FP8 copies)
    amaxes: int = 0                       # tensors quantized since the last amax reduction
    inputs: dict = field(default_factory=dict)      # activations quantized in this chunk's pass

    @property
    def cached_weights(self) -> bool:
        return self.zero < 3


_STATE: list[State | None] = [None]


def active() -> State | None:
    return _STATE[0]


@contextmanager
def training(recipe: str | None, zero: int, *, fp8_gather: bool = False, tp_group=None, amax_group=None):
    """Run FP8 linears under ``recipe`` (None: off) for the duration of one traced step."""
    if recipe is None:
        yield None
        return
    _STATE[0] = State(RECIPES[recipe], zero, fp8_gather, tp_group, amax_group)
    try:
        yield _STATE[0]
    finally:
        _STATE[0] = None


def mark_linears(block: nn.Module, skip: tuple[str, ...] = ("gate", "router")) -> list[str]:
    """Tag the linears of a transformer block that run in FP8 (``echo_fp8``): every nn.Linear but
    a MoE router (Megatron runs the router in high precision). Returns their names."""
    names = []
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] not in skip:
            m.echo_fp8 = True
            names.append(name)
    return names


def _check_dims(r: Recipe, shape) -> None:
    """FP8 GEMMs need weight dimensions the recipe's blocks divide (TE asserts % 16 for
    per-tensor FP8), on each rank's shard after tensor parallelism."""
    need = max(16, r.block, r.weight_tile)
    if any(d % need for d in shape):
        raise ValueError(f"an FP8 linear's local weight {tuple(shape)} (after tensor parallelism) has a dimension "
                         f"not divisible by {need}, which fp8_recipe {r.name} needs: use a larger model or tp")


def patch_linears(chunk: nn.Module) -> None:
    """Give every ``echo_fp8`` linear of ``chunk`` whose forward is still nn.Linear's the FP8
    forward (plain or DTensor-sharded weights). Linears whose forward tensor parallelism
    replaced call ``linear`` themselves."""
    for m in chunk.modules():
        if getattr(m, "echo_fp8", False) and "forward" not in m.__dict__:
            m.forward = _module_forward.__get__(m)


def _module_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(self.weight, DTensor):
        return linear(self, x, self.weight, self.bias)
    # ColwiseParallel (weight Shard(0), input replicated) or RowwiseParallel (Shard(1), input
    # sharded on its last dim): the local GEMM, its output sharded or partial as DTensor's
    # would be; the module's output hooks then redistribute as before
    mesh, rowwise = self.weight.device_mesh, self.weight.placements[0] == Shard(1)
    local = x.to_local() if isinstance(x, DTensor) else x
    bias = self.bias.to_local() if self.bias is not None else None
    # a row-parallel bias joins the partial sums once per rank here; bytes and kernels match
    y = linear(self, local, self.weight.to_local(), bias)
    return DTensor.from_local(y, mesh, [Partial() if rowwise else Shard(-1)], run_check=False)


def linear(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ b) on local tensors: in FP8 when ``module`` is an FP8 linear and a recipe is on."""
    s = active()
    if s is None or not getattr(module, "echo_fp8", False):
        return F.linear(x, weight, bias)
    return _FP8Linear.apply(x, weight, bias, s)


# --- forward and backward pieces (also used inside tensor parallelism's own autograd functions) ---
def quantize_input(s: State, x2d: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True):
    """(data, scale, data^T, scale^T) of an activation, with the recipe's amax pass. Linears that
    read the same tensor (transformers' separate q/k/v and gate/up projections, which Megatron
    fuses into one linear) share one quantization of it."""
    key = (x2d.untyped_storage()._cdata, x2d.storage_offset(), tuple(x2d.shape), rowwise, columnwise)
    hit = s.inputs.get(key)
    if hit is not None and hit[0]() is not None:
        return hit[1]
    # entries live as long as their source tensor (a weak reference: a freed tensor's storage id
    # may be reused, and its copies must not outlive it in the tracer's memory accounting)
    s.inputs = {k: v for k, v in s.inputs.items() if v[0]() is not None}
    _amax(s, x2d)
    out = quantize(x2d, s.recipe.forward, s.recipe.name, False, rowwise, columnwise)
    s.inputs[key] = (weakref.ref(x2d._base if x2d._base is not None else x2d), out)
    return out


def quantize_grad(s: State, g2d: torch.Tensor):
    _amax(s, g2d)
    return quantize(g2d, s.recipe.backward, s.recipe.name, False, True, True)


def amax_reduce_tp(s: State, x2d: torch.Tensor) -> None:
    """Current scaling of a sequence shard about to be gathered: one scale for the whole tensor."""
    if s.recipe.amax == "current" and s.tp_group is not None:
        amax = torch.linalg.vector_norm(x2d, float("inf")).float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=s.tp_group)


def gather_shard(s: State, shard2d: torch.Tensor, group):
    """Transformer Engine's sequence-parallel FP8 input: the shard quantized once (current scaling
    all-reduces its amax over the TP group first, so the gathered tensor has one scale) and
    all-gathered in FP8. Returns (FP8 shard, its scales, gathered FP8 input, the gathered input's
    scales): block scales follow the rows (their bytes, 1/16-1/32 of the data's, travel with it
    and are not recorded as a collective of their own), a per-tensor scale is the shard's."""
    amax_reduce_tp(s, shard2d)
    q, sq, _, _ = quantize_input(s, shard2d, columnwise=False)
    x8 = funcol.all_gather_tensor(q, 0, group)
    sx = sq.new_empty(_scale_shape(s.recipe, x8.shape[0], shard2d.shape[1], False)) if s.recipe.block else sq
    return q, sq, x8, sx


def regather_transposed(s: State, q: torch.Tensor, group, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``gather_shard``: the saved FP8 shard gathered again and transposed (with its
    scales) for the weight-gradient GEMM (FP4 packs two values per byte)."""
    x8 = funcol.all_gather_tensor(q, 0, group)
    xt = x8.t().contiguous().reshape(hidden, -1)
    return xt, q.new_empty(_scale_shape(s.recipe, xt.shape[0], xt.shape[1] * s.recipe.packed, False), dtype=s.recipe.scale)


def _amax(s: State, t: torch.Tensor) -> None:
    s.amaxes += 1
    if s.recipe.amax == "current":  # a full read before the quantize kernel can scale
        torch.linalg.vector_norm(t, float("inf"))


def weight_copies(s: State, w: torch.Tensor, backward: bool = False):
    """(W, scale, W^T, scale^T) in FP8: cached once per step (ZeRO 0-2; cast in ``cast_weights``)
    or cast now (FSDP: the gathered weight, in forward and again in backward)."""
    r = s.recipe
    _check_dims(r, w.shape)
    if not s.cached_weights:
        _amax(s, w)
        return quantize(w, r.forward, r.name, True, not backward, backward)
    # by storage: tensor parallelism hands over a new local view of the same weight each call
    key = (w.untyped_storage()._cdata, w.storage_offset(), tuple(w.shape))
    if key not in s.weights:
        n, k = w.shape
        copies = (w.new_empty((n, k // r.packed), dtype=r.forward), w.new_empty(_scale_shape(r, n, k, True), dtype=r.scale),
                  w.new_empty((k, n // r.packed), dtype=r.forward), w.new_empty(_scale_shape(r, k, n, True), dtype=r.scale))
        s.weights[key] = (w, copies)
    return s.weights[key][1]


def cast_weights(s: State | None) -> None:
    """The once-per-step cast of every cached weight into its FP8 copies (ZeRO 0-2), recorded
    where the caller is (the optimizer phase). With FP8 parameter gathers the distributed
    optimizer wrote the row-wise copy; only the transposed / column-wise one is made here."""
    if s is None or not s.cached_weights:
        return
    for w, _ in s.weights.values():
        w = w.detach()
        _amax(s, w)
        if w.dim() == 3:  # routed experts' weights: E4M3 for the grouped GEMMs (expert_matmul)
            quantize(w.reshape(-1, w.shape[-1]), E4M3, "current", True, not s.fp8_gather, True)
        else:
            quantize(w, s.recipe.forward, s.recipe.name, True, not s.fp8_gather, True)


def reduce_amaxes(s: State | None) -> None:
    """Delayed scaling: the amaxes of the tensors quantized since the last call, all-reduced (max)
    over the amax group in one message (TE's global amax reduction), at the end of a chunk's
    forward or backward."""
    if s is None:
        return
    s.inputs.clear()  # a pass's quantized activations are not shared with another pass
    if s.recipe.amax != "history" or s.amaxes == 0:
        return
    buf = torch.empty(s.amaxes, dtype=torch.float32)
    s.amaxes = 0
    if s.amax_group is not None:
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=s.amax_group)


def gemm(a, sa, b_t, sb, out_dtype=torch.bfloat16) -> torch.Tensor:
    """a (M, K) row-major times b_t^T, b_t (N, K) row-major: the TN GEMM every FP8 kernel takes."""
    return torch._scaled_mm(a, b_t.t(), sa, _b_scale(sb), out_dtype=out_dtype)


def _b_scale(s: torch.Tensor) -> torch.Tensor:
    # blockwise scales of the second operand are indexed (K blocks, N blocks): the transpose of
    # how the operand's own quantize wrote them
    return s.t() if s.dim() == 2 else s


def forward_gemm(s: State, x2d_q, weight: torch.Tensor) -> torch.Tensor:
    q, sq = x2d_q
    w, sw, _, _ = weight_copies(s, weight)
    return gemm(q, sq, w, sw)


def backward_gemms(s: State, g2d: torch.Tensor, xt, weight: torch.Tensor, need_dx: bool, need_dw: bool):
    """(dx, dW): gradient x W and gradient^T x input, both from the gradient's one quantize."""
    g, sg, gt, sgt = quantize_grad(s, g2d)
    dx = dw = None
    if need_dx:
        _, _, wt, swt = weight_copies(s, weight, backward=True)
        dx = gemm(g, sg, wt, swt)
    if need_dw:
        q, sq = xt
        dw = gemm(gt, sgt, q, sq, out_dtype=g2d.dtype)
    return dx, dw


class _FP8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with FP8 GEMMs. Megatron (ZeRO 0-2) saves the input's transposed FP8 copy
    (1 byte per element); torchao under FSDP saves the bf16 input and casts it again in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, s):
        x2d = x.reshape(-1, x.shape[-1])
        keep_hp = not s.cached_weights
        q, sq, qt, sqt = quantize_input(s, x2d, columnwise=not keep_hp)
        y = forward_gemm(s, (q, sq), weight)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2d if keep_hp else qt, sqt, weight)
        ctx.s, ctx.has_bias, ctx.keep_hp, ctx.x_shape = s, bias is not None, keep_hp, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        saved, sqt, weight = ctx.saved_tensors
        s = ctx.s
        g2d = grad.reshape(-1, grad.shape[-1])
        if ctx.keep_hp:
            _, _, saved, sqt = quantize_input(s, saved, rowwise=False)
        dx, dw = backward_gemms(s, g2d, (saved, sqt), weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        db = g2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return (dx.view(ctx.x_shape) if dx is not None else None), dw, db, None


def cached_weight_bytes(s: State | None) -> int:
    """Bytes of the FP8 weight copies kept across micro-batches (ZeRO 0-2)."""
    if s is None or not s.cached_weights:
        return 0
    return sum(c.numel() * c.element_size() for _, copies in s.weights.values() for c in copies)


# --- routed experts: grouped GEMMs ------------------------------------------------------------
def expert_matmul(x: torch.Tensor, w_kn: torch.Tensor) -> torch.Tensor:
    """x @ w_kn in FP8 for routed experts (hf_moe): 2-D (one expert, a dense FP8 GEMM) or 3-D
    ([experts, rows, K] x [experts, K, N], one grouped GEMM over the local experts, as
    Transformer Engine's GroupedLinear). ``_scaled_grouped_mm`` takes E4M3 operands with row-wise
    scales only, so the grouped GEMMs are traced that way whatever the recipe (its block scales
    and FP4 values are not expressible there: the GEMMs' bytes and FLOPs are those of FP8)."""
    s = active()
    if x.dim() == 2:
        return _FP8Linear.apply(x, w_kn.t(), None, s)
    return _FP8Grouped.apply(x, w_kn.transpose(-1, -2), s)


def _grouped_weight(s: State, w: torch.Tensor, backward: bool):
    """(W [E, N, K], its scales, W^T [E, K, N], its scales) of a 3-D expert weight, E4M3."""
    e, n, k = w.shape
    key = (w.untyped_storage()._cdata, w.storage_offset(), tuple(w.shape))
    if not s.cached_weights or key not in s.weights:
        if not s.cached_weights:  # FSDP: cast in every pass
            _amax(s, w)
            quantize(w.reshape(e * n, k), E4M3, "current", True, not backward, backward)
        f32 = torch.float32
        copies = (w.new_empty((e, n, k), dtype=E4M3), w.new_empty((e, n), dtype=f32),
                  w.new_empty((e, k, n), dtype=E4M3), w.new_empty((e, k), dtype=f32))
        if not s.cached_weights:
            return copies
        s.weights[key] = (w, copies)
    return s.weights[key][1]


class _FP8Grouped(torch.autograd.Function):
    """y[e] = x[e] W[e]^T for the local experts in one grouped FP8 GEMM (x [E, R, K], W [E, N, K])."""

    @staticmethod
    def forward(ctx, x, weight, s):
        e, r, k = x.shape
        offs = torch.arange(r, e * r + 1, r, dtype=torch.int32)
        x2d = x.reshape(e * r, k)
        _amax(s, x2d)
        q, sq, qt, sqt = quantize(x2d, E4M3, "current", False, True, True)
        w, sw, _, _ = _grouped_weight(s, weight, False)
        y = torch._scaled_grouped_mm(q, w.transpose(-1, -2), sq.new_empty(e * r), sw, offs=offs, out_dtype=x.dtype)
        ctx.save_for_backward(qt, weight, offs)
        ctx.s, ctx.shape = s, x.shape
        return y.view(e, r, -1)

    @staticmethod
    def backward(ctx, grad):
        qt, weight, offs = ctx.saved_tensors
        s, (e, r, k) = ctx.s, ctx.shape
        n = grad.shape[-1]
        g2d = grad.reshape(e * r, n)
        _amax(s, g2d)
        g, _, gt, _ = quantize(g2d, E4M3, "current", False, True, True)
        _, _, wt, swt = _grouped_weight(s, weight, True)
        dx = torch._scaled_grouped_mm(g, wt.transpose(-1, -2), g.new_empty(e * r, dtype=torch.float32), swt,
                                      offs=offs, out_dtype=grad.dtype)
        dw = torch._scaled_grouped_mm(gt, qt.t(), g.new_empty(n * e, dtype=torch.float32),
                                      g.new_empty(k * e, dtype=torch.float32), offs=offs, out_dtype=grad.dtype)
        return dx.view(e, r, k), dw, None
