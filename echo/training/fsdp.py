"""ZeRO 3 with PyTorch's FSDP2 (``fully_shard``): parameters sharded over data parallelism,
all-gathered per layer before its forward and again before its backward, gradients
reduce-scattered per layer as its backward ends.

As torchtitan configures it: fp32 sharded parameters (they are the optimizer's master weights),
all-gathered in the compute dtype, gradients reduced in fp32; each block is one FSDP unit and the
chunk (embedding, final norm, head) is the root unit. With tensor parallelism the mesh is 2-D
(dp x tp) and FSDP shards the already tensor-parallel DTensor parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from echo.training.layout import Coords, Layout


def dp_tp_mesh(layout: Layout, rank: int, groups: dict) -> DeviceMesh:
    """This rank's data-parallel mesh, 2-D (dp, tp) when tensor parallelism is on. With context
    parallelism FSDP shards over the dp x cp ranks, which hold the same parameters (torchtitan's
    dp_shard_cp mesh dimension)."""
    cp = layout.sizes["cp"]
    shard = groups["dpcp"] if cp > 1 else groups["dp"]
    if groups["tp"] is None:
        return DeviceMesh.from_group(shard, "cpu", mesh_dim_names=("dp",))
    c, sizes = layout.coords(rank), layout.sizes
    # rows in the shard group's rank order (cp varies fastest), columns the tp ranks
    ranks = [[layout.rank(Coords(pp=c.pp, dp=d, cp=k, tp=t)) for t in range(sizes["tp"])]
             for d in range(sizes["dp"]) for k in range(cp)]
    return DeviceMesh.from_group([shard, groups["tp"]], "cpu", mesh=torch.tensor(ranks),
                                 mesh_dim_names=("dp", "tp"))


def resident_unsharded(chunks: list[nn.Module], parallel) -> int:
    """Elements of this rank's parameters FSDP2 keeps gathered for the whole step: all of them
    under pipeline parallelism (torchtitan does not reshard after forward then, and the pipeline
    schedule defers gradient reduction to the last micro-batch: data_parallel.memory_model), none
    otherwise (each unit is gathered for its forward and backward: working memory)."""
    shard = parallel.dp * parallel.cp  # FSDP shards over the dp x cp ranks (dp_tp_mesh)
    if parallel.zero != 3 or parallel.pp == 1 or shard == 1:
        return 0
    from echo.training.data_parallel import local_params

    return sum(p.numel() for p in local_params(chunks)) * shard


def apply_fsdp(chunks: list[nn.Module], mesh: DeviceMesh, compute_dtype: torch.dtype) -> None:
    """Wrap every block, then each chunk, as FSDP units over the ``dp`` dimension of ``mesh``."""
    dp_mesh = mesh["dp"] if mesh.ndim > 1 else mesh
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for chunk in chunks:
        for block in chunk.blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(chunk, mesh=dp_mesh, mp_policy=policy)
