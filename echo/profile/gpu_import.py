"""Import a real job's GPU Kineto traces (one file per rank) into Echo's tables.

``import_traces(path, hardware)`` reads a trace file or a folder of per-rank files
(echo.profile.gpu_trace), and ``write_import`` writes, under ``results/import/{job}/{hardware}/``:

- ``activity.parquet`` (echo.artifacts.IMPORTED_ACTIVITY): every GPU kernel, memcpy and memset with
  its launching op (shapes, dtype, op class), its NCCL collective (group, bytes), its step and stream,
  and, when the traced workload is given, the traced ``kernel_key`` of the same op on the same tensors;
- ``streams.parquet`` (IMPORTED_STREAMS): per rank, step and stream, the busy and idle time;
- ``model_error.parquet`` (IMPORTED_MODEL_ERROR): the hardware model's estimate of every measured
  GEMM, elementwise and copy op (echo.profile.kineto_check);
- ``import.json``: per rank and in all, the share of GPU kernel time matched.

The matched share counts kernel time launched inside the window: a kernel is matched when the op
that launched it carries its tensor shapes, or, for an NCCL kernel, when its collective and message
size are known. Kernels without shapes (a trace recorded with ``record_shapes=False``) still carry
their op's name; the share "by name" counts those too.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from echo.artifacts import IMPORTED_ACTIVITY, IMPORTED_MODEL_ERROR, IMPORTED_STREAMS
from echo.config import Hardware
from echo.io import write_json, write_parquet
from echo.profile import kineto_check
from echo.profile.gpu_trace import RankTrace, read_rank, signature_id
from echo.profile.intervals import length, merge
from echo.profile.kernel import Kernel
from echo.profile.kineto import KinetoError, kernel_signature

log = logging.getLogger(__name__)

TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")


@dataclass
class Import:
    """A real job's traces, read and checked."""

    ranks: list[RankTrace]
    activity: pa.Table
    streams: pa.Table
    model_error: pa.Table
    summary: dict = field(default_factory=dict)

    @property
    def matched_share(self) -> float:
        return self.summary["matched_share"]


def job_name(path: Path) -> str:
    """The job a trace file or folder names: the folder's name, or the file's without suffixes."""
    path = Path(path)
    name = path.name
    for suffix in sorted(TRACE_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


IMPORTS_DIR = Path("imports/gpu")


def dropped_in_job(job: str, root: Path = IMPORTS_DIR) -> Path:
    """Where the workflow's import_kineto rule finds job ``job``: the folder ``{root}/{job}/`` of
    per-rank trace files, or the single file ``{root}/{job}.json`` (``.json.gz``)."""
    folder = Path(root) / job
    if folder.is_dir():
        return folder
    for suffix in (".json", ".json.gz"):
        if (single := Path(root) / f"{job}{suffix}").is_file():
            return single
    raise KinetoError(f"{folder}: no such folder of per-rank traces (nor {folder}.json / .json.gz)")


def rank_files(path: Path) -> list[Path]:
    """The trace file at ``path``, or the trace files of the folder ``path`` (one per rank)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
        if not files:
            raise KinetoError(f"{path}: a folder with no trace files (*.json, *.json.gz)")
        return files
    raise KinetoError(f"{path}: no such file or folder")


def import_traces(path: Path | list[Path], hardware: Hardware, kernels: list[Kernel] | None = None) -> Import:
    """Read every rank's trace under ``path`` (a file, a folder of per-rank files, or a list of
    files) and check ``hardware``'s model on its kernels; ``kernels`` (a traced workload's) fill
    the activity's kernel_key where their signatures match."""
    files = [Path(p) for p in path] if isinstance(path, list) else rank_files(path)
    ranks = [read_rank(f) for f in files]  # every file is read (and refused) before any table is built
    seen: dict[int, Path] = {}
    for r in ranks:
        if r.rank in seen:
            raise KinetoError(f"{r.path}: rank {r.rank} again (also {seen[r.rank]}): one file per rank")
        seen[r.rank] = r.path
    keys = {signature_id(kernel_signature(k)): k.kernel_key for k in kernels or ()}
    rows = []
    for r in ranks:
        for a in r.activities:
            rows.append({**a, "rank": r.rank, "kernel_key": keys.get(a["signature"]) if a["signature"] else None})
    activity = pa.Table.from_pylist(rows, schema=IMPORTED_ACTIVITY) if rows else IMPORTED_ACTIVITY.empty_table()
    streams = pa.Table.from_pylist(_streams(rows), schema=IMPORTED_STREAMS)
    errors = kineto_check.model_error(rows, hardware)
    model_error = pa.Table.from_pylist(errors, schema=IMPORTED_MODEL_ERROR)
    summary = {"hardware": hardware.name, "files": [str(f) for f in files],
               "ranks": [_rank_summary(r) for r in ranks], **_shares(rows),
               "model_error": kineto_check.summarize(errors),
               "kernel_keys": {"traced": len(keys), "matched_activities": sum(1 for x in rows if x["kernel_key"])}}
    if not summary["gpu_kernel_us"]:
        raise KinetoError(f"{path}: no GPU kernel launched inside the profiler window: nothing to import")
    return Import(ranks, activity, streams, model_error, summary)


def write_import(imp: Import, out_dir: Path) -> None:
    """activity, streams, model_error (.parquet) and import.json, each written atomically."""
    out_dir = Path(out_dir)
    write_parquet(imp.activity, out_dir / "activity.parquet", IMPORTED_ACTIVITY)
    write_parquet(imp.streams, out_dir / "streams.parquet", IMPORTED_STREAMS)
    write_parquet(imp.model_error, out_dir / "model_error.parquet", IMPORTED_MODEL_ERROR)
    write_json(imp.summary, out_dir / "import.json")


def describe(imp: Import) -> str:
    """What the command prints: per rank, then the whole job's matched share."""
    lines = []
    for r in imp.summary["ranks"]:
        lines.append(f"rank {r['rank']} ({Path(r['file']).name}): {r['gpu_kernel_ms']:.1f} ms of GPU kernel "
                     f"time over {r['steps']} steps, matched {100 * r['matched_share']:.1f}% "
                     f"({100 * r['named_share']:.1f}% by op name"
                     + ("" if r["shapes_recorded"] else "; recorded without shapes") + ")"
                     + (f", {r['before_window_ms']:.1f} ms launched before the window left out"
                        if r["before_window_ms"] else ""))
    for cls, e in imp.summary["model_error"].items():
        lines.append(f"{imp.summary['hardware']} model on {cls}: mean |error| {100 * e['mean_abs_error']:.1f}%, "
                     f"worst {100 * e['worst_error']:+.1f}% ({e['worst_op']} {e['worst_shapes']}) over "
                     f"{e['shapes']} shapes")
    lines.append(f"matched {100 * imp.matched_share:.1f}% of GPU time")
    return "\n".join(lines)


# --- tables -----------------------------------------------------------------------------------
def _kernel_time(rows: list[dict]) -> tuple[float, float, float, float]:
    """(kernel us launched in the window, of which matched, of which named, launched before it)."""
    total = matched = named = before = 0.0
    for a in rows:
        if a["kind"] != "kernel":
            continue
        if not a["launched"]:
            before += a["dur_us"]
            continue
        total += a["dur_us"]
        matched += a["dur_us"] if a["with_shapes"] else 0.0
        named += a["dur_us"] if (a["op"] or a["collective"]) else 0.0
    return total, matched, named, before


def _shares(rows: list[dict]) -> dict:
    total, matched, named, before = _kernel_time(rows)
    nccl = [a for a in rows if a["kind"] == "kernel" and a["collective"] and a["launched"]]
    nccl_us = sum(a["dur_us"] for a in nccl)
    return {"gpu_kernel_us": total, "matched_share": matched / total if total else 0.0,
            "named_share": named / total if total else 0.0, "before_window_us": before,
            "nccl_kernels": len(nccl), "nccl_us": nccl_us,
            "nccl_with_bytes_share": sum(a["dur_us"] for a in nccl if a["bytes"] is not None) / nccl_us
            if nccl_us else None,
            "collectives": sorted({a["collective"] for a in nccl})}


def _rank_summary(r: RankTrace) -> dict:
    total, matched, named, before = _kernel_time(r.activities)
    by_class: dict[str, float] = defaultdict(float)
    for a in r.activities:
        if a["kind"] == "kernel" and a["launched"]:
            by_class[a["op_class"] or "unmatched"] += a["dur_us"] / 1e3
    return {"rank": r.rank, "file": str(r.path), "world_size": r.world_size, "device": r.device,
            "shapes_recorded": r.shapes_recorded, "steps": len(r.steps),
            "mean_step_ms": sum(s[2] for s in r.steps) / len(r.steps) / 1e3 if r.steps else None,
            "step_spans_us": [[n, start, dur] for n, start, dur in r.steps],
            "gpu_kernel_ms": total / 1e3, "matched_share": matched / total if total else 0.0,
            "named_share": named / total if total else 0.0, "before_window_ms": before / 1e3,
            "kernel_ms_by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1]))}


def _streams(rows: list[dict]) -> list[dict]:
    """Busy (union of intervals) and idle time of each stream within each step's GPU span (first
    start to last end of the GPU work the step launched, on any stream of that rank)."""
    by_step: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for a in rows:
        if a["launched"] and a["step"] >= 0:
            by_step[(a["rank"], a["step"])].append(a)
    out = []
    for (rank, step), acts in sorted(by_step.items()):
        span = max(a["ts_us"] + a["dur_us"] for a in acts) - min(a["ts_us"] for a in acts)
        per_stream: dict[int, list[dict]] = defaultdict(list)
        for a in acts:
            per_stream[a["stream"]].append(a)
        for stream, sa in sorted(per_stream.items()):
            busy = length(merge([(a["ts_us"], a["ts_us"] + a["dur_us"]) for a in sa]))
            nccl = length(merge([(a["ts_us"], a["ts_us"] + a["dur_us"]) for a in sa if a["collective"]]))
            out.append({"rank": rank, "step": step, "stream": stream, "step_us": span, "busy_us": busy,
                        "idle_us": max(0.0, span - busy), "activities": len(sa), "nccl_us": nccl})
    return out
