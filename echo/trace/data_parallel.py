"""Data-parallel gradient reduction and the optimizer step, as Megatron-LM's DDP and distributed
optimizer run them.

Gradients live in flat fp32 buckets (Megatron accumulates bf16 gradients in fp32, and buckets
them so reduction overlaps backward): ZeRO 0 all-reduces each bucket; ZeRO 1 and 2 reduce-scatter
it, update the local 1/dp shard with fused AdamW on fp32 master weights, then all-gather the
updated parameters in the compute dtype. Buffer building runs muted: on a GPU the gradients are
written into the buckets in place, so there is no copy kernel to record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from echo.trace.recorder import Recorder

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


def local_grads(modules: list[nn.Module]) -> list[torch.Tensor]:
    out = []
    for m in modules:
        for p in m.parameters():
            g = p.grad
            out.append(g.to_local() if isinstance(g, DTensor) else g)
    return out


def buckets(numels: list[int], dp: int) -> list[int]:
    """Bucket sizes in elements, filled in backward order (last parameters' gradients are ready
    first), each padded to a multiple of dp so it splits evenly into shards."""
    limit = max(BUCKET_ELEMENTS, 1_000_000 * dp)
    sizes, current = [], 0
    for n in reversed(numels):
        current += n
        if current >= limit:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    return [-(-s // dp) * dp for s in sizes]


def memory_model(numel: int, param_dtype: torch.dtype, zero: int, dp: int, unsharded_peak: int = 0) -> MemoryModel:
    """Megatron's accounting: compute-dtype params, fp32 grads, fp32 Adam moments (+ fp32 master
    weights when params are not fp32); ZeRO 1 shards optimizer state over dp, ZeRO 2 gradients too.

    ZeRO 3 (FSDP, ``numel`` = this rank's shard): fp32 sharded parameters double as master
    weights, fp32 sharded gradients and moments, plus ``unsharded_peak`` elements of gathered
    compute-dtype parameters alive at once (the current and the prefetched layer)."""
    pbytes = torch.empty((), dtype=param_dtype).element_size()
    if zero == 3:
        return MemoryModel(param_bytes=4 * numel + pbytes * unsharded_peak, grad_bytes=4 * numel,
                           optimizer_bytes=8 * numel)
    master = 4 if pbytes != 4 else 0
    grad = 4 * numel // (dp if zero >= 2 else 1)
    optim = (master + 8) * numel // (dp if zero >= 1 else 1)
    return MemoryModel(param_bytes=pbytes * numel, grad_bytes=grad, optimizer_bytes=optim)


def tp_partial_grad_numel(modules: list[nn.Module], sequence_parallel: bool) -> int:
    """Elements of gradients that each tensor-parallel rank holds only a part of under sequence
    parallelism, because each rank's copy saw only its 1/tp of the sequence: the norms (partial
    DTensor gradients) and the plain replicated parameters (position embedding, router, experts)."""
    if not sequence_parallel:
        return 0
    n = 0
    for m in modules:
        for p in m.parameters():
            g = p.grad
            if isinstance(g, DTensor):
                n += p.to_local().numel() if any(pl.is_partial() for pl in g.placements) else 0
            else:
                n += p.numel()
    return n


@dataclass(frozen=True)
class ReductionSet:
    """Parameters whose gradients one data-parallel group reduces."""

    numels: list[int]
    group: object      # the process group (None when of size 1)
    size: int


def reduction_sets(modules: list[nn.Module], groups: dict, parallel) -> list[ReductionSet]:
    """Dense parameters reduce over dp; expert parameters over the ranks holding the same
    experts (edp, dp / ep of them)."""
    from echo.trace.moe import MoE

    experts = {id(p) for m in modules for mod in m.modules() if isinstance(mod, MoE)
               for p in (mod.w1, mod.w2, mod.w3)}
    dense, expert = [], []
    for m in modules:
        for p in m.parameters():
            n = (p.to_local() if isinstance(p, DTensor) else p).numel()
            (expert if id(p) in experts else dense).append(n)
    # context-parallel ranks hold the same parameters too: dense gradients reduce over dp x cp
    dense_group = groups["dpcp"] if parallel.cp > 1 else groups["dp"]
    sets = [ReductionSet(dense, dense_group, parallel.dp * parallel.cp)]
    if expert:
        sets.append(ReductionSet(expert, groups["edp"], parallel.dp // parallel.ep))
    return sets


def grad_sync_and_step(rec: Recorder, modules: list[nn.Module], groups: dict, parallel, param_dtype: torch.dtype) -> None:
    """Record the gradient reduction (phase grad_sync) and the optimizer step (phase optimizer).

    ``groups`` maps mesh dimension (tp, dp, ep, edp, ...) to this rank's process group (None when
    of size 1); ``parallel`` is the workload's ParallelConfig."""
    partial = tp_partial_grad_numel(modules, parallel.sequence_parallel)
    if partial and groups["tp"] is not None:
        # Megatron all-reduces sequence-parallel gradients over tp in one coalesced buffer
        with rec.muted():
            buf = torch.empty(partial, dtype=torch.float32)
        with rec.phase("grad_sync", blocking=True):
            dist.all_reduce(buf, group=groups["tp"])
    for rs in reduction_sets(modules, groups, parallel):
        _reduce_and_step(rec, rs, parallel.zero, param_dtype)


def _reduce_and_step(rec: Recorder, rs: ReductionSet, zero: int, param_dtype: torch.dtype) -> None:
    dp, group = rs.size, rs.group
    # under ZeRO 3, FSDP already reduce-scattered each layer's gradients in backward, and the
    # local parameters are the 1/dp shards the optimizer updates
    sizes = buckets(rs.numels, 1 if zero == 3 else dp)
    shards = [s // dp if zero in (1, 2) else s for s in sizes]
    with rec.muted():
        grads = [torch.empty(s, dtype=torch.float32) for s in sizes]
        outs = [torch.empty(s // dp, dtype=torch.float32) for s in sizes]
    # plain c10d calls, as Megatron's DDP and the measure stage's DataParallel make them (DTensor's
    # functional collectives cost more on a host-synchronous CPU: network api_overheads)
    with rec.phase("grad_sync", blocking=False, stream="comm"):
        for g, out in zip(grads, outs, strict=True):
            if dp > 1 and zero == 0:
                dist.all_reduce(g, group=group)
            elif dp > 1 and zero in (1, 2):
                dist.reduce_scatter_single(out, g, group=group)
    with rec.muted():
        state = [[torch.zeros(n, dtype=torch.float32) for _ in range(4)] for n in shards]
        steps = [torch.zeros((), dtype=torch.float32) for _ in shards]
    with rec.phase("optimizer"):
        params, grad_shards, m, v = (list(x) for x in zip(*state, strict=True))
        torch._fused_adamw_(params, grad_shards, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
        # the gradients are consumed: their buffers start the next step at zero (Megatron's
        # zero_grad_buffer, the measure stage's DataParallel.zero_grad), a fill of every bucket,
        # done before the parameter all-gathers as when it opens the next step. FSDP2 drops its
        # sharded gradients instead.
        for g in grads if zero < 3 else []:
            g.zero_()
        for p in params if zero < 3 else []:  # FSDP gathers in the compute dtype itself
            half = p.to(param_dtype) if param_dtype != torch.float32 else p
            if dp > 1 and zero >= 1:
                with rec.muted():
                    gathered = torch.empty(half.numel() * dp, dtype=half.dtype)
                dist.all_gather_single(gathered, half, group=group)


def rank_memory(modules: list[nn.Module], groups: dict, parallel, param_dtype: torch.dtype,
                unsharded_peak: int = 0) -> MemoryModel:
    """memory_model summed over the reduction sets (expert state shards over edp, not dp)."""
    sets = reduction_sets(modules, groups, parallel)
    # the gathered-parameter peak of FSDP belongs to the dense set (experts are not FSDP-sharded)
    parts = [memory_model(sum(rs.numels), param_dtype, parallel.zero, rs.size, unsharded_peak if i == 0 else 0)
             for i, rs in enumerate(sets)]
    return MemoryModel(param_bytes=sum(m.param_bytes for m in parts),
                       grad_bytes=sum(m.grad_bytes for m in parts),
                       optimizer_bytes=sum(m.optimizer_bytes for m in parts))
