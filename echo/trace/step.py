"""One rank's training step under the fake process group, recorded op by op.

Run in its own process (the fake process group cannot switch groups within one process):
forward and backward of one micro-batch for each of the rank's model chunks, with the pipeline
sends and receives around them, then the gradient reduction and the optimizer step. The
pipeline schedule repeats the per-micro-batch part; the simulator composes it.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from echo.artifacts import TRACED_RANKS
from echo.config.workload import Workload
from echo.trace.recorder import Recorder
from echo.training import data_parallel, fsdp
from echo.training.layout import Layout
from echo.training.model import DTYPES, build_chunks
from echo.training.tensor_parallel import apply_tensor_parallel


class _ActivationMeter:
    """Bytes autograd saves for backward, each local storage once, parameters excluded: the
    activation memory one micro-batch keeps alive until its backward."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = {p.untyped_storage()._cdata for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._is_view() else t
        if isinstance(base, nn.Parameter):  # weights (FSDP's gathered ones too) are not activations
            return t
        local = t.to_local() if isinstance(t, DTensor) else t
        s = local.untyped_storage()
        if s._cdata not in self.params:
            self.storages[s._cdata] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _groups(layout: Layout, rank: int, rec: Recorder) -> dict[str, object]:
    """Create this rank's process groups and teach the recorder which kind each one is."""
    groups = {}
    for dim in ("tp", "cp", "dp", "pp", "ep", "edp", "dpcp"):
        ranks = layout.expert_group(rank, dim) if dim in ("ep", "edp") else layout.group(rank, dim)
        groups[dim] = dist.new_group(ranks) if len(ranks) > 1 else None
        if groups[dim] is not None:
            rec.ctx.group_kinds[groups[dim].group_name] = dim
        rec.ctx.group_kinds.setdefault(tuple(ranks), dim)
    return groups


def _peer(layout: Layout, rank: int, chunk: int, step: int, v: int) -> int | None:
    """The rank holding the neighbouring virtual stage (interleaving wraps around the pipeline)."""
    pp = layout.sizes["pp"]
    stage = layout.coords(rank).pp + chunk * pp + step
    if not 0 <= stage < pp * v:
        return None
    return layout.stage_peer(rank, stage % pp - layout.coords(rank).pp)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    labels = torch.empty(logits.shape[:2], dtype=torch.long)
    if isinstance(logits, DTensor):
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def trace_rank(w: Workload, rank: int) -> dict[str, pa.Table]:
    """Trace ``rank`` of ``w``; returns ops, comms, deps and the one-row ranks table."""
    t0 = time.perf_counter()
    layout, p = Layout(w.parallel), w.parallel
    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    try:
        rec = Recorder(rank)
        groups = _groups(layout, rank, rec)
        dtype = DTYPES[w.training.dtype]
        # FSDP keeps fp32 master parameters and all-gathers them in the compute dtype
        torch.set_default_dtype(torch.float32 if p.zero == 3 else dtype)
        with rec, rec.muted():
            chunks = build_chunks(w, layout.coords(rank).pp, rec.recompute)
        # parallel plans must be applied outside the fake mode (docs/DESIGN.md, "Tracing on a CPU")
        with rec.muted():
            _parallelize(w, layout, rank, groups, chunks, dtype)
        torch.set_default_dtype(dtype)
        meter = _ActivationMeter(data_parallel.local_params(chunks))
        with rec:
            _microbatch(w, layout, rank, rec, chunks, meter, dtype)
            dp = data_parallel.DataParallel(chunks, groups, p, dtype, rec=rec)
            dp.grad_sync()
            dp.step()
        mem = data_parallel.rank_memory(chunks, groups, p, dtype, _unsharded_peak(chunks, p))
        c = layout.coords(rank)
        ranks = pa.table({
            "rank": [rank], "role": [layout.role_of(rank)], "pp_rank": [c.pp], "tp_rank": [c.tp],
            "dp_rank": [c.dp], "cp_rank": [c.cp], "graph_hash": [""], "param_bytes": [mem.param_bytes],
            "grad_bytes": [mem.grad_bytes], "optimizer_bytes": [mem.optimizer_bytes],
            "activation_bytes_per_microbatch": [meter.total],
            "trace_wall_s": [time.perf_counter() - t0]}, schema=TRACED_RANKS)
        return {**rec.tables(), "ranks": ranks}
    finally:
        dist.destroy_process_group()


def _unsharded_peak(chunks: list, p) -> int:
    """Gathered parameter elements FSDP holds at once: two layers (current + prefetched)."""
    if p.zero != 3:
        return 0
    per_block = [sum(x.numel() for x in data_parallel.local_params([b])) * p.dp for c in chunks for b in c.blocks]
    return 2 * max(per_block, default=0)


def _parallelize(w: Workload, layout: Layout, rank: int, groups: dict, chunks: list, dtype) -> None:
    p = w.parallel
    # with FSDP the tensor-parallel mesh must be the tp dimension of the 2-D (dp, tp) mesh
    mesh2d = fsdp.dp_tp_mesh(layout, rank, groups) if p.zero == 3 and p.dp > 1 else None
    if p.tp > 1:
        tp_mesh = mesh2d["tp"] if mesh2d is not None else DeviceMesh.from_group(groups["tp"], "cpu")
        for c in chunks:
            apply_tensor_parallel(c, tp_mesh, p.sequence_parallel)
    if mesh2d is not None:
        fsdp.apply_fsdp(chunks, mesh2d, dtype)
    for c in chunks:
        c.set_groups(groups)


def _microbatch(w, layout, rank, rec, chunks, meter, dtype) -> None:
    """Forward of every chunk, then backward in reverse, with pipeline p2p around each."""
    b, h, v = w.training.micro_batch, w.model.hidden, w.parallel.virtual_stages
    # the activation between stages is this rank's sequence shard under sequence parallelism
    seq = w.model.seq_len // w.parallel.cp  # context parallelism splits the sequence
    s = seq // (w.parallel.tp if w.parallel.sequence_parallel else 1)
    outputs, inputs = [], []
    for i, chunk in enumerate(chunks):
        with rec.phase("forward", i):
            prev = _peer(layout, rank, i, -1, v)
            if prev is None:
                with rec.muted():  # token ids come from the data loader, not a kernel
                    x = torch.zeros(b, seq, dtype=torch.long)
            else:
                with rec.muted():
                    x = torch.empty(b, s, h, dtype=dtype)
                dist.recv(x, src=prev)
                x.requires_grad_(True)
            with saved_tensors_hooks(meter.pack, lambda t: t):
                y = chunk(x)
                y = _loss(y) if chunk.last else y
            nxt = _peer(layout, rank, i, 1, v)
            if nxt is not None:
                dist.send(y.detach(), dst=nxt)
        inputs.append(x)
        outputs.append(y)
    for i in reversed(range(len(chunks))):
        with rec.phase("backward", i):
            y, x = outputs[i], inputs[i]
            nxt = _peer(layout, rank, i, 1, v)
            ctx = loss_parallel() if chunks[i].last and w.parallel.tp > 1 else nullcontext()
            if nxt is None:
                with ctx:
                    y.backward()
            else:
                with rec.muted():
                    grad = torch.empty_like(y)
                dist.recv(grad, src=nxt)
                y.backward(grad)
            prev = _peer(layout, rank, i, -1, v)
            if prev is not None:
                dist.send(x.grad, dst=prev)
