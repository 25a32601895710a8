"""A checkpoint's size, and the time to save and reload it.

What a Megatron-Core or FSDP checkpoint holds for mixed-precision AdamW: the model's weights in
their compute dtype (bf16 / fp16: 2 bytes a parameter; FP8 training keeps bf16 weights, its FP8
copies are rebuilt from them), the fp32 main weights (4) and the two fp32 moments (4 + 4): 14
bytes a parameter; fp32 training has no separate main copy: 12. Each parameter's state is
written once however the job shards it (distributed checkpoints write every shard from the rank
that owns it), so the size follows the model, not the layout. Gradients and activations are not
saved.

The parameters are counted on the model itself: every pipeline stage's chunks built on the meta
device with tensor, context, data and expert parallelism set to 1 (shapes only, no storage), so
Hugging Face configurations, MoE experts and users' modules count as they are traced.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo.config.site import Checkpointing
from echo.config.workload import Workload

# Bytes of checkpointed state per parameter beside the weights' own copy: fp32 main weights and
# AdamW's two fp32 moments (only the moments when the weights are fp32 themselves).
_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}
_OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12, "fp8": 12}


def model_parameters(w: Workload) -> int:
    """Every parameter of the workload's model, counted once (built on the meta device)."""
    import torch

    from echo.training.model import build_chunks

    p = w.parallel
    single = w.model_copy(update={"parallel": p.model_copy(update={
        "tp": 1, "dp": 1, "cp": 1, "ep": 1, "sequence_parallel": False})})
    total = 0
    with torch.device("meta"):
        for stage in range(p.pp):
            for chunk in build_chunks(single, stage):
                total += sum(t.numel() for t in chunk.parameters())
    return total


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint of a job."""

    parameters: int
    bytes: int
    save_s: float   # training stopped while it is written (blocking) or while it is copied off (async)
    load_s: float   # reading it back after an interruption


def checkpoint_cost(w: Workload, ckpt: Checkpointing, parameters: int | None = None) -> CheckpointCost:
    """Size and times of ``w``'s checkpoint on the site's storage (``parameters``: a count already made)."""
    n = model_parameters(w) if parameters is None else parameters
    dtype = w.training.dtype
    size = n * (_WEIGHT_BYTES[dtype] + _OPTIMIZER_BYTES[dtype])
    write = size / (ckpt.write_GBps.value * 1e9)
    save = ckpt.fixed_s.value + (write if ckpt.blocking else 0.0)
    return CheckpointCost(n, size, save, size / (ckpt.read_GBps.value * 1e9))
