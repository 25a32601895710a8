"""Record every kernel-launching op of one rank's training step under fake tensors.

The recorder is a FakeTensorMode (so it also sees higher-order ops, docs/DESIGN.md, "Tracing on a CPU"), and keeps
only what a GPU would launch: top-level calls (not the decompositions fake tensors run inside
one op), on local tensors (not the DTensor wrapper call), outside DTensor's sharding propagation
(which re-runs ops at global shapes just to learn output shapes), and not views or allocations.

The mode does see each DTensor-level call (an op on DTensor arguments) before the DTensor
subclass runs it as local ops, which come back through the mode and are recorded. Those calls
are counted: each recorded compute or memcpy op carries in ``dtensor`` the DTensor-level calls
since the previous kernel of its task (its own, and views, transposes and detaches that launch
no kernel; calls left at the end of a phase go to its last kernel), and the count is part of
its kernel key. Where the host's time adds to the step (the local CPU device), the profile
stage charges each such call DTensor's dispatch time (echo.profile.host).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from echo.artifacts import COMMS, DEPS, OPS
from echo.trace import opinfo
from echo.trace.hashing import dtensor_flags

_FUNCTIONAL = {  # _c10d_functional op -> (collective, index of the group name argument)
    "all_reduce": ("all_reduce", 2), "all_reduce_": ("all_reduce", 2),
    "all_gather_into_tensor": ("all_gather", 2), "reduce_scatter_tensor": ("reduce_scatter", 3),
    "all_to_all_single": ("all_to_all", 3), "broadcast": ("broadcast", 2),
}
_LEGACY_P2P = {"send": "send", "recv_": "recv"}
# legacy c10d ops (FSDP2 and torch.distributed calls): op -> (collective, index of the buffer that
# nccl-tests' size counts, index of the ProcessGroup argument)
_LEGACY = {
    "allreduce_": ("all_reduce", 0, 1), "_allgather_base_": ("all_gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2), "broadcast_": ("broadcast", 0, 1),
}
_SHARDING_PROP_DEPTH = [0]  # > 0 while DTensor propagates shapes at global size


def _mute_sharding_propagation() -> None:
    """Wrap DTensor's shape propagation once so that the ops it runs are not recorded."""
    cls = ShardingPropagator
    if getattr(cls._propagate_tensor_meta_non_cached, "_echo_muted", False):
        return
    original = cls._propagate_tensor_meta_non_cached

    def muted(self, op_schema):
        _SHARDING_PROP_DEPTH[0] += 1
        try:
            return original(self, op_schema)
        finally:
            _SHARDING_PROP_DEPTH[0] -= 1

    muted._echo_muted = True
    cls._propagate_tensor_meta_non_cached = muted


@dataclass
class Context:
    """What the driver is doing now: it labels every recorded op."""

    phase: str = "forward"
    chunk: int = 0
    blocking: bool = True       # whether collectives issued now are waited on at once
    stream: str = "compute"     # stream for collectives issued now (compute-stream ops stay on compute)
    # process group name -> its kind (tp, dp, ep, ...): by name, since two kinds can hold the same
    # ranks (EP = DP) and must still be told apart; ranks -> kind for groups made elsewhere
    group_kinds: dict[str | tuple[int, ...], str] = field(default_factory=dict)
    layer: int = -1             # block of the chunk running now (forward; -1: outside the blocks)


def _unbox(pg) -> dist.ProcessGroup:
    """The dispatcher passes process groups to c10d ops as boxed ScriptObjects."""
    return pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)


class Recorder(FakeTensorMode):
    """FakeTensorMode that appends one row per launched kernel (see module docstring)."""

    def __init__(self, rank: int, **kwargs):
        super().__init__(allow_non_fake_inputs=True, **kwargs)
        _mute_sharding_propagation()
        self.rank = rank
        self.ctx = Context()
        self.ops: dict[str, list] = {f.name: [] for f in OPS}
        self.comms: dict[str, list] = {f.name: [] for f in COMMS}
        self.deps: dict[str, list] = {f.name: [] for f in DEPS}
        self._producer: dict[int, tuple[weakref.ref, int]] = {}
        self._depth = 0
        self._muted = 0
        self._dtensor_calls = 0  # DTensor-level calls not yet attributed to a recorded kernel ...
        self._dtensor_task: tuple[str, int] | None = None  # ... made in this (phase, chunk)
        self._last_kernel: dict[tuple[str, int], int] = {}  # (phase, chunk) -> its last kernel's row
        self._layer_nodes: list[tuple[int, int, int]] | None = None  # (first, end, layer) autograd nrs

    # -- layer labels (echo.trace.template) ---------------------------------------------------
    def label_layers(self, chunks: list) -> None:
        """Label each recorded op with the block it belongs to (an extra ``layer`` column).

        Forward ops take the block running now. Backward and recomputed ops run inside the
        autograd engine, on behalf of the node being executed: nodes are numbered as the forward
        creates them, so the numbers a block's forward created name the block of its backward."""
        self._layer_nodes = []
        self.ops["layer"] = []
        for chunk in chunks:
            for i, block in enumerate(chunk.blocks):
                block.register_forward_pre_hook(self._enter_block(i))
                block.register_forward_hook(self._leave_block(i))

    def _enter_block(self, i: int):
        def hook(module, args):
            if self.ctx.phase == "forward":
                self.ctx.layer = i
                module._echo_first_node = torch._C._autograd._get_sequence_nr()
        return hook

    def _leave_block(self, i: int):
        def hook(module, args, out):
            if self.ctx.phase == "forward":
                self._layer_nodes.append((module._echo_first_node, torch._C._autograd._get_sequence_nr(), i))
                self.ctx.layer = -1
        return hook

    def _layer_now(self) -> int:
        if self.ctx.phase == "forward":
            return self.ctx.layer
        node = torch._C._current_autograd_node()
        if node is None:
            return -1
        nr = node._sequence_nr()
        at = bisect.bisect_right(self._layer_nodes, (nr, float("inf"), 0)) - 1
        if at >= 0 and self._layer_nodes[at][0] <= nr < self._layer_nodes[at][1]:
            return self._layer_nodes[at][2]
        return -1

    # -- driver controls ----------------------------------------------------------------
    @contextmanager
    def phase(self, phase: str, chunk: int = 0, *, blocking: bool = True, stream: str = "compute") -> Iterator[None]:
        saved = self.ctx
        self.ctx = Context(phase, chunk, blocking, stream, saved.group_kinds)
        try:
            yield
        finally:
            self.ctx = saved

    def recompute(self):
        """Label ops as recompute (activation checkpointing re-running forward inside backward)."""
        return self.phase("recompute", self.ctx.chunk, blocking=self.ctx.blocking, stream=self.ctx.stream)

    @contextmanager
    def muted(self) -> Iterator[None]:
        """Run ops that have no counterpart on the real system (e.g. building fake buffers)."""
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1

    # -- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        top = self._depth == 0 and not self._muted and not _SHARDING_PROP_DEPTH[0]
        on_dtensor = any(issubclass(t, DTensor) for t in types)
        if top and on_dtensor:  # the subclass runs it next, as local ops recorded below
            task = (self.ctx.phase, self.ctx.chunk)
            if self._dtensor_calls and self._dtensor_task != task:
                self._settle_dtensor_calls()
            self._dtensor_calls += 1
            self._dtensor_task = task
        record = top and not on_dtensor
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if record:
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        ns, name = func.namespace, opinfo.base_name(func)
        if ns == "_c10d_functional" and name == "wait_tensor":
            self._alias(out, args[0])
        elif ns == "_c10d_functional" and name in _FUNCTIONAL:
            op, gi = _FUNCTIONAL[name]
            pg = dist.distributed_c10d._resolve_process_group(args[gi])
            self._add_comm(func, args, kwargs, out, op, dist.get_process_group_ranks(pg), peer=-1, group=pg)
        elif ns == "c10d" and name in _LEGACY_P2P:
            self._add_p2p(func, args, kwargs, out, _LEGACY_P2P[name])
        elif ns == "c10d" and name in _LEGACY:
            op, buf, gi = _LEGACY[name]
            pg = _unbox(args[gi])
            self._add_comm(func, args, kwargs, out, op, dist.get_process_group_ranks(pg), peer=-1, buffer=args[buf], group=pg)
        elif opinfo.is_free(func):
            self._alias(out, args[0] if args else None)
        else:
            self._add_op(func, args, kwargs, out, kind="memcpy" if opinfo.op_class(func) == "copy" else "compute")

    def _add_op(self, func, args, kwargs, out, *, kind: str, op_class: str | None = None,
                stream: str = "compute", comm_id: int = -1) -> int:
        seq = len(self.ops["seq"])
        args_json = opinfo.encode_args(args, kwargs)
        name = str(func)
        dtensor = 0
        task = (self.ctx.phase, self.ctx.chunk)
        if kind in ("compute", "memcpy"):  # a kernel: it carries the DTensor calls before it in its task
            if self._dtensor_calls and self._dtensor_task != task:
                self._settle_dtensor_calls()
            dtensor, self._dtensor_calls = self._dtensor_calls, 0
            self._last_kernel[task] = seq
        row = dict(rank=self.rank, seq=seq, name=name, op_class=op_class or opinfo.op_class(func), kind=kind,
                   phase=self.ctx.phase, chunk=self.ctx.chunk, microbatch=-1, stream=stream,
                   shapes=opinfo.shapes_of(args), args=args_json, dtype=opinfo.dtype_of(args),
                   flops=opinfo.matmul_flops(func, args), bytes=opinfo.moved_bytes(func, args, kwargs, out),
                   kernel_key=opinfo.kernel_key(name, args_json, dtensor_flags(dtensor)), comm_id=comm_id,
                   dtensor=dtensor)
        for k, v in row.items():
            self.ops[k].append(v)
        if self._layer_nodes is not None:
            self.ops["layer"].append(self._layer_now())
        for t in opinfo._tensors(list(args) + list(kwargs.values())):
            src = self._producer_of(t)
            if src is not None:
                self._dep(src, seq, "data")
        for t in self._written(func, args, out):
            self._producer[id(t)] = (weakref.ref(t), seq)
        return seq

    def _add_comm(self, func, args, kwargs, out, op: str, ranks: list[int], peer: int, buffer=None,
                  group: dist.ProcessGroup | None = None) -> None:
        """``buffer``: the tensor(s) whose size nccl-tests counts (default: the first argument,
        times the group size for a functional all-gather, which passes its input)."""
        comm_id = len(self.comms["comm_id"])
        kind = "p2p" if op in ("send", "recv") else "collective"
        kinds = self.ctx.group_kinds
        group_kind = kinds.get(group.group_name) if group is not None else None
        group_kind = group_kind or kinds.get(tuple(ranks), "world" if len(ranks) > 2 else "pp")
        # data-parallel traffic (ZeRO/FSDP gathers, gradient reduction) runs on its own stream,
        # overlapped with compute; the rest (TP, CP) sits on the critical path unless told otherwise
        overlapped = group_kind in ("dp", "edp", "dpcp")
        stream = "p2p" if kind == "p2p" else ("comm" if overlapped else self.ctx.stream)
        seq = self._add_op(func, args, kwargs, out, kind=kind, op_class=kind, stream=stream, comm_id=comm_id)
        if buffer is None:
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            nbytes = opinfo.tensor_bytes(t) * (len(ranks) if op == "all_gather" else 1)
        else:
            ts = opinfo._tensors(buffer)
            t, nbytes = ts[0], sum(opinfo.tensor_bytes(x) for x in ts)
        blocking = (self.ctx.blocking and not overlapped) if kind == "collective" else op == "recv"
        row = dict(rank=self.rank, comm_id=comm_id, seq=seq, op=op, group=list(ranks), group_size=len(ranks),
                   group_kind=group_kind, bytes=nbytes, peer=peer, dtype=str(t.dtype).removeprefix("torch."),
                   phase=self.ctx.phase, chunk=self.ctx.chunk, blocking=blocking)
        for k, v in row.items():
            self.comms[k].append(v)

    def _add_p2p(self, func, args, kwargs, out, op: str) -> None:
        pg, peer_in_group = _unbox(args[1]), args[2]
        ranks = dist.get_process_group_ranks(pg)
        peer = ranks[peer_in_group]
        self._add_comm(func, args, kwargs, out, op, sorted([self.rank, peer]), peer=peer)

    # -- data dependencies ----------------------------------------------------------------
    def _written(self, func, args, out) -> list[torch.Tensor]:
        """Tensors an op produces: its outputs, and the arguments it writes in place."""
        written = opinfo._tensors(out)
        for arg, value in zip(func._schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += opinfo._tensors(value)
        return written

    def _producer_of(self, t: torch.Tensor) -> int | None:
        hit = self._producer.get(id(t))
        return hit[1] if hit and hit[0]() is t else None

    def _alias(self, out, src) -> None:
        if not isinstance(src, torch.Tensor):
            return
        seq = self._producer_of(src)
        if seq is not None:
            for t in opinfo._tensors(out):
                self._producer[id(t)] = (weakref.ref(t), seq)

    def _dep(self, src: int, dst: int, kind: str) -> None:
        self.deps["rank"].append(self.rank)
        self.deps["src"].append(src)
        self.deps["dst"].append(dst)
        self.deps["kind"].append(kind)

    def _settle_dtensor_calls(self) -> None:
        """Charge DTensor calls left at the end of their task (no kernel followed them there) to
        that task's last kernel, rather than to a kernel of another phase."""
        seq = self._last_kernel.get(self._dtensor_task)
        if seq is not None:
            n = self.ops["dtensor"][seq] + self._dtensor_calls
            self.ops["dtensor"][seq] = n
            self.ops["kernel_key"][seq] = opinfo.kernel_key(self.ops["name"][seq], self.ops["args"][seq],
                                                            dtensor_flags(n))
            self._dtensor_calls = 0

    # -- results ----------------------------------------------------------------------------
    def tables(self) -> dict[str, pa.Table]:
        if self._dtensor_calls:
            self._settle_dtensor_calls()
        ops = pa.table({k: v for k, v in self.ops.items() if k != "layer"}, schema=OPS)
        if self._layer_nodes is not None:
            ops = ops.append_column("layer", pa.array(self.ops["layer"], pa.int32()))
        return {"ops": ops, "comms": pa.table(self.comms, schema=COMMS),
                "deps": pa.table(self.deps, schema=DEPS)}
