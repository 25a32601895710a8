"""Predicted peak memory per GPU against what really ran.

Two checks, both from traces of the representative ranks (the first, second and last pipeline
stage; the middle stages share the second one's graph) and the memory terms of
``echo.simulate.summary`` (state, activations in flight under the stage's schedule, working
memory, framework buffers); no profile or simulation is needed:

- torchtitan (``torchtitan_llama3_h100.csv``, its measured peak per GPU): each row is mapped in
  ``TORCHTITAN`` to the workload that expresses it (``config/workloads/titan-h100-*.yaml``) or to
  the reason it cannot be expressed. torchtitan logs ``torch.cuda.max_memory_reserved``: PyTorch's
  caching allocator, so the comparison is with the allocator terms (state + activations +
  working memory) plus the cuBLAS workspace, which the allocator also holds; NCCL's buffers are
  allocated by NCCL and are not in that figure.
- Megatron-Bridge (``megatron_bridge_perf_all.csv``): every layout ``echo.validate.bridge`` makes
  of a row of a system (DGX-H100 by default) must fit in its GPU's memory (device terms, NCCL
  included), since the row ran. FP8 rows run with FP8 parameter gathers, as the presets of
  Megatron-Bridge set them (``bf16_with_fp8_current_scaling_mixed`` and ``bf16_with_mxfp8_mixed``
  in ``megatron/bridge/training/mixed_precision.py``: ``fp8_param_gather = True``).

Traces are cached under ``results/validate/memory/traces`` by the workload's traced content and
the trace stage's code version. ``python -m echo.validate.memory torchtitan`` and
``python -m echo.validate.memory bridge [--system DGX-H100]`` print the tables (and write them as
Parquet under ``results/validate/memory/``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from echo.config.loader import load_workload, parse_workload
from echo.config.workload import Workload
from echo.io import read_parquet, write_parquet
from echo.reference import reference_file
from echo.simulate.stage import communicators
from echo.simulate.summary import CUBLAS_WORKSPACE_BYTES, GIB, MemoryBreakdown, rank_breakdown
from echo.training.layout import Layout
from echo.training.schedule import orders_of

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "results" / "validate" / "memory"
TORCHTITAN_FILE = "torchtitan_llama3_h100.csv"
SYSTEMS = ("DGX-H100", "DGX-B200", "DGX-B300", "DGX-GB200", "DGX-GB300")  # echo.validate.bridge.SYSTEMS

# torchtitan's rows: (table, techniques, FSDP, CP) -> the workload expressing it, or None and why not
_COMPILE = ("; torch.compile: Echo traces eager blocks (closest: with full AC the compiled block only "
            "changes the recomputed block's working memory); Float8: traced as bf16 (the FP8 tracer keeps "
            "quantized activations to the end of a chunk's pass and gathers FSDP shards in bf16)")
_OP_SAC = ("activation checkpointing 'selective' is torchtitan's op-level SAC (selective_ac_option = 'op': keep the "
           "outputs of every second matmul and of SDPA, recompute the rest); Echo's recompute is none | selective "
           "(the attention core, Korthikanti et al.) | full")
TORCHTITAN: dict[tuple[str, str, int, int], tuple[str | None, str]] = {
    ("T1", "FSDP", 8, 1): (None, _OP_SAC),
    ("T1", "FSDP+torch.compile", 8, 1): (None, _OP_SAC),
    ("T1", "FSDP+torch.compile+Float8", 8, 1): (None, _OP_SAC),
    ("T2", "FSDP+CP+torch.compile+Float8", 8, 1): ("titan-h100-llama3.1-8b-fsdp8-seq32k", "closest" + _COMPILE),
    ("T2", "FSDP+CP+torch.compile+Float8", 4, 2): ("titan-h100-llama3.1-8b-fsdp4-cp2-seq64k", "closest" + _COMPILE),
    ("T2", "FSDP+CP+torch.compile+Float8", 2, 4): ("titan-h100-llama3.1-8b-fsdp2-cp4-seq128k", "closest" + _COMPILE),
    ("T2", "FSDP+CP+torch.compile+Float8", 1, 8): ("titan-h100-llama3.1-8b-fsdp1-cp8-seq256k", "closest" + _COMPILE),
    ("T3", "FSDP", 128, 1): (None, _OP_SAC),
    ("T3", "FSDP+torch.compile", 128, 1): (None, _OP_SAC),
    ("T3", "FSDP+torch.compile+Float8", 128, 1): (None, _OP_SAC),
    ("T4", "2D+torch.compile+Float8", 32, 1): ("titan-h100-llama3.1-70b-fsdp32-tp8", "closest" + _COMPILE),
    ("T4", "2D+AsyncTP+torch.compile+Float8", 32, 1): (
        "titan-h100-llama3.1-70b-fsdp32-tp8-asynctp",
        "closest" + _COMPILE + "; AsyncTP's symmetric-memory buffers are not modelled"),
    ("T5", "3D+torch.compile+Float8+AsyncTP (1F1B)", 8, 1): (
        "titan-h100-llama3.1-405b-fsdp8-tp8-pp8-1f1b", "closest" + _COMPILE + "; AsyncTP as tp_comm_overlap"),
    ("T5", "3D+torch.compile+Float8+AsyncTP (Interleaved 1F1B)", 8, 1): (
        "titan-h100-llama3.1-405b-fsdp8-tp8-pp8-interleaved", "closest" + _COMPILE + "; AsyncTP as tp_comm_overlap"),
    ("T6", "4D+torch.compile+Float8+AsyncTP+1F1B", 8, 1): (
        "titan-h100-llama3.1-405b-fsdp8-tp8-pp8-seq32k", "closest" + _COMPILE + "; AsyncTP as tp_comm_overlap"),
    ("T6", "4D+torch.compile+Float8+AsyncTP+1F1B", 4, 2): (
        "titan-h100-llama3.1-405b-fsdp4-cp2-tp8-pp8-seq64k", "closest" + _COMPILE + "; AsyncTP as tp_comm_overlap"),
    ("T6", "4D+torch.compile+Float8+AsyncTP+1F1B", 2, 4): (
        "titan-h100-llama3.1-405b-fsdp2-cp4-tp8-pp8-seq128k", "closest" + _COMPILE + "; AsyncTP as tp_comm_overlap"),
    ("T6", "4D+torch.compile+Float8+AsyncTP+1F1B", 1, 8): (
        "titan-h100-llama3.1-405b-fsdp1-cp8-tp8-pp8-seq256k", "closest" + _COMPILE + "; AsyncTP as tp_comm_overlap"),
}


@dataclass(frozen=True)
class Prediction:
    """Per pipeline stage, one rank's peak memory in named terms."""

    workload: str
    stages: list[MemoryBreakdown]

    @property
    def worst(self) -> MemoryBreakdown:
        return max(self.stages, key=lambda b: b.device)

    @property
    def reserved_gib(self) -> float:
        """What torch.cuda.max_memory_reserved would show: the allocator's reserved peak and the
        cuBLAS workspace it holds, on the stage with the highest one."""
        return (max(b.allocator for b in self.stages) + CUBLAS_WORKSPACE_BYTES) / GIB

    @property
    def device_gib(self) -> float:
        return self.worst.device / GIB


def traced_stages(pp: int) -> list[int]:
    """The stages whose representative is traced: first, second (standing for the middle) and last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def _trace_key(w: Workload) -> str:
    """The cache key of a workload's trace: what the tracer reads and the tracer's own source (the
    packages it runs; the workflow's code_version sits a layer above and is not imported here)."""
    dump = {k: v for k, v in w.trace_dump().items() if k not in ("name", "description")}
    package = Path(__file__).resolve().parents[1]
    sources = b"".join(f.read_bytes() for d in ("config", "training", "trace") for f in sorted((package / d).glob("*.py")))
    body = json.dumps(dump, sort_keys=True, default=str).encode() + hashlib.sha256(sources).digest()
    return hashlib.sha256(body).hexdigest()[:16]


def trace_tables(w: Workload, cache: Path | None = CACHE / "traces", jobs: int | None = None) -> dict[str, list[dict]]:
    """ranks and comms rows of the traced representatives of ``traced_stages`` (cached)."""
    from echo.trace import check_traceable, trace_ranks

    check_traceable(w)
    path = cache / _trace_key(w) if cache is not None else None  # workloads that trace alike share it
    if path is not None and (path / "ranks.parquet").is_file():
        return {n: read_parquet(path / f"{n}.parquet").to_pylist() for n in ("ranks", "comms")}
    reps = Layout(w.parallel).representatives()
    ranks = [reps[f"pp{s}"] for s in traced_stages(w.parallel.pp)]
    import tempfile

    with tempfile.TemporaryDirectory(prefix="echo-memory-") as tmp:
        tables = trace_ranks(w, ranks, Path(tmp), jobs)
    comms = tables["comms"].select(["rank", "group", "peer"])
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        write_parquet(tables["ranks"], path / "ranks.parquet")
        write_parquet(comms, path / "comms.parquet")
    return {"ranks": tables["ranks"].to_pylist(), "comms": comms.to_pylist()}


def predict(w: Workload, cache: Path | None = CACHE / "traces", jobs: int | None = None) -> Prediction:
    """Peak memory of every pipeline stage of ``w`` (see the module docstring)."""
    tables = trace_tables(w, cache, jobs)
    p = w.parallel
    by_stage = {r["pp_rank"]: r for r in tables["ranks"]}
    orders = orders_of(p, w.micro_batches)
    out = []
    for s in range(p.pp):
        r = by_stage[s] if s in by_stage else by_stage[min(1, p.pp - 1)]
        comms = [c for c in tables["comms"] if c["rank"] == r["rank"]]
        out.append(rank_breakdown(
            state=r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"],
            activation=r["activation_bytes_per_microbatch"], peak=r.get("peak_bytes_per_microbatch") or 0,
            reserved=r.get("reserved_bytes_per_microbatch") or 0,
            chunk_activation=r.get("activation_bytes_per_chunk") or (), communicators=communicators(comms),
            chunks=p.virtual_stages, order=orders[s]))
    return Prediction(w.name, out)


def _gib(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# --- torchtitan ---------------------------------------------------------------------------------
def torchtitan_rows(reference_dir: Path | None = None) -> list[dict]:
    path = reference_file(TORCHTITAN_FILE, reference_dir)
    with path.open() as f:
        return list(csv.DictReader(x for x in f if not x.startswith("#")))


def torchtitan_table(reference_dir: Path | None = None, cache: Path | None = CACHE / "traces",
                     predictions: dict[str, Prediction] | None = None) -> pa.Table:
    """One row per torchtitan row: measured GiB, the workload, predicted GiB and the error (or why
    the row is not expressed). ``predictions``: workload name -> Prediction, to skip tracing."""
    predictions = dict(predictions or {})
    out = []
    for r in torchtitan_rows(reference_dir):
        key = (r["table"], r["techniques"], int(r["FSDP"]), int(r["CP"]))
        name, note = TORCHTITAN.get(key, (None, "no mapping"))
        measured = float(r["memory_GiB"])
        pred = None
        if name is not None:
            if name not in predictions:
                predictions[name] = predict(load_workload(name), cache)
            pred = predictions[name]
        got = pred.reserved_gib if pred else None
        out.append({"table": r["table"], "model": r["model"], "techniques": r["techniques"], "fsdp": key[2],
                    "tp": int(r["TP"]), "pp": int(r["PP"]), "cp": key[3], "measured_gib": measured,
                    "workload": name, "predicted_gib": _gib(got),
                    "error": None if got is None else round((got - measured) / measured, 4),
                    "state_gib": _gib(pred.worst.state / GIB) if pred else None,
                    "activations_gib": _gib(pred.worst.activations / GIB) if pred else None,
                    "working_gib": _gib(pred.worst.working / GIB) if pred else None,
                    "fragmentation_gib": _gib(pred.worst.fragmentation / GIB) if pred else None, "note": note})
    return pa.Table.from_pylist(out)


# --- Megatron-Bridge ----------------------------------------------------------------------------
def bridge_workloads(system: str = "DGX-H100", reference_dir: Path | None = None) -> list[tuple[Workload, list]]:
    """The distinct layouts of ``system``'s rows (echo.validate.bridge), with the rows each stands for;
    FP8 rows with FP8 parameter gathers (the presets' setting)."""
    from echo.validate.bridge import SYSTEMS, bridge_rows

    hardware = SYSTEMS[system][0]
    layouts: dict[str, tuple[Workload, list]] = {}
    for row in bridge_rows(reference_dir):
        if row.hardware != hardware:
            continue
        data = json.loads(json.dumps(row.workload))
        if data["training"].get("dtype") == "fp8":
            data["training"]["fp8_param_gather"] = True
        data["name"] = row.name
        if row.name not in layouts:
            layouts[row.name] = (parse_workload(data, ROOT / "config" / "workloads" / f"{row.name}.yaml"), [])
        layouts[row.name][1].append(row)
    return list(layouts.values())


def bridge_table(system: str = "DGX-H100", reference_dir: Path | None = None,
                 cache: Path | None = CACHE / "traces") -> pa.Table:
    """One row per distinct layout of ``system``: predicted device peak against the GPU's memory
    (its hardware file's memory_gib)."""
    from echo.config.loader import load_hardware
    from echo.validate.bridge import SYSTEMS as BRIDGE_SYSTEMS

    limit = float(load_hardware(BRIDGE_SYSTEMS[system][0]).memory_gib)
    out = []
    for w, rows in bridge_workloads(system, reference_dir):
        pred = predict(w, cache)
        b = pred.worst
        out.append({"workload": w.name, "rows": len(rows), "gpu_gib": limit, "device_gib": _gib(pred.device_gib),
                    "allocator_gib": _gib(b.allocator / GIB), "state_gib": _gib(b.state / GIB),
                    "activations_gib": _gib(b.activations / GIB), "working_gib": _gib(b.working / GIB),
                    "fragmentation_gib": _gib(b.fragmentation / GIB), "framework_gib": _gib(b.framework / GIB),
                    "fits": pred.device_gib <= limit,
                    "stage": pred.stages.index(b)})
    return pa.Table.from_pylist(out)


def _print(table: pa.Table) -> None:
    cols = table.column_names
    rows = table.to_pylist()
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols if c != "note"}
    print("  ".join(c.ljust(width[c]) for c in width))
    for r in rows:
        print("  ".join(str(r[c]).ljust(width[c]) for c in width))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echo.validate.memory", description=__doc__.split("\n")[0])
    parser.add_argument("check", choices=("torchtitan", "bridge"))
    parser.add_argument("--system", default="DGX-H100", choices=SYSTEMS)
    parser.add_argument("--no-cache", action="store_true", help="trace again instead of reading cached traces")
    args = parser.parse_args(argv)
    cache = None if args.no_cache else CACHE / "traces"
    if args.check == "torchtitan":
        table = torchtitan_table(cache=cache)
        out = CACHE / "torchtitan.parquet"
    else:
        table = bridge_table(args.system, cache=cache)
        out = CACHE / f"bridge-{args.system.lower()}.parquet"
    write_parquet(table, out)
    _print(table)
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
