"""Read a GPU PyTorch profiler (Kineto) trace of a real job: every GPU activity with the CPU-side
op that launched it, its NCCL collective, its step and its stream.

A Kineto trace links the two sides by ``correlation``: each kernel, memcpy or memset on the GPU
carries the id of the CUDA runtime call (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ...) that
enqueued it, and that call sits, on its CPU thread, inside the ``cpu_op`` events of the ops that
were running (``aten::linear`` > ``aten::matmul`` > ``aten::mm``). The innermost op is the one
whose kernel it is; its ``Input Dims`` / ``Input type`` (``record_shapes=True``) give the shapes
and dtypes. Collectives sit inside ``c10d::allreduce_`` (and kin) and ``record_param_comms``,
whose arguments carry the message (``In msg nelems``, ``dtype``) and, in newer traces, the
group (``Process Group Ranks``); older traces only give the c10d op's tensor dims.

GPU activity whose correlation has no runtime call in the file was launched before the profiler's
window opened (the tail of the previous step): it has no CPU side to match and is counted apart,
out of the matched share's denominator.

Why a reader of its own rather than HolisticTraceAnalysis: HTA parses these same files, but
installs jupyterlab and plotly with it, and what Echo needs (the launch stack of each kernel and
the c10d arguments) is about a hundred lines over the Chrome-trace JSON that echo.profile.kineto
already reads.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from echo.profile.intervals import merge, overlap
from echo.profile.kineto import (
    GPU_CATEGORIES,
    KINETO_DTYPES,
    RUNTIME_CATEGORIES,
    KinetoError,
    event_signature,
    load_document,
)

# c10d / record_param_comms collective names -> Echo's (echo.artifacts.COMMS.op)
_COLLECTIVE = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
    "_allgather_base": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather", "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all", "all_to_all": "all_to_all", "broadcast": "broadcast",
    "send": "send", "recv": "recv", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier",
}
# ... and the NCCL kernel's own word for it (ncclKernel_AllReduce_RING_LL_Sum_float, ncclDevKernel_...)
_NCCL_KERNEL = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
                "Broadcast": "broadcast", "Reduce": "reduce", "SendRecv": "send_recv",
                "Send": "send", "Recv": "recv"}
# Kineto's record_param_comms dtype names -> torch's
_COMMS_DTYPES = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64",
                 "Int": "int32", "Long": "int64", "Byte": "uint8", "Char": "int8", "Bool": "bool"}
DTYPE_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
                "int16": 2, "uint8": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "complex64": 8, "complex128": 16}
_KIND = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


@dataclass(frozen=True)
class OpEvent:
    """One cpu_op event: an op as it entered the dispatcher."""

    name: str
    ts: float
    end: float
    args: dict

    @property
    def comm_wrapper(self) -> bool:
        """c10d / NCCL bookkeeping around a collective, not the op whose kernel it is."""
        return (self.name == "record_param_comms" or self.name.startswith(("c10d::", "nccl:"))
                or self.name.startswith("ProfilerStep#"))


@dataclass
class RankTrace:
    """What one rank's file holds, read (echo.profile.gpu_import turns it into tables)."""

    path: Path
    rank: int
    world_size: int | None
    device: str                    # deviceProperties' name, "" when the trace has none
    shapes_recorded: bool          # record_shapes was on (cpu_op events carry Input Dims)
    activities: list[dict]         # one per GPU activity: see gpu_import.ACTIVITY columns
    steps: list[tuple[int, float, float]]   # (ProfilerStep number, start us, duration us)


def read_rank(path: Path, rank: int | None = None) -> RankTrace:
    """Read one rank's GPU trace; KinetoError when it is no GPU Kineto trace."""
    doc = load_document(path)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        raise KinetoError(f"{path}: no GPU activity (kernel, gpu_memcpy, gpu_memset events): "
                          "a CPU-only trace; record it with ProfilerActivity.CUDA")
    info = doc.get("distributedInfo") or {}
    if rank is None:
        rank = int(info.get("rank", 0))
    props = doc.get("deviceProperties") or [{}]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    # record_function ranges named nccl:all_reduce (...) carry the message's tensor where the c10d
    # op around them records an empty tensor list
    # op (DDP's bucket all-reduce); the optimizer's range names the kernels a fused optimizer
    # (apex's multi_tensor_apply) launches from outside the dispatcher
    wrappers = [e for e in events if e.get("cat") == "user_annotation"
                and str(e.get("name", "")).startswith(("nccl:", "Optimizer.step#"))]
    shapes = any((e.get("args") or {}).get("Input Dims") is not None for e in cpu_ops)
    launches = _launch_stacks(events, cpu_ops + wrappers)
    step_events = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
                          and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: float(e["ts"]))
    steps = [(int(e["name"].split("#", 1)[1]), float(e["ts"]), float(e.get("dur", 0.0))) for e in step_events]
    starts = [s[1] for s in steps]
    groups = _process_groups(info)
    rows = [_activity(e, launches.get((e.get("args") or {}).get("correlation")), steps, starts, groups)
            for e in gpu]
    _concurrency(rows)
    return RankTrace(Path(path), rank, info.get("world_size"), str(props[0].get("name", "")) if props else "",
                     shapes, rows, steps)


# --- the launch side ------------------------------------------------------------------------
def _launch_stacks(events: list[dict], cpu_ops: list[dict]) -> dict:
    """correlation -> (launch ts, [enclosing cpu_op events, outermost first]) for every runtime call."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in cpu_ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    calls: dict[tuple, list[tuple[float, object]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in RUNTIME_CATEGORIES:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                calls[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), corr))
    out = {}
    for thread, launches in calls.items():
        # parents first: earlier start, and at equal starts the longer one
        ops = sorted(by_thread.get(thread, ()), key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[OpEvent] = []
        i = 0
        for ts, corr in sorted(launches, key=lambda c: c[0]):
            while i < len(ops) and float(ops[i]["ts"]) <= ts:
                op = ops[i]
                start = float(op["ts"])
                while stack and stack[-1].end <= start:
                    stack.pop()
                stack.append(OpEvent(str(op.get("name", "")), start, start + float(op.get("dur", 0.0)),
                                     op.get("args") or {}))
                i += 1
            while stack and stack[-1].end < ts:
                stack.pop()
            out[corr] = (ts, tuple(stack))
    return out


def _activity(e: dict, launch, steps, starts, groups) -> dict:
    args = e.get("args") or {}
    name = str(e.get("name", ""))
    row = {"kind": _KIND[e["cat"]], "kernel": name, "stream": int(args.get("stream", -1)),
           "ts_us": float(e["ts"]), "dur_us": float(e.get("dur", 0.0)),
           "correlation": int(args.get("correlation", -1)), "launched": launch is not None,
           "step": -1, "op": None, "op_ts_us": None, "op_class": None, "shapes": None, "dtype": None,
           "signature": None, "with_shapes": False, "collective": None, "group_size": None,
           "group_ranks": None, "bytes": None, "input_bytes": None}
    nccl = _nccl_kernel(name)
    if nccl:
        row["collective"] = nccl
    if launch is None:
        return row
    ts, stack = launch
    i = bisect_right(starts, ts) - 1
    if i >= 0 and ts <= steps[i][1] + steps[i][2]:
        row["step"] = steps[i][0]
    ops = [op for op in stack if not op.comm_wrapper]
    if ops:
        op = ops[-1]
        dims, dtype = tensor_inputs(op.args)
        row.update(op=op.name, op_ts_us=op.ts, op_class=op_class(op.name), dtype=dtype,
                   shapes=json.dumps(dims) if dims is not None else None, with_shapes=bool(dims),
                   input_bytes=sum(_tensor_bytes(op.args)) if dims else None)
        sig = event_signature({"name": op.name, "args": op.args})
        row["signature"] = signature_id(sig) if sig is not None and dims else None
    comm = [op for op in stack if op.comm_wrapper and not op.name.startswith("ProfilerStep#")]
    if comm:
        row.update(_collective(comm, groups))
        row["op_class"] = "collective"
        row["with_shapes"] = row["bytes"] is not None
        if row["collective"] is None:
            row["collective"] = nccl
    return row


def _concurrency(rows: list[dict]) -> None:
    """Fill each row's ``concurrent_share``: the share of its duration during which GPU work of
    another stream ran (an NCCL kernel beside a GEMM takes SMs and HBM bandwidth from it, a memcpy
    HBM bandwidth)."""
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for a in rows:
        by_stream[a["stream"]].append((a["ts_us"], a["ts_us"] + a["dur_us"]))
    others = {s: merge([iv for t, ivs in by_stream.items() if t != s for iv in ivs]) for s in by_stream}
    starts = {s: [lo for lo, _ in merged] for s, merged in others.items()}
    for a in rows:
        merged = others.get(a["stream"])
        if not merged or a["dur_us"] <= 0:
            a["concurrent_share"] = 0.0
            continue
        lo, hi = a["ts_us"], a["ts_us"] + a["dur_us"]
        first = max(0, bisect_right(starts[a["stream"]], lo) - 1)  # the others' intervals that can reach it
        a["concurrent_share"] = overlap([(lo, hi)], merged[first:]) / a["dur_us"]


def _nccl_kernel(name: str) -> str | None:
    for prefix in ("ncclKernel_", "ncclDevKernel_"):
        if name.startswith(prefix):
            word = name[len(prefix):].split("_", 1)[0].split("(", 1)[0]
            return _NCCL_KERNEL.get(word, word.lower())
    return None


def _collective(comm: list[OpEvent], groups: dict) -> dict:
    """Collective, group and bytes from the c10d op and record_param_comms around a launch."""
    out: dict = {"collective": None, "bytes": None, "group_size": None, "group_ranks": None}
    c10d = [op for op in comm if op.name.startswith(("c10d::", "nccl:"))]
    rpc = [op for op in comm if op.name == "record_param_comms"]
    if c10d:
        names = [op.name.split(":")[-1].rstrip("_") for op in c10d]
        out["collective"] = next((_COLLECTIVE[n] for n in reversed(names) if n in _COLLECTIVE), None)
    for op in reversed(rpc):  # newer traces: the message and group as arguments
        a = op.args
        if "Collective name" in a:
            out["collective"] = _COLLECTIVE.get(str(a["Collective name"]).rstrip("_"), out["collective"])
        dtype = _COMMS_DTYPES.get(str(a.get("dtype")), KINETO_DTYPES.get(str(a.get("dtype"))))
        nelems = max(int(a.get("In msg nelems", 0) or 0), int(a.get("Out msg nelems", 0) or 0))
        if nelems and dtype in DTYPE_BYTES:
            out["bytes"] = nelems * DTYPE_BYTES[dtype]
        if a.get("Group size"):
            out["group_size"] = int(a["Group size"])
        ranks = a.get("Process Group Ranks")
        if isinstance(ranks, str) and ranks.startswith("["):
            out["group_ranks"] = ranks
        elif str(a.get("Process Group Name")) in groups:
            out["group_ranks"] = json.dumps(groups[str(a["Process Group Name"])])
        if out["bytes"] is not None:
            return out
    # older traces: the tensors of the c10d op, its record_param_comms and nccl: range give the
    # message; the largest is nccl-tests' size (the whole buffer: all-gather output, reduce-scatter
    # input), and the c10d op's output / input ratio an all-gather's or reduce-scatter's group size
    sizes = [b for op in comm for b in _tensor_bytes(op.args)]
    if sizes:
        out["bytes"] = max(sizes)
    if out["group_size"] is None and out["collective"] in ("all_gather", "reduce_scatter"):
        for op in c10d:
            pair = _tensor_bytes(op.args)[:2]
            if len(pair) == 2 and min(pair) > 0 and max(pair) % min(pair) == 0:
                out["group_size"] = max(pair) // min(pair)
                break
    return out


def _process_groups(info: dict) -> dict[str, list[int]]:
    """pg_name -> ranks from distributedInfo's pg_config (newer traces)."""
    return {str(pg.get("pg_name")): list(pg.get("ranks", [])) for pg in info.get("pg_config") or []
            if isinstance(pg, dict) and isinstance(pg.get("ranks"), list)}


# --- the op side ------------------------------------------------------------------------------
def tensor_inputs(args: dict) -> tuple[list[list[int]] | None, str | None]:
    """(shapes of the op's tensor inputs, in order; dtype of the first) from Input Dims / Input type;
    (None, None) when the trace recorded no shapes. A tensor list contributes its tensors."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    if dims is None or types is None or len(dims) != len(types):
        return None, None
    shapes: list[list[int]] = []
    dtype = None
    for d, t in zip(dims, types, strict=True):
        if isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            shapes += [[int(v) for v in x] for x in d]
        elif t in KINETO_DTYPES and isinstance(d, list) and d:
            shapes.append([int(v) for v in d])
            dtype = dtype or KINETO_DTYPES[t]
    return shapes, dtype


def _tensor_bytes(args: dict) -> list[int]:
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    out = []
    for d, t in zip(dims, types, strict=False):
        size = DTYPE_BYTES.get(KINETO_DTYPES.get(t, ""), 0)
        if size and isinstance(d, list) and d and all(isinstance(v, int) for v in d):
            out.append(math.prod(d) * size)
        elif size and isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            out.append(sum(math.prod(x) for x in d) * size)  # 0 for a TensorList: its dtype is not recorded
    return out


def signature_id(sig) -> str:
    """A stable id of a kineto signature (echo.profile.kineto): what an imported op and a traced
    kernel share when they are the same op on the same tensors."""
    import hashlib

    return hashlib.sha1(repr(sig).encode()).hexdigest()[:16]


@cache
def op_class(name: str) -> str:
    """The tracer's op class (echo.trace.opinfo.op_class) of a profiler op name (aten::mm), by its
    default overload; "other" for an op this torch does not know."""
    import torch

    from echo.trace.opinfo import op_class as traced_class  # torch, only once a trace is read

    ns, _, base = name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, ns), base)
        overloads = packet.overloads()
        func = getattr(packet, "default" if "default" in overloads else overloads[0])
    except (AttributeError, RuntimeError, IndexError):
        return "other"
    return traced_class(func)
