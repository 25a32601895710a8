"""Data-parallel gradient reduction and the optimizer step, as Megatron-LM's DDP and distributed
optimizer run them: one implementation for the tracer and the real runs on this CPU.

Gradients live in flat fp32 buckets (Megatron accumulates bf16 gradients in fp32, and buckets
them so reduction overlaps backward): ZeRO 0 all-reduces each bucket; ZeRO 1 and 2 reduce-scatter
it, update the local 1/dp shard with fused AdamW on fp32 master weights, then all-gather the
updated parameters in the compute dtype.

The tracer passes its recorder (``rec``): buffers are built muted, since on a GPU the gradients
are written into the buckets in place and there is no copy kernel to record. The real runs pass
none; the measure stage also ``bind``s the parameters and gradients into the buckets, as
Megatron's param and grad buffers hold them, so that the update trains the model.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from echo.training import fp8

BUCKET_ELEMENTS = 40_000_000  # Megatron-LM's default DDP bucket size (elements)


@dataclass(frozen=True)
class MemoryModel:
    """Bytes one rank holds for its parameters, gradients and optimizer state."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int


def local_params(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Parameters as this rank stores them (local shards of DTensors)."""
    out = []
    for m in modules:
        for p in m.parameters():
            out.append(p.to_local() if isinstance(p, DTensor) else p)
    return out


def local_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """The modules' buffers (RoPE tables, ...), each storage once: state the rank holds for the
    whole run beside its parameters, replicated (FSDP and ZeRO shard parameters, not buffers)."""
    seen, out = set(), []
    for m in modules:
        for b in m.buffers():
            b = local_tensor(b)
            if b.untyped_storage()._cdata not in seen:
                seen.add(b.untyped_storage()._cdata)
                out.append(b)
    return out


def buffer_bytes(modules: list[nn.Module]) -> int:
    return sum(b.untyped_storage().nbytes() for b in local_buffers(modules))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def buckets(numels: list[int], dp: int) -> list[int]:
    """Bucket sizes in elements (``bucket_members``' buckets), each padded to a multiple of dp so
    it splits evenly into shards."""
    return [-(-sum(numels[i] for i in m) // dp) * dp for m in bucket_members(numels, dp)]


def bucket_members(numels: list[int], dp: int) -> list[list[int]]:
    """Parameter indices of each bucket, filled in backward order (last parameters' gradients are
    ready first) up to Megatron's bucket size."""
    limit = max(BUCKET_ELEMENTS, 1_000_000 * dp)
    members, current, total = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        total += numels[i]
        if total >= limit:
            members.append(current)
            current, total = [], 0
    if current:
        members.append(current)
    return members


def memory_model(numel: int, param_dtype: torch.dtype, zero: int, dp: int, unsharded: int = 0,
                 grad_dtype: torch.dtype = torch.float32) -> MemoryModel:
    """Bytes of the state one rank holds for ``numel`` of its parameters, as Megatron-Core's DDP
    and distributed optimizer and FSDP2 allocate them. ``dp``: the ranks the state is sharded
    over (the data-parallel group, context-parallel ranks included: Megatron's distributed
    optimizer shards over dp x cp; experts over their expert-data-parallel group).

    ZeRO 0-2: the parameters in the compute dtype (Megatron's param buffer); the gradients in
    one fp32 buffer (main_grad: the backward GEMMs accumulate into it, gradient_accumulation_fusion,
    so there is no second, compute-dtype copy), sharded over ``dp`` under ZeRO 2; AdamW's fp32
    moments (8 B) and, when the parameters are not fp32, fp32 master weights (4 B), sharded over
    ``dp`` under ZeRO 1 and 2: 18 B per parameter without sharding, 2 + 4 + 12/dp with ZeRO 1.
    ``grad_dtype`` bf16 (grad_reduce_in_fp32 off): the gradient buffer holds 2 B per parameter; the
    optimizer's fp32 copy of its gradient shard lives only while it steps, when the activations
    are gone, so it is not part of the peak.

    ZeRO 3 (FSDP2 as torchtitan runs it, ``numel`` = this rank's shard): fp32 sharded parameters
    (the optimizer's master weights), fp32 sharded gradients (reduce_dtype fp32) and moments:
    16 B per sharded parameter. The gathered compute-dtype parameters of the layers in use are
    working memory (the tracer's meter sees their all-gathers), except ``unsharded`` elements kept
    for the whole step: under pipeline parallelism torchtitan does not reshard after forward
    (parallelize_llama.apply_fsdp: reshard_after_forward=False when pp is on) and the pipeline
    schedule turns gradient reduction off until the last micro-batch
    (torch.distributed.pipelining: set_requires_gradient_sync(False)), so FSDP2 keeps the whole
    stage's parameters gathered (compute dtype) and accumulates their unsharded gradients in the
    reduce dtype, fp32 (FSDPParam.to_accumulated_grad_if_needed): 2 + 4 B per element."""
    pbytes = torch.empty((), dtype=param_dtype).element_size()
    if zero == 3:
        return MemoryModel(param_bytes=4 * numel + pbytes * unsharded, grad_bytes=4 * numel + 4 * unsharded,
                           optimizer_bytes=8 * numel)
    master = 4 if pbytes != 4 else 0
    grad = torch.empty((), dtype=grad_dtype).element_size() * numel // (dp if zero >= 2 else 1)
    optim = (master + 8) * numel // (dp if zero >= 1 else 1)
    return MemoryModel(param_bytes=pbytes * numel, grad_bytes=grad, optimizer_bytes=optim)


def fp8_primary_savings(fp8_state, zero: int) -> int:
    """Bytes of the compute-dtype copies of the FP8 linears' weights that FP8 parameter gathers
    remove: with Megatron's --fp8-param-gather (ZeRO 1/2) the parameter is stored in FP8 and is
    the row-wise FP8 copy itself (Transformer Engine's FP8 primary weights), so of memory_model's
    compute-dtype parameter and the cached FP8 copies (fp8.cached_weight_bytes) only the FP8 ones
    remain. torchao under FSDP (ZeRO 3) keeps no FP8 weight: nothing to remove."""
    if fp8_state is None or not fp8_state.fp8_gather or zero not in (1, 2):
        return 0
    return sum(w.numel() * w.element_size() for w, _ in fp8_state.weights.values())


def tp_partial_grad_numel(modules: list[nn.Module], sequence_parallel: bool) -> int:
    """Elements of gradients that each tensor-parallel rank holds only a part of under sequence
    parallelism, because each rank's copy saw only its 1/tp of the sequence: the norms (partial
    DTensor gradients) and the plain replicated parameters (position embedding, router). Experts
    are left out (expert parallelism folds over tp: their gradients reduce over edp), and so are
    parameters that read the whole gathered sequence (echo_tp_whole, hf_parallel)."""
    if not sequence_parallel:
        return 0
    experts = expert_ids(modules)
    return sum(local_tensor(p).numel() for m in modules for p in m.parameters() if tp_partial(p, experts))


def tp_partial(p: nn.Parameter, experts: set[int]) -> bool:
    """Whether ``p``'s gradient is one of tp_partial_grad_numel's (sequence parallelism on); a
    parameter standing for another (echo.trace.template's) says so in ``echo_tp_partial``."""
    if hasattr(p, "echo_tp_partial"):
        return p.echo_tp_partial
    g = p.grad
    if isinstance(g, DTensor):
        return any(pl.is_partial() for pl in g.placements)
    return id(p) not in experts and not getattr(p, "echo_tp_whole", False)


def expert_ids(modules: list[nn.Module]) -> set[int]:
    """ids of the expert parameters: moe.MoE's, and transformers' routed experts (hf_moe)."""
    from echo.training.moe import MoE

    ids = {id(p) for m in modules for mod in m.modules() if isinstance(mod, MoE) for p in (mod.w1, mod.w2, mod.w3)}
    return ids | {id(p) for m in modules for p in m.parameters() if getattr(p, "echo_expert", False)}


@dataclass(frozen=True)
class ReductionSet:
    """Parameters whose gradients one data-parallel group reduces."""

    numels: list[int]
    group: object      # the process group (None when of size 1)
    size: int
    params: list[nn.Parameter]


def reduction_sets(modules: list[nn.Module], groups: dict, parallel) -> list[ReductionSet]:
    """Dense parameters reduce over dp; expert parameters over the ranks holding the same
    experts (edp, tp x cp x dp / ep of them)."""
    experts = expert_ids(modules)
    dense, expert = [], []
    for m in modules:
        for p in m.parameters():
            (expert if id(p) in experts else dense).append(p)
    numels = [[local_tensor(p).numel() for p in ps] for ps in (dense, expert)]
    # context-parallel ranks hold the same parameters too: dense gradients reduce over dp x cp
    dense_group = groups["dpcp"] if parallel.cp > 1 else groups["dp"]
    sets = [ReductionSet(numels[0], dense_group, parallel.dp * parallel.cp, dense)]
    if expert:
        # expert parallelism folds over tp x cp x dp (layout.expert_group)
        edp = parallel.tp * parallel.cp * parallel.dp // parallel.ep
        sets.append(ReductionSet(numels[1], groups.get("edp"), edp, expert))
    return sets


class _Unrecorded:
    """The recorder a real run has: nothing is muted, no phase is labelled."""

    @staticmethod
    def muted():
        return nullcontext()

    @staticmethod
    def phase(*args, **kwargs):
        return nullcontext()


ADAMW = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


@dataclass
class Bucket:
    """One flat gradient bucket and the optimizer state of this rank's part of it."""

    grad: torch.Tensor       # the bucket's gradients (reduced over the group): fp32, or the grad dtype
    out: torch.Tensor        # where ZeRO 1/2's reduce-scatter writes this rank's shard
    master: torch.Tensor     # fp32 master weights of the shard the optimizer updates
    update: torch.Tensor     # the fp32 gradient shard the optimizer reads
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    param: torch.Tensor | None  # the compute-dtype parameter buffer (bound runs), else None
    gathered: torch.Tensor   # where ZeRO 1/2's parameter all-gather writes


class DataParallel:
    """The gradient buckets of one rank's modules, their reduction and the optimizer step.

    ``groups`` maps mesh dimension (tp, dp, dpcp, edp, ...) to this rank's process group (None
    when of size 1); ``parallel`` is the workload's ParallelConfig. ``rec``: the tracer's
    recorder (None for a real run); ``bind``: keep the parameters and gradients in the buckets
    (the measure stage's real training; needs ZeRO <= 2). ``grad_dtype``: of the gradient buffers
    and their reduction (ZeRO 0-2; training.grad_reduce_in_fp32)."""

    def __init__(self, modules: list[nn.Module], groups: dict, parallel, dtype: torch.dtype, *,
                 rec=None, bind: bool = False, dp_rank: int = 0, grad_dtype: torch.dtype = torch.float32):
        if bind and parallel.zero > 2:
            raise ValueError("ZeRO 3 is not run with bound buckets (the measure stage) yet")
        self.modules, self.groups, self.parallel, self.dtype = modules, groups, parallel, dtype
        self.rec = rec if rec is not None else _Unrecorded()
        self.bind = bind
        self.grad_dtype = grad_dtype if parallel.zero < 3 else torch.float32
        # fp32 gradients can be the parameters' own .grad (accumulated in place by autograd);
        # other dtypes keep .grad in the compute dtype and are copied into the fp32 bucket
        self.copies: list[tuple[torch.Tensor, nn.Parameter]] = []
        self.sets = reduction_sets(modules, groups, parallel)
        with self.rec.muted():
            self.buckets = [self._buckets(rs, dp_rank) for rs in self.sets]

    def _buckets(self, rs: ReductionSet, dp_rank: int) -> list[Bucket]:
        dp, zero, f32, gdt = rs.size, self.parallel.zero, torch.float32, self.grad_dtype
        # under ZeRO 3, FSDP already reduce-scattered each layer's gradients in backward, and the
        # local parameters are the 1/dp shards the optimizer updates
        sizes = buckets(rs.numels, 1 if zero == 3 else dp)
        members = bucket_members(rs.numels, 1 if zero == 3 else dp)
        out = []
        for size, idx in zip(sizes, members, strict=True):
            n = size // dp if zero in (1, 2) else size
            grad = torch.zeros(size, dtype=gdt)
            param = self._bind(rs, idx, grad, size) if self.bind else None
            if param is not None:
                start = dp_rank * n if zero >= 1 else 0
                master = (param if self.dtype == f32 else param.float())[start:start + n]
                shard_out, gathered = grad[start:start + n], param
                update = shard_out if gdt == f32 else torch.zeros(n, dtype=f32)
            else:
                master, update = torch.zeros(n, dtype=f32), torch.zeros(n, dtype=f32)
                shard_out = torch.empty(size // dp, dtype=gdt)
                gathered = torch.empty(n * dp, dtype=self.dtype)
            out.append(Bucket(grad, shard_out, master, update, torch.zeros(n, dtype=f32),
                              torch.zeros(n, dtype=f32), torch.zeros((), dtype=f32), param, gathered))
        return out

    def _bind(self, rs: ReductionSet, idx: list[int], grad: torch.Tensor, size: int) -> torch.Tensor:
        """Move the parameters ``idx`` of ``rs`` into a flat buffer, their gradients into ``grad``."""
        param = torch.zeros(size, dtype=self.dtype)
        off = 0
        with torch.no_grad():
            for i in idx:
                p, n = rs.params[i], rs.numels[i]
                local = local_tensor(p)
                view = param[off:off + n].view_as(local)
                view.copy_(local)
                local.data = view  # the parameter now lives in the flat buffer
                gview = grad[off:off + n].view_as(local)
                if self.dtype == grad.dtype:
                    p.grad = (DTensor.from_local(gview, p.device_mesh, p.placements, run_check=False)
                              if isinstance(p, DTensor) else gview)
                else:
                    self.copies.append((gview, p))
                off += n
        return param

    def zero_grad(self) -> None:
        """Gradients the buckets do not hold start the next step unset (autograd writes them anew)."""
        for _, p in self.copies:
            p.grad = None

    def grad_sync(self) -> None:
        """Reduce each bucket over its group, in bucket order (phase grad_sync)."""
        rec, tp = self.rec, self.groups.get("tp")
        partial = tp_partial_grad_numel(self.modules, self.parallel.sequence_parallel)
        if partial and tp is not None:
            # Megatron all-reduces sequence-parallel gradients over tp in one coalesced buffer
            with rec.muted():
                buf = torch.empty(partial, dtype=self.grad_dtype)
            with rec.phase("grad_sync", blocking=True):
                dist.all_reduce(buf, group=tp)
        for gview, p in self.copies:
            gview.copy_(local_tensor(p.grad))
        zero = self.parallel.zero
        # plain c10d calls, as Megatron's DDP makes them (DTensor's functional collectives cost
        # more on a host-synchronous CPU: network api_overheads)
        mirror = self.groups.get("mirror")  # DualPipe: the other copy of this rank's stages
        with rec.phase("grad_sync", blocking=False, stream="comm"):
            for rs, bs in zip(self.sets, self.buckets, strict=True):
                for b in bs:
                    if mirror is not None:  # both copies take the sum of their gradients
                        dist.all_reduce(b.grad, group=mirror)
                    if rs.size > 1 and zero == 0:
                        dist.all_reduce(b.grad, group=rs.group)
                    elif rs.size > 1 and zero in (1, 2):
                        dist.reduce_scatter_single(b.out, b.grad, group=rs.group)

    def step(self) -> None:
        """Fused AdamW on the local shards, the buckets zeroed for the next step, then (ZeRO 1/2)
        the parameters all-gathered in the compute dtype (phase optimizer)."""
        rec, zero, dtype = self.rec, self.parallel.zero, self.dtype
        flat = [b for bs in self.buckets for b in bs]
        with rec.phase("optimizer"):
            if self.grad_dtype != torch.float32:  # the distributed optimizer's fp32 copy of its shard
                for b in flat:
                    b.update.copy_(b.out if zero in (1, 2) else b.grad[:b.update.numel()])
            self._grad_norm(flat)
            steps = [b.step for b in flat]
            with rec.muted():  # apex / TE fused Adam take the step count as a host scalar
                torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_([b.master for b in flat], [b.update for b in flat],
                                [b.exp_avg for b in flat], [b.exp_avg_sq for b in flat], [], steps, **ADAMW)
            # the gradients are consumed: their buffers start the next step at zero (Megatron's
            # zero_grad_buffer), a fill of every bucket, done before the parameter all-gathers as
            # when it opens the next step. FSDP2 drops its sharded gradients instead.
            for b in flat if zero < 3 else []:
                b.grad.zero_()
            # FP8 parameter gathers (Megatron's --fp8-param-gather): the shard is cast to E4M3
            # and gathered at one byte per parameter
            state = fp8.active()
            fp8_gather = state is not None and state.fp8_gather
            for rs, bs in zip(self.sets, self.buckets, strict=True):
                for b in bs if zero < 3 else []:  # FSDP gathers in the compute dtype itself
                    half = b.master.to(fp8.E4M3 if fp8_gather else dtype) if dtype != torch.float32 else b.master
                    if rs.size > 1 and zero >= 1:
                        with rec.muted():
                            out = torch.empty(b.gathered.shape, dtype=half.dtype) if fp8_gather else b.gathered
                        dist.all_gather_single(out, half, group=rs.group)
                    elif b.param is not None and dtype != torch.float32:
                        with rec.muted():  # on a GPU the cast writes the parameter buffer itself
                            b.param.copy_(half)


    def _grad_norm(self, flat: list[Bucket]) -> None:
        """Gradient clipping's global norm (Megatron's clip_grad, on by default; torchtitan's
        max_norm): each rank's squared norm of the gradients it updates, all-reduced (one fp32)
        over every rank, as Megatron's distributed optimizer and FSDP2's DTensor norm reduce it;
        fp16 adds the loss scaler's inf check, an all-reduce (max) over the same ranks. The
        scaling by the clip coefficient happens only when the norm is over the bound: left out."""
        world = self.groups.get("world")
        if not flat:
            return
        norms = torch._foreach_norm([b.update for b in flat])
        total = torch.stack(norms).pow(2).sum()
        if world is not None:
            with self.rec.phase("optimizer", blocking=True):
                dist.all_reduce(total, group=world)
                if self.dtype == torch.float16:
                    dist.all_reduce(torch.zeros(1, dtype=torch.float32), op=dist.ReduceOp.MAX, group=world)


def rank_memory(modules: list[nn.Module], groups: dict, parallel, param_dtype: torch.dtype,
                unsharded: int = 0, grad_dtype: torch.dtype = torch.float32) -> MemoryModel:
    """memory_model summed over the reduction sets (expert state shards over edp, not dp);
    ``unsharded``: FSDP2's parameters gathered for the whole step (fsdp.resident_unsharded)."""
    sets = reduction_sets(modules, groups, parallel)
    # FSDP's gathered parameters belong to the dense set (experts are not FSDP-sharded)
    parts = [memory_model(sum(rs.numels), param_dtype, parallel.zero, rs.size, unsharded if i == 0 else 0,
                          grad_dtype if parallel.zero < 3 else torch.float32) for i, rs in enumerate(sets)]
    return MemoryModel(param_bytes=sum(m.param_bytes for m in parts),
                       grad_bytes=sum(m.grad_bytes for m in parts),
                       optimizer_bytes=sum(m.optimizer_bytes for m in parts))
