"""Published cluster measurements as Echo workloads, and the predictions next to them.

Three tables of the reference folder (``echo.reference``; its README gives the sources):

- ``megatron_sc21_table1_a100.csv``: Narayanan et al., SC21, Table 1. GPT 1.7B-1T on DGX A100
  80GB with HDR InfiniBand (``a100-sxm-80gb`` / ``dgx-a100-hdr``).
- ``megatron_core_h100.csv``: the Megatron-LM README's Megatron-Core r0.8.0 table. GPT 1.7B-462B
  on H100 (``h100-sxm-80gb`` / ``dgx-h100-ndr``).
- ``megatron_bridge_perf_all.csv``: the Megatron-Bridge performance summary: its pre-training rows
  of models with a shipped config.json on DGX H100 / B200 / B300 / GB200 / GB300, in BF16, FP8,
  MXFP8 and NVFP4 (echo.validate.bridge), each with the split declared in config/splits/.

Each row becomes ``config/workloads/{name}.yaml`` (``write_workloads``; the files are committed and
a test checks they match this module). What a row states is copied; what it leaves unstated
takes the default below, and the file says which is which (``ROW_DEFAULTS``).

The measured step time of a row is derived from its ``tflops_per_gpu``, with the FLOP count of the
source's own formula: SC21's eq. 3, ``96 B s l h^2 (1 + s/6h + V/16lh)`` (recomputation
included); Megatron-LM's ``num_floating_point_operations`` for Megatron-Core,
``72 B s l h^2 (1 + s/6h + V/12lh)`` for GPT (no recomputation) - step = FLOPs / (gpus x tflops).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import yaml

from echo.config.loader import parse_workload
from echo.io import atomic_path, write_parquet
from echo.reference import reference_file
from echo.validate.bridge import bridge_rows
from echo.validate.rows import (  # noqa: F401  (re-exported)
    BRIDGE,
    MCORE,
    SC21,
    SOURCES,
    Row,
    Source,
    _read,
    write_workloads_main,
)

# Each table's declared fit rows (the rest are validation rows; errors are headlined on those):
# Megatron-Core's even rows were declared the step-time fit rows (of sustained_compute, removed) before their
# errors were looked at; SC21 fits nothing; Megatron-Bridge's split is its sidecar file
# (config/splits/megatron_bridge_perf_all.csv, echo.validate.bridge).
DECLARED_FIT_ROWS = {"sc21": (), "mcore-h100": ("7.1B", "32B", "119B", "314B")}

# What each source states about its runs beyond the table's columns, and the defaults chosen for
# what it does not state (written into every generated file).
ROW_DEFAULTS = {
    "sc21": {
        "stated": "GPT, seq 2048, vocab 51200, interleaved 1F1B schedule (pp > 1), activation "
                  "recomputation, mixed precision; tp, pp, dp, global batch from the row",
        "chosen": "micro_batch 1 (not stated); virtual stages (not stated): the fewest chunks above "
                  "one that split a pipeline rank's layers evenly (2 when even); recompute: full "
                  "(the paper's FLOP formula counts one extra forward); dtype fp16 (SC21's mixed "
                  "precision); zero 0 (no distributed optimizer in SC21); no sequence parallelism (later work); "
                  "attention: math (Megatron-LM of 2021 ran QK^T, softmax, dropout and PV as separate kernels; "
                  "fused flash attention came later), with the fusions section 4.2 states (one scale-mask-softmax "
                  "kernel, bias-dropout-add in one kernel; bias-GeLU rides in the GEMM here); dropout 0.1 (Megatron-LM's default for attention and "
                  "hidden states); no overlap flags (Megatron-LM of 2021 reduced gradients after the pipeline "
                  "flush and had neither the distributed optimizer's parameter all-gather nor TP-comm overlap)",
    },
    "mcore-h100": {
        "stated": "GPT, seq 4096, vocab 131072, grad-reduce / param-gather / TP-comm / PP overlap; "
                  "tp, pp, dp, global batch from the row",
        "chosen": "micro_batch 1 (not stated); dtype bf16 (989 TFLOP/s peak implied); recompute none "
                  "(tflops_per_gpu / peak = mfu, so no recompute FLOPs); zero 1 (param-gather overlap "
                  "needs the distributed optimizer); sequence_parallel when tp > 1 (Megatron's TP-comm "
                  "overlap needs it); interleaved schedule when pp > 1 (Megatron overlaps PP "
                  "communication in its interleaved schedule) with the SC21 rule for virtual stages; attention: "
                  "flash (Megatron-Core's fused attention); dropout 0: its attention dropout runs inside the "
                  "fused kernel, which the trace cannot express (scaled_dot_product_attention with dropout "
                  "decomposes into s x s kernels on the tracing CPU), and hidden dropout costs a few percent; "
                  "the stated overlaps as overlap_grad_reduce, overlap_param_gather and (where tp > 1, as "
                  "there is no TP communication otherwise) tp_comm_overlap",
    },
    "mbridge": {
        "stated": "the model (its published config.json), the precision, GBS, MBS, sequence length, TP, PP, CP, VP, "
                  "EP, the system and the GPU count (DP = GPUs / (TP x PP x CP)); the measured step time is the "
                  "table's step_time_s_derived, GBS x seq / (tokens/s/GPU x GPUs)",
        "chosen": "where Megatron-Bridge's performance presets are not transcribed (config/validation/"
                  "megatron_bridge_settings.csv): the distributed optimizer (zero 1) with overlap_grad_reduce and "
                  "overlap_param_gather, sequence parallelism and tp_comm_overlap when tp > 1, no activation "
                  "recompute, no expert-parallel communication overlap (not modelled), dropout 0; pipeline stages "
                  "split as Megatron's account_for_embedding / account_for_loss_in_pipeline_split do when the layers "
                  "do not divide evenly (the embedding and the loss each count as a layer, so the first and last "
                  "virtual stage hold one layer less); 1F1B when VP is n/a or 1, interleaved otherwise. FP8 is "
                  "Transformer Engine's: current scaling for FP8 / FP8-CS (the presets define FP8_CS, FP8_MX and "
                  "NVFP4 and no delayed scaling), MXFP8 for MXFP8 / FP8-MX, NVFP4; FP8 parameter gathers off. "
                  "Multi-token prediction (DeepSeek-V3) is not modelled",
    },
}


def virtual_stages(layers: int, pp: int) -> int:
    """Chunks per pipeline rank when the source does not say: the fewest chunks above one that
    split a stage's layers evenly (2 when its layer count is even; one layer per chunk when it
    is prime), and 1 without pipelining."""
    if pp == 1:
        return 1
    per_stage = layers // pp
    return next(d for d in range(2, per_stage + 1) if per_stage % d == 0) if per_stage > 1 else 1


def sc21_flops(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """SC21 eq. 3: FLOPs of one iteration with activation recomputation."""
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def megatron_flops(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Megatron-LM's num_floating_point_operations for a GPT (MHA, 4h MLP), no recomputation."""
    return 12 * b * s * layers * h * h * (6 + s / h + vocab / (2 * layers * h))


def _parallel(tp: int, pp: int, dp: int, layers: int, layout: dict, overlaps: dict) -> dict:
    """The parallel section: the row's degrees, ``layout`` keys, the schedule, then the overlap
    flags that are on (they change the simulation only)."""
    par = {"tp": tp, "pp": pp, "dp": dp, **layout}
    v = virtual_stages(layers, pp)
    par["schedule"] = "interleaved" if pp > 1 else "1f1b"
    if v > 1:
        par["virtual_stages"] = v
    par.update({k: True for k, on in overlaps.items() if on})
    return par


# Per source: how a row's label is printed, its FLOP formula (for the measured step time), and
# what its workload file holds beyond the row's columns (ROW_DEFAULTS says the same in words).
# layout / overlaps: functions of (tp, dp).
_ROW_SPEC = {
    "sc21": dict(label=lambda r: f"{float(r['params_B']):g}B", flops=sc21_flops,
                 model={"attention": "math", "dropout": 0.1},
                 layout=lambda tp, dp: {"zero": 0}, overlaps=lambda tp, dp: {},
                 training={"dtype": "fp16", "recompute": "full"}),
    "mcore-h100": dict(label=lambda r: r["model"], flops=megatron_flops,
                       model={"attention": "flash", "dropout": 0.0},
                       layout=lambda tp, dp: {"zero": 1, "sequence_parallel": tp > 1},
                       overlaps=lambda tp, dp: {"overlap_grad_reduce": dp > 1, "overlap_param_gather": dp > 1,
                                                "tp_comm_overlap": tp > 1},
                       training={"dtype": "bf16", "recompute": "none"}),
}


def source_rows(src: Source, reference_dir: Path | None = None) -> list[Row]:
    """The rows of one published table as workloads (``_ROW_SPEC`` and ``ROW_DEFAULTS``);
    ``reference_dir``: the reference folder, as for ``echo.reference.reference_root``."""
    if src is BRIDGE:
        return bridge_rows(reference_dir)
    spec = _ROW_SPEC[src.key]
    out = []
    for r in _read(reference_file(src.file, reference_dir)):
        h, layers, heads = int(r["hidden"]), int(r["layers"]), int(r["heads"])
        tp, pp, dp, batch = int(r["tp"]), int(r["pp"]), int(r["dp"]), int(r["global_batch"])
        s, vocab, gpus, tflops = int(r["seq_len"]), int(r["vocab"]), int(r["gpus"]), float(r["tflops_per_gpu"])
        label = spec["label"](r)
        w = {"description": _description(src, label),
             "model": {"arch": "gpt", "layers": layers, "hidden": h, "heads": heads, "vocab": vocab, "seq_len": s,
                       **spec["model"]},
             "parallel": _parallel(tp, pp, dp, layers, spec["layout"](tp, dp), spec["overlaps"](tp, dp)),
             "training": {"global_batch": batch, "micro_batch": 1, **spec["training"]}}
        step = spec["flops"](batch, s, layers, h, vocab) / (gpus * tflops * 1e12)
        split = "fit" if label in DECLARED_FIT_ROWS[src.key] else "validation"
        out.append(Row(src, label, w, gpus, tflops, step, split=split))
    return out


def published_rows(reference_dir: Path | None = None) -> list[Row]:
    return [row for src in SOURCES for row in source_rows(src, reference_dir)]


def _description(src: Source, label: str) -> str:  # SC21 and Megatron-Core rows
    return f"{label} GPT of {src.citation}; generated by echo.validate.published from {src.file} (echo.reference)"


def workload_yaml(row: Row) -> str:
    """The generated workload file: a header saying what the source states and what was chosen."""
    d = ROW_DEFAULTS[row.source.key]
    header = [
        f"# Generated by `python -m echo.validate.published` from {row.source.file} (echo.reference); do not edit.",
        f"# Published: {row.published_note}" if row.published_note else
        f"# Published: {row.tflops_per_gpu:g} TFLOP/s per GPU on {row.gpus} GPUs "
        f"-> {row.measured_step_s:.3f} s per iteration ({row.hardware}, {row.topology}).",
        f"# Stated by the source: {d['stated']}.",
        f"# Chosen where the source is silent: {d['chosen']}.",
    ]
    body = yaml.safe_dump(row.workload, sort_keys=False, default_flow_style=None, width=200)
    return "\n".join(_wrap(header)) + "\n" + body


def _wrap(lines: Iterable[str], width: int = 110) -> list[str]:
    out = []
    for line in lines:
        words, cur = line[2:].split(), "#"
        for w in words:
            if len(cur) + 1 + len(w) > width:
                out.append(cur)
                cur = "#  "
            cur += " " + w
        out.append(cur)
    return out


def write_workloads(config_dir: Path, reference_dir: Path | None = None) -> list[Path]:
    """Write (atomically) one workload file per published row into ``config_dir/workloads``,
    each validated like any workload file first."""
    paths = []
    for row in published_rows(reference_dir):
        path = Path(config_dir) / "workloads" / f"{row.name}.yaml"
        text = workload_yaml(row)
        parse_workload(yaml.safe_load(text), path)  # refuses a contradiction before writing
        with atomic_path(path) as tmp:
            tmp.write_text(text)
        paths.append(path)
    return paths


# --- predictions next to measurements --------------------------------------------------------

PUBLISHED = pa.schema([
    ("table", pa.string()),                    # sc21 | mcore-h100 | mbridge
    ("row", pa.string()),                      # the row's model size as printed (Megatron-Bridge: container)
    ("split", pa.string()),                    # fit | validation (the table's declared split)
    ("workload", pa.string()),
    ("model", pa.string()),                    # the model (several rows of a table may measure it)
    ("precision", pa.string()),                # the workload's dtype, or its FP8 recipe
    ("hardware", pa.string()),
    ("topology", pa.string()),
    ("gpus", pa.int32()),
    ("predicted_step_time_s", pa.float64()),
    ("measured_step_time_s", pa.float64()),    # derived from the published tflops_per_gpu
    ("error", pa.float64()),                   # predicted / measured - 1
    ("predicted_tflops_per_gpu", pa.float64()),
    ("measured_tflops_per_gpu", pa.float64()),
    ("compute_s", pa.float64()),
    ("exposed_comm_s", pa.float64()),
    ("exposed_tp_s", pa.float64()),
    ("exposed_cp_s", pa.float64()),            # context-parallel key / value exchanges
    ("exposed_dp_s", pa.float64()),
    ("exposed_pp_s", pa.float64()),
    ("exposed_ep_s", pa.float64()),            # expert-parallel all-to-alls (MoE)
    ("host_wait_s", pa.float64()),             # the GPU waiting for the host's launches
    ("bubble_s", pa.float64()),
    ("fits", pa.bool_()),
    ("peak_mem_gib", pa.float64()),
])


# The breakdown's exposed communication per kind, in the order the README's table prints it.
EXPOSED_BY_KIND = ("exposed_tp_s", "exposed_cp_s", "exposed_dp_s", "exposed_pp_s", "exposed_ep_s")


def published_table(rows: list[Row], summaries: dict[str, dict]) -> pa.Table:
    """One line per row whose workload was simulated (``summaries``: workload name -> summary row)."""
    out = []
    for row in rows:
        s = summaries.get(row.name)
        if s is None:
            continue
        pred = s["step_time_s"]
        out.append({
            "table": row.source.key, "row": row.label, "split": row.split, "workload": row.name,
            "model": row.model_tag if row.source.key == "mbridge" else row.name,  # SC21 / MCore: one model a row
            "precision": row.workload["training"].get("fp8_recipe") or row.workload["training"]["dtype"],
            "hardware": row.hardware,
            "topology": row.topology, "gpus": row.gpus, "predicted_step_time_s": pred,
            "measured_step_time_s": row.measured_step_s, "error": pred / row.measured_step_s - 1,
            "predicted_tflops_per_gpu": row.tflops_per_gpu * row.measured_step_s / pred,
            "measured_tflops_per_gpu": row.tflops_per_gpu,
            **{k: s.get(k) for k in ("compute_s", "exposed_comm_s", *EXPOSED_BY_KIND, "host_wait_s", "bubble_s", "fits",
                                     "peak_mem_gib")},
        })
    return pa.Table.from_pylist(out, schema=PUBLISHED)


def table_errors(table: pa.Table, split: str | None = "validation") -> dict[str, dict]:
    """Per source table: rows, mean absolute error, and the worst row, over the rows of ``split``
    (validation: the accuracy figures; fit: the rows a parameter was fitted on; None: all)."""
    out: dict[str, dict] = {}
    for r in table.to_pylist():
        if split is not None and r.get("split", "validation") != split:
            continue
        t = out.setdefault(r["table"], {"rows": 0, "abs": [], "worst": None})
        t["rows"] += 1
        t["abs"].append(abs(r["error"]))
        if t["worst"] is None or abs(r["error"]) > abs(t["worst"]["error"]):
            t["worst"] = r
    for t in out.values():
        t["mean_abs_error"] = sum(t.pop("abs")) / t["rows"]
    return out


def plot_published(table: pa.Table, path: Path) -> None:
    """Predicted vs measured step time, one marker per table, log-log, with the +-15% band."""
    from echo.report import plots

    rows = table.to_pylist()
    points = []
    for key in sorted({r["table"] for r in rows}):
        mine = [r for r in rows if r["table"] == key]
        mae = sum(abs(r["error"]) for r in mine) / len(mine)
        points += [{"label": r["row"], "predicted_s": r["predicted_step_time_s"], "measured_s": r["measured_step_time_s"],
                    "source": f"{key} (mean |error| {mae:.0%})"} for r in mine]
    plots.save(plots.predicted_vs_measured(points, band=0.15, title="Echo vs published Megatron-LM measurements",
                                           xlabel="measured step time (s, from published TFLOP/s per GPU)"), path)


def plot_error_by_layout(table: pa.Table, workloads_dir: Path, path: Path) -> list[dict]:
    """Each row's error against the TP, PP, CP and EP degree of its workload file
    (``workloads_dir/<workload>.yaml``, ``parallel``; cp and ep default to 1), one marker per table,
    hollow for fit rows where the table has a ``split`` column. Returns the points plotted."""
    from echo.report import plots

    points = []
    for r in table.to_pylist():
        parallel = yaml.safe_load((Path(workloads_dir) / f"{r['workload']}.yaml").read_text()).get("parallel") or {}
        points.append({"table": r["table"], "label": r["row"], "workload": r["workload"], "error": r["error"],
                       "split": r.get("split"), **{d: int(parallel.get(d) or 1) for d in plots.LAYOUT_DIMS}})
    plots.save(plots.error_by_layout(points, band=0.10, title="Echo vs published measurements: error by layout"), path)
    return points


def run_validate(rows: list[Row], summary_paths: dict[str, Path], out_path: Path, plot_path: Path) -> pa.Table:
    """published.parquet and its plot from the simulated summaries of the rows' workloads."""
    from echo.io import read_parquet

    summaries = {name: read_parquet(p).to_pylist()[0] for name, p in summary_paths.items()}
    table = published_table(rows, summaries)
    write_parquet(table, out_path, PUBLISHED)
    plot_published(table, plot_path)
    from echo.config.loader import CONFIG_ROOT
    plot_error_by_layout(table, CONFIG_ROOT / "workloads", plot_path.with_name(f"{plot_path.stem}_by_layout.png"))
    return table


def main(argv: list[str] | None = None) -> None:
    """``python -m echo.validate.published [CONFIG_DIR] [REFERENCE_DIR]``: (re)write the workload files."""
    write_workloads_main(write_workloads, argv)


if __name__ == "__main__":
    main()
