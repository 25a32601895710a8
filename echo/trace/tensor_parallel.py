"""Megatron-style tensor parallelism with PyTorch's DTensor plans.

Column-parallel QKV and fc1, row-parallel proj and fc2 (one all-reduce after attention and one
after the MLP in forward, and their mirror in backward), a vocabulary-parallel token embedding,
and a column-parallel LM head whose logits stay sharded for a vocabulary-parallel loss.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def apply_tensor_parallel(chunk: nn.Module, mesh: DeviceMesh) -> None:
    """Shard ``chunk`` (a GPTChunk) in place over the 1-D tensor-parallel ``mesh``."""
    for block in chunk.blocks:
        parallelize_module(block, mesh, {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        })
    if chunk.first:
        parallelize_module(chunk, mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate())})
    if chunk.last:
        parallelize_module(chunk, mesh, {
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
