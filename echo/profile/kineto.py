"""Import kernel durations from a PyTorch profiler (Kineto) Chrome trace of a real run.

``torch.profiler.profile(record_shapes=True)`` writes one ``cpu_op`` event per dispatched op with
its name (``aten::mm``), the dims of each argument (``Input Dims``: a list per tensor, a list of
lists per tensor list, ``[]`` for anything else) and their types (``Input type``: ``float``,
``c10::BFloat16``, ``TensorList``, ``Scalar``, ...). A traced kernel is matched to the events
whose op name and tensor arguments (shapes, dtypes) equal its own: its *signature*. Scalar
arguments are not compared (the profiler records them as strings, and a kernel's speed rarely
depends on them); kernels that differ only in scalars share the imported duration. Zero-dimensional
tensors and empty lists count as scalars on both sides: the profiler records a Python number
passed to a tensor op as a 0-d tensor, where the tracer records the number.

Only the outermost matching event counts: an op dispatched inside another matched op (the
``aten::copy_`` inside ``aten::_to_copy``) is part of its parent's time, as it is part of the
parent's kernel in the trace, which records ops where they enter the dispatcher.

Durations: on a CPU trace, the event's own wall time; on a GPU trace (``kernel``, ``gpu_memcpy``
and ``gpu_memset`` events present), the summed device time of the GPU work the op launched (the
runtime calls inside the op's span, linked to device events by ``correlation``). Each kernel gets
the median over its matched events (robust to a preempted occurrence).
"""

from __future__ import annotations

import gzip
import json
import statistics
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from echo.profile.kernel import Kernel

# Kineto's ``Input type`` strings -> torch dtype names (as the trace records them)
KINETO_DTYPES = {
    "float": "float32", "double": "float64", "c10::Half": "float16", "c10::BFloat16": "bfloat16",
    "long int": "int64", "long": "int64", "int": "int32", "short int": "int16", "signed char": "int8",
    "unsigned char": "uint8", "bool": "bool", "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128", "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver", "hip_runtime")

Signature = tuple  # (op name, ((shape, dtype) | ("list", shapes)), ...)


class KinetoError(ValueError):
    """The file is not a readable Kineto Chrome trace."""


@dataclass
class Imported:
    """What an import found: durations for matched kernels, and what could not be matched."""

    durations_us: dict[str, float]        # kernel_key -> median duration of its events
    events: dict[str, int]                # kernel_key -> matched events
    unmatched: list[Kernel]               # kernels of the trace with no event of their signature
    device: str                           # cpu | gpu: whose durations were read
    steps_us: list[float] = field(default_factory=list)  # ProfilerStep#N durations, in order
    cpu_ops: int = 0                      # cpu_op events in the file

    def note(self) -> dict[str, Any]:
        """Counts for the stage's note (profile.json)."""
        by_op: dict[str, int] = defaultdict(int)
        for k in self.unmatched:
            by_op[k.name] += 1
        return {"device": self.device, "matched_kernels": len(self.durations_us),
                "unmatched_kernels": len(self.unmatched),
                "unmatched_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                "matched_events": sum(self.events.values()), "cpu_op_events": self.cpu_ops,
                "profiler_steps": len(self.steps_us),
                "mean_step_us": statistics.fmean(self.steps_us) if self.steps_us else None}


IMPORTS_DIR = Path("imports/kineto")


def dropped_in_trace(workload: str, hardware: str, root: Path = IMPORTS_DIR) -> dict[str, str]:
    """``{"imported": path}`` of the Kineto trace of ``workload`` on ``hardware`` dropped at
    ``{root}/{workload}/{hardware}.json`` (or ``.json.gz``), or ``{}`` when there is none (the
    profile rule's optional input)."""
    for suffix in (".json", ".json.gz"):
        path = Path(root) / workload / f"{hardware}{suffix}"
        if path.is_file():
            return {"imported": str(path)}
    return {}


# --- signatures ---------------------------------------------------------------------------
def kernel_signature(k: Kernel) -> Signature:
    """(op name as the profiler spells it, tensor arguments in schema order) of a traced kernel."""
    try:
        call = json.loads(k.args)
    except (TypeError, ValueError) as exc:
        raise KinetoError(f"kernel {k.kernel_key}: unreadable args JSON: {exc}") from exc
    schema = _schema_args(k.name)
    kwargs = call.get("kwargs", {})
    kw_names = sorted(kwargs, key=lambda n: schema.get(n, (len(schema), ""))[0])
    positional_types = sorted(schema.values())
    values = [(v, positional_types[i][1] if i < len(positional_types) else "")
              for i, v in enumerate(call.get("args", []))]
    values += [(kwargs[n], schema.get(n, (0, ""))[1]) for n in kw_names]
    entries = []
    for v, type_str in values:
        if type_str == "List[Optional[Tensor]]":
            continue  # the profiler records such lists (index_put_'s indices) as nothing at all
        if (e := _trace_entry(v)) is not None:
            entries.append(e)
    return (profiler_name(k.name), tuple(entries))


def profiler_name(name: str) -> str:
    """aten.mm.default -> aten::mm (the profiler records the op, not the overload)."""
    parts = name.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 else name


def _schema_args(name: str) -> dict[str, tuple[int, str]]:
    """Argument name -> (position, type) from the op's schema ({} for an op torch does not know)."""
    try:
        from echo.profile.rebuild import resolve

        return {a.name: (i, str(a.type)) for i, a in enumerate(resolve(name)._schema.arguments)}
    except Exception:  # an op this torch does not know: no schema to order or type by
        return {}


def _trace_entry(v: Any):
    if isinstance(v, dict) and "T" in v:
        shape = tuple(int(d) for d in v["T"])
        return (shape, str(v.get("dt", "float32"))) if shape else None
    if isinstance(v, list) and v and all(isinstance(x, dict) and "T" in x for x in v):
        return ("list", tuple(tuple(int(d) for d in x["T"]) for x in v))
    return None


def event_signature(ev: dict) -> Signature | None:
    """The signature of a cpu_op event, or None when it carries no shapes (record_shapes off)."""
    args = ev.get("args") or {}
    dims, types = args.get("Input Dims"), args.get("Input type")
    if dims is None or types is None or len(dims) != len(types):
        return None
    entries = []
    for d, t in zip(dims, types, strict=True):
        if t == "TensorList" or (isinstance(d, list) and d and all(isinstance(x, list) for x in d)):
            if t in ("TensorList", "GenericList") and d:
                entries.append(("list", tuple(tuple(int(x) for x in s) for s in d)))
            continue
        dtype = KINETO_DTYPES.get(t)
        if dtype is not None and isinstance(d, list) and d:
            entries.append((tuple(int(x) for x in d), dtype))
    return (ev.get("name", ""), tuple(entries))


# --- reading the trace -------------------------------------------------------------------------
def load_document(path: Path) -> dict:
    """The Chrome trace at ``path`` (.json or .json.gz) as a dict with its ``traceEvents`` (only
    the dict events kept) and its metadata (``distributedInfo``, ``deviceProperties``, ...);
    KinetoError naming the file and the reason when it is no Kineto trace."""
    path = Path(path)
    if not path.is_file():
        raise KinetoError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as fh:
            data = json.load(fh)
    except (OSError, EOFError, ValueError) as exc:  # EOFError: a gzip cut short
        raise KinetoError(f"{path}: not a JSON Chrome trace ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise KinetoError(f"{path}: no traceEvents list")
    events = [e for e in events if isinstance(e, dict)]
    if not any(e.get("cat") == "cpu_op" for e in events):
        raise KinetoError(f"{path}: no cpu_op events (was it recorded with the CPU activity?)")
    doc = dict(data) if isinstance(data, dict) else {}
    doc["traceEvents"] = events
    return doc


def load_events(path: Path) -> list[dict]:
    """The traceEvents of a Chrome trace file whose op events carry their shapes."""
    events = load_document(path)["traceEvents"]
    if not any((e.get("args") or {}).get("Input Dims") is not None for e in events
               if e.get("cat") == "cpu_op"):
        raise KinetoError(f"{path}: cpu_op events carry no 'Input Dims': record it with "
                          "torch.profiler.profile(record_shapes=True)")
    return events


def import_trace(kernels: Iterable[Kernel], path: Path) -> Imported:
    """Match ``kernels`` to the op events of the Kineto trace at ``path``."""
    kernels = list(kernels)
    events = load_events(path)
    by_sig: dict[Signature, list[str]] = defaultdict(list)
    for k in kernels:
        by_sig[kernel_signature(k)].append(k.kernel_key)
    gpu = _gpu_time_by_cpu_op(events)
    samples: dict[Signature, list[float]] = defaultdict(list)
    cpu_ops = 0
    for thread_events in _by_thread(e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"):
        cpu_ops += len(thread_events)
        for ev in _outermost_matching(thread_events, by_sig):
            sig = event_signature(ev)
            samples[sig].append(gpu.get(_event_id(ev), 0.0) if gpu is not None else float(ev.get("dur", 0.0)))
    durations, counts = {}, {}
    for sig, values in samples.items():
        for key in by_sig[sig]:
            durations[key] = float(statistics.median(values))
            counts[key] = len(values)
    unmatched = [k for k in kernels if k.kernel_key not in durations]
    steps = sorted((e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    return Imported(durations, counts, unmatched, "gpu" if gpu is not None else "cpu",
                    [float(e["dur"]) for e in steps], cpu_ops)


def _by_thread(events: Iterable[dict]) -> list[list[dict]]:
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        threads[(e.get("pid"), e.get("tid"))].append(e)
    # parents first: earlier start, and at equal starts the longer one
    return [sorted(v, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0)))) for v in threads.values()]


def _outermost_matching(events: list[dict], wanted: dict[Signature, list[str]]) -> list[dict]:
    """Events (of one thread, parents first) whose signature is wanted and that no wanted event
    encloses."""
    out = []
    open_until = -1.0  # end of the enclosing matched event, if any
    for ev in events:
        ts, end = float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))
        if ts < open_until:
            continue
        if event_signature(ev) in wanted:
            out.append(ev)
            open_until = end
    return out


def _event_id(ev: dict) -> tuple:
    return (ev.get("pid"), ev.get("tid"), float(ev["ts"]))


def _gpu_time_by_cpu_op(events: list[dict]) -> dict[tuple, float] | None:
    """For a GPU trace: device microseconds launched inside each cpu_op's span (all cpu_ops, nested
    ones included in their ancestors), keyed by _event_id; None for a CPU-only trace."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not device:
        return None
    by_corr: dict[Any, float] = defaultdict(float)
    for e in device:
        by_corr[(e.get("args") or {}).get("correlation")] += float(e.get("dur", 0.0))
    launches: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in RUNTIME_CATEGORIES:
            corr = (e.get("args") or {}).get("correlation")
            if corr in by_corr:
                launches[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), by_corr[corr]))
    # per thread: launch times and the prefix sums of their device time, for range sums
    index = {}
    for thread, v in launches.items():
        v.sort()
        index[thread] = ([t for t, _ in v], list(accumulate((us for _, us in v), initial=0.0)))
    out: dict[tuple, float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "cpu_op":
            continue
        times, prefix = index.get((e.get("pid"), e.get("tid")), ([], [0.0]))
        ts, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        out[_event_id(e)] = prefix[bisect_right(times, end)] - prefix[bisect_left(times, ts)]
    return out
