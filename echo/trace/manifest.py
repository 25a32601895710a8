"""A traced rank's parameters in order, as the gradient reduction sees them: what layer
templates (echo.trace.template, compose) need to stand the parameters of a deeper stage in."""

from __future__ import annotations

import pyarrow as pa

# One row per parameter, in module order (``param_manifest``).
PARAMS = pa.schema([
    ("rank", pa.int32()),
    ("chunk", pa.int32()),
    ("name", pa.string()),
    ("layer", pa.int32()),        # the block that holds it (blocks.{i}.), -1 outside the blocks
    ("numel", pa.int64()),        # elements of the local shard
    ("dtype", pa.string()),
    ("expert", pa.bool_()),       # reduced over edp, not dp (data_parallel.reduction_sets)
    ("tp_partial", pa.bool_()),   # reduced over tp first (data_parallel.tp_partial)
])


def param_manifest(chunks: list, rank: int) -> pa.Table:
    """The chunks' parameters after a micro-batch's backward (their gradients exist)."""
    from echo.training.data_parallel import expert_ids, local_tensor, tp_partial

    experts = expert_ids(chunks)
    rows = []
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            parts = name.split(".")
            layer = int(parts[1]) if parts[0] == "blocks" and len(parts) > 2 else -1
            rows.append({"rank": rank, "chunk": c, "name": name, "layer": layer, "numel": local_tensor(p).numel(),
                         "dtype": str(p.dtype).removeprefix("torch."), "expert": id(p) in experts,
                         "tp_partial": tp_partial(p, experts)})
    return pa.Table.from_pylist(rows, schema=PARAMS)
