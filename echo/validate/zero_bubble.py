"""The zero-bubble paper's measured throughputs against Echo's zero-bubble schedules.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), measured 1F1B, ZB-1p and ZB-2p on 8 to
32 A100 SXM 80GB for four GPT models (``zero_bubble_throughput.csv``, Table 4; Table 10: ZB-2p
with the optimizer's all-reduce synchronization instead of post-validation). Each model is one
generated workload, ``zb-gpt-{model}`` (``write_workloads``; committed, a test keeps them in step),
traced once per setup (stages, micro-batch size, and ZB-V's chunk placement, which the trace
records); each row is that workload with the row's schedule and micro-batch count, simulated
from the same trace (both are simulation-only keys). Table 6 (16 to 32 GPUs) adds ZB-V.

What the paper states: the models (its Table 3: layers, heads, hidden size, sequence 1024), GPUs
= pipeline stages (no tensor or data parallelism), micro-batch size and count, the schedule.
What it leaves unstated is taken from the authors' own launch script as it stood when the paper
was added to their repository (sail-sg/zero-bubble-pipeline-parallelism at 6574e0e, January 2024,
examples/pretrain_zero_bubble.sh) and the defaults of their Megatron-LM fork at that commit
(megatron/arguments.py): fp16; no ``--use-flash-attn`` (a store_true flag), so the local
transformer's unfused core attention: QK^T and PV as batched GEMMs around Megatron's fused
scale-mask-softmax kernel, attention dropout 0.1 on the probabilities (Echo's ``attention: math``
with the SC21-era fusions); hidden dropout 0.1; no ``--use-distributed-optimizer`` (ZeRO 0); no
activation recomputation; and, for its zero-bubble runs, --enable-optimizer-post-validation. The
paper's own activation account agrees: its Table 1 charges B with sb(34h + 5as) per layer,
Korthikanti's formula for a layer that stores the attention scores, which flash attention does
not. (The script's later versions, from August 2024, add --use-flash-attn, the distributed
optimizer and untied embeddings; they postdate the measurements.) Not modelled: that script
ties the embedding and output weights (Megatron's default then); Echo's GPT keeps them apart, so
the first and last stage's embedding-gradient all-reduce (one vocabulary x hidden tensor a step)
is missing. Assumed: the vocabulary of the
script's sentencepiece tokenizer, 32,000 (Llama's; it gives the models the paper's sizes), and
the pipeline split with the embedding and the head each counted as a layer, the first and last
stage holding one layer less (Megatron's account-for-embedding split; the paper's layer counts,
22 / 30 / 46 / 62, are two short of a multiple of the stages). ZB-1p is simulated as ZB-H1: the
paper's Table 5 gives the two the same bubble rate in every setting; ZB-2p as Echo's ``zb-2p``.

The figure the paper is about, and the one scored here: each schedule's speed-up over 1F1B at the
same model and micro-batch count, predicted against measured (percentage points); the absolute
throughputs are reported beside it. Nothing is fitted on these rows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import yaml

from echo.config.loader import parse_workload
from echo.config.workload import split_with_embedding_and_loss
from echo.io import atomic_path, write_parquet
from echo.reference import reference_file
from echo.validate.rows import _read, write_workloads_main

THROUGHPUT = "zero_bubble_throughput.csv"
MODELS = "zero_bubble_model_configs.csv"
HARDWARE, TOPOLOGY = "a100-sxm-80gb", "dgx-a100-hdr"
VOCAB = 32000  # assumed (module docstring)
# the paper's schedule -> (Echo's schedule, post-validation)
SCHEDULE_OF = {"1F1B": ("1f1b", False), "ZB-1p": ("zb-h1", True), "ZB-2p": ("zb-2p", True),
               "ZB-2p (post-validation)": ("zb-2p", True), "ZB-2p (all-reduce synchronization)": ("zb-2p", False),
               "ZB-V": ("zb-v", True)}
TABLES = ("Table 4", "Table 6", "Table 10")
CITATION = "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024"


@dataclass(frozen=True)
class ZbRow:
    """One measured throughput of the paper."""

    table: str
    model: str               # as printed, e.g. "1.5B"
    gpus: int
    micro_batch: int
    micro_batches: int
    paper_schedule: str
    samples_per_gpu_s: float
    measured_memory_gb: float | None

    @property
    def setup(self) -> tuple[str, int, int, bool]:
        """(model, pipeline stages, micro-batch size, V placement): what one trace serves."""
        return self.model, self.gpus, self.micro_batch, self.schedule == "zb-v"

    @property
    def workload(self) -> str:
        return setup_name(*self.setup)

    @property
    def schedule(self) -> str:
        return SCHEDULE_OF[self.paper_schedule][0]

    @property
    def post_validation(self) -> bool:
        return SCHEDULE_OF[self.paper_schedule][1]

    @property
    def measured_step_s(self) -> float:
        """One iteration: its samples over the job's samples per second."""
        return self.micro_batch * self.micro_batches / (self.samples_per_gpu_s * self.gpus)


def setup_name(model: str, stages: int, micro_batch: int, v: bool, configs: Mapping | None = None) -> str:
    """``zb-gpt-{model}`` for the paper's Table 3 setup, else with ``-p{stages}-b{micro_batch}``;
    ``-v`` for ZB-V's chunk placement."""
    base = f"zb-gpt-{model.lower()}"
    table3 = {"1.5B": (8, 6), "6.2B": (8, 3), "14.6B": (16, 1), "28.3B": (32, 1)}
    if table3.get(model) != (stages, micro_batch):
        base += f"-p{stages}-b{micro_batch}"
    return base + ("-v" if v else "")


def model_configs(reference_dir: Path | None = None) -> dict[str, dict]:
    return {r["model"]: r for r in _read(reference_file(MODELS, reference_dir))}


def zb_rows(reference_dir: Path | None = None) -> list[ZbRow]:
    """The rows of Tables 4, 6 and 10 (Table 10 prints no micro-batch size: its setups are Table
    4's; Table 6's ZB-2p* is left out: the paper does not define the asterisk there)."""
    configs = model_configs(reference_dir)
    out = []
    for r in _read(reference_file(THROUGHPUT, reference_dir)):
        if r["paper_table"] not in TABLES or r["schedule"] not in SCHEDULE_OF:
            continue
        b = int(r["microbatch_size_b"] or configs[r["model"]]["microbatch_size"])
        mem = r.get("memory_GB") or ""
        out.append(ZbRow(r["paper_table"], r["model"], int(r["num_gpus"]), b, int(r["num_microbatches_m"]),
                         r["schedule"], float(r["samples_per_gpu_per_s"]), float(mem) if mem else None))
    return out


def base_workload(cfg: Mapping[str, str], stages: int, micro_batch: int, v: bool, micro_batches: int) -> dict:
    """The workload file of one setup (1F1B, or ZB-V for the V placement, at ``micro_batches``)."""
    layers, b = int(cfg["layers"]), micro_batch
    par = {"tp": 1, "pp": stages, "dp": 1, "zero": 0, "schedule": "zb-v" if v else "1f1b"}
    if v:
        par |= {"virtual_stages": 2, "post_validation": True}
    par["stage_layers"] = split_with_embedding_and_loss(layers, stages * (2 if v else 1))
    return {
        "description": f"{cfg['model']} GPT of {CITATION} (Table 3), on {stages} A100 as {stages} pipeline stages"
                       f"{' in a V (ZB-V)' if v else ''}, micro-batch {b}; generated by echo.validate.zero_bubble",
        "model": {"arch": "gpt", "layers": layers, "hidden": int(cfg["hidden_size"]),
                  "heads": int(cfg["attention_heads"]), "vocab": VOCAB, "seq_len": int(cfg["sequence_length"]),
                  "attention": "math", "dropout": 0.1},
        "parallel": par,
        "training": {"global_batch": b * micro_batches, "micro_batch": b, "dtype": "fp16", "recompute": "none"},
    }


def setups(reference_dir: Path | None = None) -> dict[str, tuple]:
    """Workload name -> (model, stages, micro-batch size, V placement, the first micro-batch count)."""
    out: dict[str, tuple] = {}
    for r in zb_rows(reference_dir):
        if r.workload not in out:
            out[r.workload] = (*r.setup, r.micro_batches)
    return out


def workload_yaml(cfg: Mapping[str, str], stages: int, micro_batch: int, v: bool, micro_batches: int) -> str:
    header = [f"# Generated by `python -m echo.validate.zero_bubble` from {MODELS} (echo.reference); do not edit.",
              "# Stated by the source: the model (Table 3), GPUs = pipeline stages, micro-batch size; each measured",
              "#   row sets the schedule and the micro-batch count (simulation only: one trace serves them all).",
              "# Chosen where it is silent: echo.validate.zero_bubble's docstring (the authors' launch script at the",
              "#   paper's commit: fp16, Megatron's unfused attention with its fused softmax (no --use-flash-attn),",
              "#   no distributed optimizer, dropout 0.1, no recompute; vocabulary 32000 and the embedding / head",
              "#   counted as a layer in the pipeline split assumed)."]
    body = base_workload(cfg, stages, micro_batch, v, micro_batches)
    return "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=200)


def write_workloads(config_dir: Path, reference_dir: Path | None = None) -> list[Path]:
    paths = []
    configs = model_configs(reference_dir)
    for name, (model, stages, b, v, m) in setups(reference_dir).items():
        path = Path(config_dir) / "workloads" / f"{name}.yaml"
        text = workload_yaml(configs[model], stages, b, v, m)
        parse_workload(yaml.safe_load(text), path)
        with atomic_path(path) as tmp:
            tmp.write_text(text)
        paths.append(path)
    return paths


def workload_names(config_dir: Path) -> list[str]:
    """The generated workloads present in ``config_dir/workloads`` (one per model of Table 3)."""
    return sorted(p.stem for p in (Path(config_dir) / "workloads").glob("zb-gpt-*.yaml"))


def variant(w, row: ZbRow):
    """The model's workload with the row's schedule, post-validation and micro-batch count."""
    par = w.parallel.model_copy(update={"schedule": row.schedule, "post_validation": row.post_validation})
    train = w.training.model_copy(update={"global_batch": row.micro_batch * row.micro_batches})
    return w.model_copy(update={"parallel": par, "training": train})


ZERO_BUBBLE = pa.schema([
    ("table", pa.string()),                   # Table 4 | Table 10
    ("model", pa.string()),
    ("gpus", pa.int32()),
    ("micro_batches", pa.int32()),
    ("paper_schedule", pa.string()),          # as printed
    ("schedule", pa.string()),                # Echo's
    ("post_validation", pa.bool_()),
    ("predicted_step_time_s", pa.float64()),
    ("measured_step_time_s", pa.float64()),   # samples of an iteration / (samples per GPU per s x GPUs)
    ("error", pa.float64()),                  # predicted / measured - 1
    ("predicted_speedup", pa.float64()),      # over 1F1B of the same model and micro-batch count (1F1B: 1)
    ("measured_speedup", pa.float64()),
    ("speedup_error_pp", pa.float64()),       # (predicted - measured) x 100, percentage points
    ("bubble_s", pa.float64()),
    ("peak_mem_gib", pa.float64()),
    ("measured_memory_gb", pa.float64()),     # as printed (GB; per GPU, the paper's peak)
])


def zero_bubble_table(rows: list[ZbRow], steps: Mapping[ZbRow, Mapping]) -> pa.Table:
    """One line per simulated row (``steps``: row -> its summary), speed-ups against the 1F1B row of
    the same setup and micro-batch count (Table 10 against Table 4's)."""
    def key(r: ZbRow) -> tuple:
        return r.model, r.gpus, r.micro_batch, r.micro_batches

    base = {key(r): r for r in rows if r.paper_schedule == "1F1B" and r in steps}
    out = []
    for r in rows:
        s = steps.get(r)
        if s is None:
            continue
        b = base.get(key(r))
        pred_sp = meas_sp = None
        if b is not None:
            pred_sp = steps[b]["step_time_s"] / s["step_time_s"]
            meas_sp = r.samples_per_gpu_s / b.samples_per_gpu_s
        out.append({"table": r.table, "model": r.model, "gpus": r.gpus, "micro_batches": r.micro_batches,
                    "paper_schedule": r.paper_schedule, "schedule": r.schedule, "post_validation": r.post_validation,
                    "predicted_step_time_s": s["step_time_s"], "measured_step_time_s": r.measured_step_s,
                    "error": s["step_time_s"] / r.measured_step_s - 1, "predicted_speedup": pred_sp,
                    "measured_speedup": meas_sp,
                    "speedup_error_pp": None if pred_sp is None else (pred_sp - meas_sp) * 100,
                    "bubble_s": s["bubble_s"], "peak_mem_gib": s["peak_mem_gib"],
                    "measured_memory_gb": r.measured_memory_gb})
    return pa.Table.from_pylist(out, schema=ZERO_BUBBLE)


def run_zero_bubble(rows: list[ZbRow], inputs: Mapping[str, Mapping], hardware, topology, out_path: Path,
                    markdown_path: Path | None = None) -> pa.Table:
    """Simulate every row from its model's artifacts (``inputs``: workload name -> workload,
    trace_dir, rank_classes, kernels, calib_dir) and write zero_bubble.parquet (and its markdown)."""
    from echo.network import NetworkModel
    from echo.simulate import run_simulate
    from echo.simulate.costing import CommTimer

    steps: dict[ZbRow, dict] = {}
    timers: dict[str, CommTimer] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(rows):
            a = inputs.get(r.workload)
            if a is None:
                continue
            calib = Path(a["calib_dir"])
            if str(calib) not in timers:
                timers[str(calib)] = CommTimer(NetworkModel.load(calib / "network.json"))
            timer = timers[str(calib)]
            summary = run_simulate(variant(a["workload"], r), hardware, topology, a["trace_dir"], a["rank_classes"],
                                   a["kernels"], calib, Path(tmp) / str(i), network=timer.network, timer=timer,
                                   summary_only=True)
            steps[r] = summary.to_pylist()[0]
    table = zero_bubble_table(rows, steps)
    write_parquet(table, out_path, ZERO_BUBBLE)
    if markdown_path is not None:
        with atomic_path(markdown_path) as tmp_md:
            tmp_md.write_text(markdown(table))
    return table


def markdown(table: pa.Table) -> str:
    """The speed-up table for the README, and its summary lines."""
    lines = ["| table | model | GPUs | m | schedule (paper / Echo) | predicted (s) | measured (s) | error | "
             "speed-up over 1F1B, predicted / measured | difference | peak GiB (Echo) / GB (paper) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = table.to_pylist()
    for r in rows:
        sched = r["paper_schedule"] + " / " + r["schedule"] + (" +pv" if r["post_validation"] else "")
        sp = "" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.3f} / {r['measured_speedup']:.3f}"
        diff = "" if r["speedup_error_pp"] is None or r["paper_schedule"] == "1F1B" else f"{r['speedup_error_pp']:+.1f} pp"
        mem = f"{r['peak_mem_gib']:.0f} / {r['measured_memory_gb']:.0f}" if r["measured_memory_gb"] else \
            f"{r['peak_mem_gib']:.0f} / "
        lines.append(f"| {r['table']} | {r['model']} | {r['gpus']} | {r['micro_batches']} | {sched} | "
                     f"{r['predicted_step_time_s']:.3f} | {r['measured_step_time_s']:.3f} | {r['error']:+.1%} | "
                     f"{sp} | {diff} | {mem} |")
    scored = [r for r in rows if r["paper_schedule"] != "1F1B" and r["speedup_error_pp"] is not None]
    if scored:
        worst = max(scored, key=lambda r: abs(r["speedup_error_pp"]))
        lines += ["", f"- speed-up over 1F1B: mean |difference| "
                  f"{sum(abs(r['speedup_error_pp']) for r in scored) / len(scored):.1f} pp over {len(scored)} rows, "
                  f"worst {worst['model']} m={worst['micro_batches']} {worst['paper_schedule']} "
                  f"({worst['speedup_error_pp']:+.1f} pp); within 5 pp: "
                  f"{sum(abs(r['speedup_error_pp']) <= 5 for r in scored)} of {len(scored)}",
                  f"- step time: mean |error| {sum(abs(r['error']) for r in rows) / len(rows):.1%} over {len(rows)} rows"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """``python -m echo.validate.zero_bubble [CONFIG_DIR] [REFERENCE_DIR]``: (re)write the workload files."""
    write_workloads_main(write_workloads, argv)


if __name__ == "__main__":
    main()
