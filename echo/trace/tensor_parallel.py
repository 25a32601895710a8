"""Megatron-style tensor parallelism, with or without sequence parallelism, as DTensor plans.

Column-parallel QKV and fc1, row-parallel proj and fc2, a vocabulary-parallel token embedding,
and a column-parallel LM head whose logits stay sharded for a vocabulary-parallel loss.
Without sequence parallelism the residual stream is replicated: one all-reduce after attention
and one after the MLP in forward, mirrored in backward. With it (Korthikanti et al. 2022) the
residual stream, norms included, holds 1/tp of the sequence: each all-reduce becomes an
all-gather before the column-parallel GEMM and a reduce-scatter after the row-parallel one.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
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
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {"ln1": SequenceParallel(), "attn": gather, "ln2": SequenceParallel()}
        if block.mlp.COLWISE:  # a mixture of experts works on the rank's own sequence shard
            plan["mlp"] = gather
    return plan


def apply_tensor_parallel(chunk: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard ``chunk`` (a ModelChunk) in place over the 1-D tensor-parallel ``mesh``."""
    for block in chunk.blocks:
        parallelize_module(block, mesh, _block_plan(block, sequence_parallel))
    seq = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        chunk.seq_shard = (mesh.get_local_rank(), mesh.size())
    if chunk.first:
        parallelize_module(chunk, mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)})
    if chunk.last:
        head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        final = {"ln_f": SequenceParallel()} if sequence_parallel else {}
        parallelize_module(chunk, mesh, {**final, "head": head})
