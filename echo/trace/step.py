"""One rank's training step under the fake process group, recorded op by op.

Run in its own process (the fake process group cannot switch groups within one process):
forward and backward of one micro-batch for each of the rank's model chunks, with the pipeline
sends and receives around them, then the gradient reduction and the optimizer step. The
pipeline schedule repeats the per-micro-batch part; the simulator composes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from contextlib import nullcontext

import pyarrow as pa
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from echo.artifacts import TRACED_RANKS
from echo.config.workload import Workload
from echo.trace import manifest
from echo.trace.meter import EXPANDABLE_SEGMENTS, MemoryMeter
from echo.trace.recorder import Recorder
from echo.training import data_parallel, fp8, fsdp
from echo.training.fused import fused_cross_entropy
from echo.training.layout import Layout
from echo.training.model import DTYPES, build_chunks
from echo.training.tensor_parallel import apply_tensor_parallel


def _groups(layout: Layout, rank: int, rec: Recorder) -> dict[str, object]:
    """Create this rank's process groups and teach the recorder which kind each one is."""
    groups = {}
    for dim in ("tp", "cp", "dp", "pp", "ep", "edp", "dpcp", "stage", "world"):
        ranks = layout.expert_group(rank, dim) if dim in ("ep", "edp") else layout.group(rank, dim)
        groups[dim] = dist.new_group(ranks) if len(ranks) > 1 else None
        if groups[dim] is not None:
            rec.ctx.group_kinds[groups[dim].group_name] = dim
        rec.ctx.group_kinds.setdefault(tuple(ranks), dim)
    if layout.parallel.placement == "dual":
        # DualPipe's two copies of each stage (this rank's chunks, on the mirror rank too): their
        # gradients are summed over the pair, a pipeline-group collective
        ranks = sorted({rank, layout.mirror(rank)})
        groups["mirror"] = dist.new_group(ranks)
        rec.ctx.group_kinds[groups["mirror"].group_name] = "pp"
        rec.ctx.group_kinds.setdefault(tuple(ranks), "pp")
    return groups


def _loss(logits: torch.Tensor, fused: bool = False) -> torch.Tensor:
    labels = torch.empty(logits.shape[:2], dtype=torch.long)
    if fused:  # training.cross_entropy_fusion: one kernel over the bf16 logits
        return fused_cross_entropy(logits, labels)
    if isinstance(logits, DTensor):  # vocabulary-parallel, on fp32 logits as Megatron and torchtitan
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@contextlib.contextmanager
def process_settings():
    """Put torch's default dtype and thread count back after a trace: a rank may be traced in a
    process that goes on (echo.trace.runner.forked_map runs the first job in its caller)."""
    settings = torch.get_default_dtype(), torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_default_dtype(settings[0])
        torch.set_num_threads(settings[1])


@process_settings()
def trace_rank(w: Workload, rank: int, label_layers: bool = False) -> dict[str, pa.Table]:
    """Trace ``rank`` of ``w``; returns ops, comms, deps and the one-row ranks table.
    ``label_layers``: ops gain a ``layer`` column, the block of its chunk each belongs to (-1
    outside the blocks), as layer templates need (echo.trace.template)."""
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
        t = w.training
        grad_dtype = torch.float32 if t.grad_reduce_in_fp32 else dtype  # Megatron's main_grad buffers
        with rec, rec.muted():
            chunks = build_chunks(w, layout.coords(rank).pp, rec.recompute)
            if t.dtype == "fp8":
                for c in chunks:
                    for b in c.blocks:
                        fp8.mark_linears(b)
        # parallel plans must be applied outside the fake mode (docs/DESIGN.md, "Tracing on a CPU")
        with rec.muted():
            _parallelize(w, layout, rank, groups, chunks, dtype)
            for c in chunks:
                fp8.patch_linears(c)
        if label_layers:
            rec.label_layers(chunks)
        torch.set_default_dtype(dtype)
        # parameters and buffers are the rank's state, not the micro-batch's memory
        state = data_parallel.local_params(chunks) + data_parallel.local_buffers(chunks)
        meter = MemoryMeter(state, native_gqa=p.zero < 3, gqa=w.model.heads // w.model.kv,
                            unsharded_is_state=fsdp.resident_unsharded(chunks, p) > 0,
                            expandable_segments=EXPANDABLE_SEGMENTS, recorder=rec)
        with rec, fp8.training(t.fp8_recipe, p.zero, fp8_gather=t.fp8_param_gather,
                               tp_group=groups["tp"] if p.sequence_parallel else None,
                               amax_group=groups["stage"]) as fp8_state:
            with meter, meter.functions():
                _microbatch(w, layout, rank, rec, chunks, meter, dtype)
            used = meter.finish(exclude=_state_tensors(chunks, fp8_state))
            labelled = {}
            if label_layers:
                labelled = {"params": manifest.param_manifest(chunks, rank),
                            **{n: pa.Table.from_pylist([{"rank": rank, **r} for r in rows])
                               for n, rows in meter.labelled(_state_tensors(chunks, fp8_state)).items()}}
            dp = data_parallel.DataParallel(chunks, groups, p, dtype, rec=rec, grad_dtype=grad_dtype)
            dp.grad_sync()
            dp.step()
            with rec.phase("optimizer"):  # the next step's FP8 weight copies, once per step
                fp8.cast_weights(fp8_state)
        mem = data_parallel.rank_memory(chunks, groups, p, dtype, fsdp.resident_unsharded(chunks, p), grad_dtype)
        # the model's buffers (llama's RoPE tables) are held beside the parameters
        mem = dataclasses.replace(mem, param_bytes=mem.param_bytes + data_parallel.buffer_bytes(chunks))
        # Transformer Engine's FP8 weight copies (and transposes) live across micro-batches
        mem = dataclasses.replace(mem, param_bytes=mem.param_bytes + fp8.cached_weight_bytes(fp8_state))
        mem = dataclasses.replace(mem, param_bytes=mem.param_bytes - data_parallel.fp8_primary_savings(fp8_state, p.zero))
        c = layout.coords(rank)
        ranks = pa.table({
            "rank": [rank], "role": [layout.role_of(rank)], "pp_rank": [c.pp], "tp_rank": [c.tp],
            "dp_rank": [c.dp], "cp_rank": [c.cp], "graph_hash": [""], "param_bytes": [mem.param_bytes],
            "grad_bytes": [mem.grad_bytes], "optimizer_bytes": [mem.optimizer_bytes],
            "activation_bytes_per_microbatch": [used.saved_bytes],
            "trace_wall_s": [time.perf_counter() - t0]}, schema=TRACED_RANKS)
        ranks = ranks.append_column("peak_bytes_per_microbatch", pa.array([used.peak_bytes], pa.int64()))
        ranks = ranks.append_column("activation_bytes_per_chunk", pa.array([list(used.chunk_bytes)], pa.list_(pa.int64())))
        ranks = ranks.append_column("reserved_bytes_per_microbatch", pa.array([used.reserved_bytes], pa.int64()))
        return {**rec.tables(), "ranks": ranks, **labelled}
    finally:
        dist.destroy_process_group()


def _state_tensors(chunks: list, fp8_state) -> list[torch.Tensor]:
    """Tensors made during the micro-batch that are the rank's state, counted by rank_memory: the
    parameters' gradients and the FP8 weight copies cached across micro-batches."""
    out = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
    if fp8_state is not None and fp8_state.cached_weights:
        out += [t for _, copies in fp8_state.weights.values() for t in copies]
    return out


def _parallelize(w: Workload, layout: Layout, rank: int, groups: dict, chunks: list, dtype) -> None:
    p = w.parallel
    # with FSDP the tensor-parallel mesh must be the tp dimension of the 2-D (dp, tp) mesh
    mesh2d = fsdp.dp_tp_mesh(layout, rank, groups) if p.zero == 3 and p.dp * p.cp > 1 else None
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
            prev = layout.chunk_peer(rank, i, -1, v)
            if prev is None:
                with rec.muted():  # token ids come from the data loader, not a kernel
                    x = torch.zeros(b, seq, dtype=torch.long)
            elif prev == rank:  # a V's turn: the previous virtual stage is this rank's other chunk
                x = outputs[i - 1].detach().requires_grad_(True)
            else:
                with rec.muted():
                    x = torch.empty(b, s, h, dtype=dtype)
                dist.recv(x, src=prev)
                x.requires_grad_(True)
            with saved_tensors_hooks(meter.pack, lambda t: t):
                y = chunk(x)
                y = _loss(y, w.training.cross_entropy_fusion) if chunk.last else y
            fp8.reduce_amaxes(fp8.active())
            meter.end_chunk()
            nxt = layout.chunk_peer(rank, i, 1, v)
            if nxt is not None and nxt != rank:
                dist.send(y.detach(), dst=nxt)
        inputs.append(x)
        outputs.append(y)
    meter.end_forward()  # what the forwards saved: the activations one micro-batch keeps in flight
    for i in reversed(range(len(chunks))):
        with rec.phase("backward", i):
            y, x = outputs[i], inputs[i]
            nxt = layout.chunk_peer(rank, i, 1, v)
            ctx = loss_parallel() if chunks[i].last and w.parallel.tp > 1 else nullcontext()
            if nxt is None:
                with ctx:
                    y.backward()
            elif nxt == rank:  # a V's turn: the gradient comes from this rank's other chunk
                y.backward(inputs[i + 1].grad)
            else:
                with rec.muted():
                    grad = torch.empty_like(y)
                dist.recv(grad, src=nxt)
                y.backward(grad)
                # the received gradient is done with (Megatron's backward_step drops it): freed
                # here, not when the next chunk's receive rebinds the name
                del grad
            fp8.reduce_amaxes(fp8.active())
            prev = layout.chunk_peer(rank, i, -1, v)
            if prev is not None and prev != rank:
                dist.send(x.grad, dst=prev)
