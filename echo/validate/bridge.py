"""The Megatron-Bridge performance summary (``megatron_bridge_perf_all.csv``) as Echo workloads.

Each pre-training row of a model Echo ships a config.json for (``MODELS``), on a system Echo has
hardware and topology files for (``SYSTEMS``), in a precision Echo traces (``PRECISIONS``), becomes
a workload. Rows that share a layout (the same configuration measured by several releases) share
one workload; each row is still scored on its own. What the table states is copied; what it does
not state comes from the performance presets of Megatron-Bridge where they were transcribed
(``config/validation/megatron_bridge_settings.csv``, optional), else from the defaults that
``published.ROW_DEFAULTS['mbridge']`` states; every generated file says which.

Rows are left out, with the reason in ``skipped()``, when Echo cannot express them: Megatron FSDP
(FSDP > 0, with CPU offloading in those presets), expert tensor parallelism (ETP > 1), a page's
alternate values in parentheses, or a pipeline split that Megatron's layout rule does not give
evenly. The table's declared fit / validation split (``config/splits/megatron_bridge_perf_all.csv``,
chosen before any of these rows was simulated) is carried on every row.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

from echo.config.workload import split_with_embedding_and_loss
from echo.reference import reference_file
from echo.validate.rows import BRIDGE, Row, _read

CONFIG = Path(__file__).resolve().parents[2] / "config"
SPLIT_FILE = CONFIG / "splits" / "megatron_bridge_perf_all.csv"
SETTINGS_FILE = CONFIG / "validation" / "megatron_bridge_settings.csv"

# the table's System -> (hardware, topology, short name). GB200 / GB300 jobs of 128 and 256 GPUs
# fill 64 of each NVL72 rack's 72 GPUs (16 of 18 trays, as SLURM's --segment places them), so
# that power-of-two groups stay inside an NVLink domain (config/topologies/gb200-nvl72-64.yaml)
SYSTEMS = {
    "DGX-H100": ("h100-sxm-80gb", "dgx-h100-ndr", "h100"),
    "DGX-B200": ("b200-sxm", "dgx-b200", "b200"),
    "DGX-B300": ("b300-sxm", "dgx-b300", "b300"),
    "DGX-GB200": ("gb200", "gb200-nvl72-64", "gb200"),
    "DGX-GB300": ("gb300", "gb300-nvl72-64", "gb300"),
}
# the table's Model -> config/models/<tag>.json. Llama 3 and 3.1 share the architecture (3.1
# changes RoPE scaling and the context length only): the 3.1 configs stand for both.
MODELS = {
    "LLAMA3_8B": "llama-3.1-8b", "LLAMA3_70B": "llama-3.1-70b", "LLAMA3.1_405B": "llama-3.1-405b",
    "Qwen3_30B_a3B": "qwen3-30b-a3b", "Qwen3_235B_a22B": "qwen3-235b-a22b", "GPT OSS 120B": "gpt-oss-120b",
    "DeepSeekV3": "deepseek-v3", "DeepSeekV3 (w/o MTP)": "deepseek-v3",
}
# the table's Precision -> (training.dtype, training.fp8_recipe). Megatron-Bridge's performance
# presets define FP8_CS (current scaling), FP8_MX and NVFP4 and no delayed-scaling preset; the
# 26.x tables print "FP8" for the FP8_CS presets (the 25.11 table printed FP8-CS for the same
# layouts at the same throughput).
PRECISIONS = {"BF16": ("bf16", None), "FP8": ("fp8", "current"), "FP8-CS": ("fp8", "current"),
              "MXFP8": ("fp8", "mxfp8"), "FP8-MX": ("fp8", "mxfp8"), "NVFP4": ("fp8", "nvfp4")}


def _int(cell: str, default: int = 1) -> int:
    return int(cell) if cell not in ("", "n/a") else default


def declared_split(path: Path = SPLIT_FILE) -> dict[tuple[str, str], str]:
    """(file, line) -> fit | validation, as declared in the sidecar."""
    with path.open() as f:
        return {(r["file"], r["line"]): r["split"] for r in csv.DictReader(x for x in f if not x.startswith("#"))}


def preset_settings(path: Path = SETTINGS_FILE) -> dict[tuple[str, str, str, str], dict]:
    """(Model, System, Precision, container) -> the transcribed preset settings, where present."""
    if not path.is_file():
        return {}
    with path.open() as f:
        return {(r["Model"], r["System"], r["Precision"], r["container"]): r
                for r in csv.DictReader(x for x in f if not x.startswith("#"))}


def stage_layers(layers: int, chunks: int) -> list[int] | None:
    """Layers per virtual stage: even when they divide, else Megatron's split with the embedding
    and the loss counted as one layer each (None when that does not divide either, or would leave
    the first or last stage without a layer)."""
    if layers % chunks == 0:
        return [layers // chunks] * chunks
    if (layers + 2) // chunks < 2:
        return None
    try:
        return split_with_embedding_and_loss(layers, chunks)
    except ValueError:
        return None


def parse_layout(text: str) -> list[int] | None:
    """Decoder layers per virtual stage of a Megatron ``pipeline_model_parallel_layout`` string
    ("Et*3|(t*4|)*14ttL": E embedding, t a decoder layer, m an MTP layer, L the loss, | a stage
    boundary, x*n and (...)*n repetition); None when ``text`` holds no such string."""
    m = re.search(r"(E[Etm L|()*0-9]*L)", text.replace(" ", ""))
    if not m:
        return None
    layout = m.group(1)
    while "(" in layout:  # innermost groups first
        layout = re.sub(r"\(([^()]*)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), layout)
    layout = re.sub(r"([Etm])\*(\d+)", lambda g: g.group(1) * int(g.group(2)), layout)
    return [stage.count("t") for stage in layout.split("|")]


def _why_not(r: dict) -> str | None:
    """Why a row cannot be expressed, or None."""
    if r["section"] != "Pre-Training Performance":
        return "not pre-training"
    if r["Model"] not in MODELS:
        return "no config.json for the model"
    if r["System"] not in SYSTEMS:
        return "no hardware file for the system"
    if r["Precision"] not in PRECISIONS:
        return f"precision {r['Precision']!r} (alternate values)"
    if any("(" in r[k] for k in ("TP", "PP", "CP", "VP", "EP", "FSDP", "GBS", "MBS", "Tokens / sec / GPU")):
        return "alternate values in parentheses"
    if _int(r["FSDP"], 0) > 0:
        return "Megatron FSDP (with CPU offloading in its presets) is not modelled"
    if _int(r["ETP"]) > 1:
        return "expert tensor parallelism is not modelled"
    return None


def _layers(tag: str) -> int:
    import json

    cfg = json.loads((CONFIG / "models" / f"{tag}.json").read_text())
    return int(cfg["num_hidden_layers"])


def skipped(reference_dir: Path | None = None) -> list[tuple[str, str, str]]:
    """(file, line, reason) of every row left out."""
    out = []
    settings = preset_settings()
    for r in _read(reference_file(BRIDGE.file, reference_dir)):
        s = settings.get((r["Model"], r["System"], r["Precision"], r["container"]))
        why = _why_not(r) or _layout_problem(r, s)
        if why:
            out.append((r["file"], r["line"], why))
    return out


def _layout_problem(r: dict, settings: dict | None = None) -> str | None:
    gpus, tp, pp, cp = _int(r["#-GPUs"]), _int(r["TP"]), _int(r["PP"]), _int(r["CP"])
    if gpus % (tp * pp * cp):
        return "GPUs not divisible by TP x PP x CP"
    if _stages(r, settings) is None:
        chunks = _int(r["PP"]) * _int(r["VP"])
        return f"{_layers(MODELS[r['Model']])} layers do not split over {chunks} virtual stages (no preset layout)"
    dp, mbs = gpus // (tp * pp * cp), _int(r["MBS"])
    if r["GA"] not in ("", "n/a") and int(r["GA"]) != _int(r["GBS"]) // (mbs * dp):
        return "GA contradicts GBS / (MBS x DP)"
    return None


def _stages(r: dict, settings: dict | None) -> list[int] | None:
    """The row's layers per virtual stage: the preset's explicit layout (DeepSeek-V3), else the
    rule of ``stage_layers``; None when neither gives one."""
    layers, chunks = _layers(MODELS[r["Model"]]), _int(r["PP"]) * _int(r["VP"])
    text = (settings or {}).get("pipeline_layout", "")
    explicit = parse_layout(text) if "note:" not in text else None  # a note flags a preset of another layout
    if explicit and len(explicit) == chunks and sum(explicit) == layers:
        return explicit
    return stage_layers(layers, chunks)


# training.recompute_modules Echo traces, and their letters in workload names
_SHORT = {"core_attn": "a", "layernorm": "n", "moe_act": "x", "mlp": "m", "mla_up_proj": "q"}


def recompute_modules(settings: dict | None) -> tuple[list[str], list[str]]:
    """(modules Echo recomputes, modules it does not model) of a row's preset: its
    recompute_modules list where its granularity is selective (a list the preset sets but leaves
    inert, granularity unset, recomputes nothing)."""
    s = settings or {}
    if not s.get("recompute", "").startswith("selective"):
        return [], []
    listed = re.match(r"\s*\[([^\]]*)\]", s.get("recompute_modules", ""))
    names = re.findall(r"'([a-z_]+)'", listed.group(1)) if listed else []
    return [n for n in names if n in _SHORT], [n for n in names if n not in _SHORT]


def _flag(settings: dict | None, key: str) -> bool | None:
    """A True / False column of the transcribed presets (None: not transcribed or unknown)."""
    value = (settings or {}).get(key, "").strip().lower()
    return True if value.startswith("true") else False if value.startswith("false") else None


def _notes(r: dict, settings: dict | None) -> list[str]:
    """What the row's preset runs that the workload does not express."""
    s, out = settings or {}, []
    _, missing = recompute_modules(s)
    if missing:
        out.append(f"recompute of {missing} (not modelled: not recomputed)")
    if _flag(s, "moe_a2a_overlap") and _int(r["EP"]) > 1 and _int(r["PP"]) > 1 and _int(r["VP"]) <= 1:
        out.append("expert-parallel all-to-all overlap without virtual stages (not modelled)")
    if s.get("mtp_num_layers", "").startswith("1"):
        out.append("one multi-token-prediction layer (not modelled)")
    graph = s.get("cuda_graph", "")
    if graph.startswith("transformer_engine") or graph.startswith("local"):
        out.append(f"CUDA graphs of single modules ({graph}; not modelled: their ops are launched one by one)")
    return out


def _workload(r: dict, settings: dict | None) -> tuple[str, dict]:
    tag, short = MODELS[r["Model"]], SYSTEMS[r["System"]][2]
    gpus, tp, pp, cp = _int(r["#-GPUs"]), _int(r["TP"]), _int(r["PP"]), _int(r["CP"])
    vp, ep = _int(r["VP"]), _int(r["EP"])
    gbs, mbs, seq = _int(r["GBS"]), _int(r["MBS"]), _int(r["Sequence Length"])
    dp = gpus // (tp * pp * cp)
    dtype, recipe = PRECISIONS[r["Precision"]]
    s = settings or {}
    # the presets' selective recompute of the modules Echo traces (training.recompute_modules)
    modules, _ = recompute_modules(s)
    recompute = "selective" if modules else "full" if s.get("recompute", "").startswith("full") else "none"
    tp_overlap = tp > 1 and _flag(s, "tp_comm_overlap") is not False
    par = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "zero": 1, "sequence_parallel": tp > 1,
           "schedule": "interleaved" if vp > 1 else "1f1b", **({"virtual_stages": vp} if vp > 1 else {})}
    layout = _stages(r, settings)
    if layout and len(set(layout)) > 1:  # an even split is the default
        par["stage_layers"] = layout
    par |= {"overlap_grad_reduce": dp * cp > 1, "overlap_param_gather": dp * cp > 1, "tp_comm_overlap": tp_overlap}
    # the presets' overlap_moe_expert_parallel_comm (combined 1F1B; their delay_wgrad_compute is not
    # modelled apart: the backward's pieces between all-to-alls keep their weight-gradient GEMMs)
    if _flag(s, "moe_a2a_overlap") and ep > 1 and (pp == 1 or vp > 1):
        par["ep_comm_overlap"] = True
    # the presets' token dispatcher: alltoall, or flex (DeepEP / HybridEP); unknown: alltoall
    flex = ep > 1 and s.get("moe_dispatcher", "").startswith("flex")
    if flex:
        par["moe_dispatcher"] = "flex"
    # the presets' FP8 parameter gathers (fp8_param_gather=True in their mixed-precision recipe)
    fp8_gather = bool(recipe) and "fp8_param_gather=true" in s.get("fp8_recipe", "").replace(" ", "").lower()
    # the perf presets' mixed_precision.grad_reduce_in_fp32=False: bf16 gradient buffers and reductions
    other = s.get("other", "").replace(" ", "").lower()
    grad32 = "grad_reduce_in_fp32=false" not in other
    # cross_entropy_fusion_impl=te: the fused loss (the rows whose presets say nothing: Megatron's default, off)
    ce_fused = "cross_entropy_fusion_impl=te" in other
    # the presets' full-iteration CUDA graphs: the step launched as one graph (no host launches)
    graphed = s.get("cuda_graph", "").startswith("full_iteration")
    training = {"global_batch": gbs, "micro_batch": mbs, "dtype": dtype, "recompute": recompute,
                **({"recompute_modules": modules} if modules else {}),
                **({"fp8_recipe": recipe} if recipe else {}), **({"fp8_param_gather": True} if fp8_gather else {}),
                **({} if grad32 else {"grad_reduce_in_fp32": False}),
                **({"cross_entropy_fusion": True} if ce_fused else {}),
                **({"cuda_graph": "full_iteration"} if graphed else {})}
    prec = (recipe or dtype).replace("current", "fp8cs")
    suffix = ("" if tp_overlap == (tp > 1) else "-notpov") + ("" if recompute == "none" else f"-{recompute}" if not modules else "-rc" + "".join(_SHORT[m] for m in modules)) \
        + ("-fp8ag" if fp8_gather else "") + ("-flex" if flex else "") + ("-epov" if par.get("ep_comm_overlap") else "") + ("-g32" if grad32 else "") \
        + ("" if ce_fused else "-ceu") + ("-cg" if graphed else "")
    name = f"mbridge-{short}-{tag}-{prec}-{gpus}g-tp{tp}pp{pp}cp{cp}vp{vp}ep{ep}-gbs{gbs}mbs{mbs}{suffix}"
    w = {"description": "", "model": {"hf_config": f"config/models/{tag}.json", "seq_len": seq},
         "parallel": par, "training": training}
    return name, w


def bridge_rows(reference_dir: Path | None = None) -> list[Row]:
    """Every expressible row (see the module's docstring), its workload and its declared split."""
    split, settings = declared_split(), preset_settings()
    out = []
    for r in _read(reference_file(BRIDGE.file, reference_dir)):
        s = settings.get((r["Model"], r["System"], r["Precision"], r["container"]))
        if _why_not(r) or _layout_problem(r, s):
            continue
        name, w = _workload(r, s)
        hw, topo, _ = SYSTEMS[r["System"]]
        tflops = float(re.match(r"[0-9.]+", r["Model TFLOP / sec / GPU"]).group())  # "661[^gpt-oss-note]"
        out.append((r, Row(BRIDGE, r["container"], w, _int(r["#-GPUs"]), tflops, float(r["step_time_s_derived"]),
                           model_tag=MODELS[r["Model"]], system=(hw, topo), workload_name=name,
                           split=split[(r["file"], r["line"])])))
    # the rows of one workload (releases that measured the same layout) share its file's header
    groups: dict[str, list[dict]] = {}
    for r, row in out:
        groups.setdefault(row.name, []).append(r)
    return [dataclasses.replace(row, workload=_shared(row.workload, groups[row.name], settings),
                                published_note=_note(groups[row.name], row)) for r, row in out]


def _shared(w: dict, rows: list[dict], settings: dict) -> dict:
    r = rows[0]
    where = ", ".join(f"{x['file']} line {x['line']} ({x['container']})" for x in rows)
    notes = {n: None for x in rows for n in _notes(x, settings.get((x["Model"], x["System"], x["Precision"], x["container"])))}
    runs = f" The presets also run, in some of these releases: {'; '.join(notes)}." if notes else ""
    return {**w, "description": f"{r['Model']} on {r['System']} in {r['Precision']} from {BRIDGE.citation}: {where}; "
                                f"generated by echo.validate.bridge from {BRIDGE.file} (echo.reference).{runs}"}


def _note(rows: list[dict], row: Row) -> str:
    each = "; ".join(f"{x['container']} {x['Tokens / sec / GPU']} tokens/s/GPU -> {float(x['step_time_s_derived']):.3f} s"
                     for x in rows)
    return f"{each} per iteration on {row.gpus} GPUs ({row.hardware}, {row.topology})."
