"""The per-kernel reference tables (reference folder, kernels/) as rows the kernel fit reproduces,
each with its split: fit, held_out (reported, never fitted), check (an extrapolation check beyond
the fitted tables), excluded (with the reason). The rules are config/splits/kernel_tables.yaml,
declared before any fit; ``split_rows`` lists what they give (config/splits/kernel_tables.csv).

Every table is read through echo.reference; nothing here fits or models.
"""

from __future__ import annotations

import csv
import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

from echo.profile.attention_model import AttentionCall
from echo.reference import reference_file

KERNELS_DIR = "kernels"
TABLES = ("xla_matmul_table.csv", "tilelang_matmul_h800.csv", "deepgemm_fp8.csv", "torch_square_gemm.csv",
          "fastcu_bf16_gemm.csv", "flash_attention.csv", "hbm_bandwidth.csv")
SPLIT_CSV = Path(__file__).resolve().parents[2] / "config" / "splits" / "kernel_tables.csv"

H100, H200, A100, B200 = "h100-sxm-80gb", "h200-sxm-141gb", "a100-sxm-80gb", "b200-sxm"
XLA_GPU = {"sm_90": H100, "sm_100_B200": B200}
# XLA's dtype keys -> (GEMM format, bytes of A, B, C)
XLA_DTYPE = {"bf16xbf16->bf16": ("bf16", 2, 2, 2), "f32xf32->f32": ("fp32", 4, 4, 4),
             "f8e4m3fnxf8e4m3fn->bf16": ("fp8", 1, 1, 2), "f8e4m3fnxf8e5m2->bf16": ("fp8", 1, 1, 2),
             "f8e5m2xf8e4m3fn->bf16": ("fp8", 1, 1, 2)}
# the sm_90 fp8 rows exceed the H100 dense FP8 peak (split file, "amended")
XLA_EXCLUDED = {("sm_90", "fp8"): "sm_90 fp8 rows: 28-30 per combination exceed H100's dense FP8 peak (1979 TFLOP/s)"}
DEEPGEMM_VERSION = "989c9e3694638dd02aa36b4d8cb42339305caa85"
SQUARE_SIZES = (1024, 2048, 4096, 8192, 10240)  # torch_square_gemm.csv's "max over square sizes"
SQUARE_GPU = {"NVIDIA A100 SXM4 80GB": A100, "NVIDIA A800 SXM4 80GB": A100, "NVIDIA H100 80GB HBM3": H100,
              "NVIDIA H200": H200, "NVIDIA B200 180GB": B200}
# gpu-stream files -> hardware file (None: no hardware file; the sweep still informs the sweep model)
STREAM_GPU = {"a100_40": None, "a100_80": A100, "h100_pcie": None, "h200": H200}


def held_by_hash(key: str) -> bool:
    """The split file's hash rule: held out when int(sha256(key)[:8], 16) % 4 == 0."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 4 == 0


def _alternate(rows: list, sort_key) -> None:
    """The split file's small-table rule: sorted, the 1st, 3rd, ... fit, the 2nd, 4th, ... held out."""
    for i, r in enumerate(sorted(rows, key=sort_key)):
        r.split = "fit" if i % 2 == 0 else "held_out"


def _read(name: str, root: Path | None) -> list[dict]:
    return list(csv.DictReader(reference_file(f"{KERNELS_DIR}/{name}", root).read_text().splitlines()))


# --- GEMMs -------------------------------------------------------------------------------------
@dataclass
class GemmRow:
    """One measured GEMM (a grouped GEMM is a batch of independent ones)."""

    table: str
    key: str
    gpu: str               # hardware file name
    fmt: str               # bf16 | fp32 | fp8 | blockwise_fp8
    batch: int
    m: int
    n: int
    k: int
    a_bytes: float
    b_bytes: float
    out_bytes: float
    us: float              # measured kernel time, microseconds
    split: str = "fit"
    note: str = ""
    sizes: tuple[int, ...] = ()   # square-peak rows: the sizes the measurement took the max over

    @property
    def tflops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k / self.us / 1e6


def xla_rows(root: Path | None = None) -> list[GemmRow]:
    out = []
    for r in _read("xla_matmul_table.csv", root):
        if r["gpu_key"] not in XLA_GPU:
            continue
        fmt, a, b, c = XLA_DTYPE[r["dtype"]]
        bb, m, n, k = (int(r[x]) for x in ("b", "m", "n", "k"))
        key = f"{bb}x{m}x{n}x{k}"
        why = XLA_EXCLUDED.get((r["gpu_key"], fmt), "")
        out.append(GemmRow("xla_matmul_table.csv", f"{r['gpu_key']}:{r['dtype']}:{key}", XLA_GPU[r["gpu_key"]], fmt,
                           bb, m, n, k, a, b, c, float(r["time_us_derived"]),
                           "excluded" if why else "held_out" if held_by_hash(key) else "fit", why))
    return out


def tilelang_rows(root: Path | None = None) -> list[GemmRow]:
    out = []
    for r in _read("tilelang_matmul_h800.csv", root):
        fp8 = r["dtype"].startswith("fp8")
        m, n, k = int(r["m"]), int(r["n"]), int(r["k"])
        us = float(r["latency_as_printed_header_says_s"]) * 1e3  # printed in ms (README of the table)
        fmt, size, out_size = ("fp8", 1, 1) if fp8 else ("bf16", 2, 2)  # fp16: the bf16 tensor-core rate
        out.append(GemmRow("tilelang_matmul_h800.csv", f"{'fp8' if fp8 else 'fp16'}:{k}", H100, fmt, 1, m, n, k,
                           size, size, out_size, us, "fit" if fp8 else "check", "H800 = H100 silicon"))
    _alternate([r for r in out if r.fmt == "fp8"], lambda r: r.k)
    return out


def deepgemm_rows(root: Path | None = None) -> list[GemmRow]:
    out = []
    for r in _read("deepgemm_fp8.csv", root):
        groups = int(r["num_groups"] or 1)
        m, n, k = int(r["m_or_m_per_group"]), int(r["n"]), int(r["k"])
        us = 2.0 * groups * m * n * k / float(r["tflops"]) / 1e6
        key = f"{r['table']}:{r['num_groups']}:{m}:{n}:{k}"
        latest = r["readme_commit"] == DEEPGEMM_VERSION
        out.append(GemmRow("deepgemm_fp8.csv", key if latest else f"{r['readme_commit'][:7]}:{key}", H100,
                           "blockwise_fp8", groups, m, n, k, 1, 1, 2, us, "fit" if latest else "excluded",
                           r["table"] if latest else "superseded README version"))
    for table in ("dense", "grouped_contiguous", "grouped_masked"):
        _alternate([r for r in out if r.split != "excluded" and r.note == table], lambda r: r.key)
    return out


def square_rows(root: Path | None = None) -> list[GemmRow]:
    """torch.matmul square GEMMs: one row per (device row, dtype column) with a value."""
    out = []
    for i, r in enumerate(_read("torch_square_gemm.csv", root)):
        gpu = SQUARE_GPU.get(r["device_as_stated"])
        if gpu is None:
            continue
        sizes = (int(r["square_size_n"]),) if r["square_size_n"] else SQUARE_SIZES
        for col, fmt, size in (("bf16_tflops", "bf16", 2), ("fp16_tflops", "bf16", 2), ("tf32_tflops", "fp32", 4)):
            if not r[col]:
                continue
            n = max(sizes)  # the measured value is the max over sizes; the model takes the same max
            tflops = float(r[col])
            split = "check"
            if gpu == A100:  # the split file's A100 amendment
                split = "fit" if r["device_as_stated"].endswith("A100 SXM4 80GB") and col == "bf16_tflops" else "held_out"
            out.append(GemmRow("torch_square_gemm.csv", f"{i + 2}:{r['device_as_stated']}:{r['square_size_n'] or 'max'}:{col}",
                               gpu, fmt, 1, n, n, n, size, size, size, 2.0 * n**3 / tflops / 1e6, split,
                               r["device_as_stated"], sizes))
    return out


def fastcu_rows(root: Path | None = None) -> list[GemmRow]:
    return [GemmRow("fastcu_bf16_gemm.csv", f"{r['implementation']}:{r['square_size_n']}", H100, "bf16", 1,
                    int(r["square_size_n"]), int(r["square_size_n"]), int(r["square_size_n"]), 2, 2, 2,
                    2.0 * int(r["square_size_n"]) ** 3 / float(r["tflops"]) / 1e6, "check", r["implementation"])
            for r in _read("fastcu_bf16_gemm.csv", root)]


def gemm_rows(root: Path | None = None) -> list[GemmRow]:
    return xla_rows(root) + tilelang_rows(root) + deepgemm_rows(root) + square_rows(root) + fastcu_rows(root)


# --- attention ---------------------------------------------------------------------------------
@dataclass
class AttentionRow:
    key: str
    gpu: str | None
    call: AttentionCall | None
    us: float | None
    source: str
    implementation: str
    split: str = "fit"
    note: str = ""
    tflops: float | None = None


_FA3 = ("FA3", "flash_v3", "FlashAttention-3")
_FA4 = ("FA4 CuTe fwd", "FA4 CuTe bwd [2CTA]")


def _attention_gpu(r: dict) -> tuple[str | None, str]:
    """(hardware, '') of a modelled row, else (None, why not)."""
    g, impl = r["gpu_as_stated"], r["implementation"]
    if r["source_id"] == "FA3-abstract":
        return None, "headline maximum, not a configuration (a check)"
    if "3x what" in r["note"]:
        return None, "flagged inconsistent in the table's note"
    if g.startswith("SM100"):
        return (B200, "") if impl in _FA4 else (None, "FA4 variant not taken (deterministic or 1CTA backward)")
    if "PCIe" in g or g.startswith("H20 "):
        return None, "no hardware file for this GPU"
    if impl.startswith(_FA3):
        if g.startswith("H200"):
            return H200, ""
        if g.startswith(("H100", "Hopper")):
            return H100, ""
    return None, "other implementation than the GPU's reference flash kernel"


def attention_rows(root: Path | None = None) -> list[AttentionRow]:
    out = []
    for r in _read("flash_attention.csv", root):
        gpu, why = _attention_gpu(r)
        tflops = float((r["tflops"] or r["tflops_derived"]).lstrip("~") or 0) or None
        key = (f"{r['source_id']}:{r['direction']}:{r['causal']}:{r['headdim']}:{r['batch']}:{r['seqlen']}:"
               f"{r['nheads']}")
        if gpu is None:
            out.append(AttentionRow(f"{key}:{r['implementation']}", None, None, None, r["source_id"],
                                    r["implementation"], "excluded", why, tflops))
            continue
        b, s, h, d = int(r["batch"]), int(r["seqlen"]), int(r["nheads"]), int(r["headdim"])
        causal, backward = r["causal"] == "True", r["direction"] == "bwd"
        call = AttentionCall(b, h, s, s, d, backward, causal, False)
        # FlashAttention's FLOP convention (the table's README): fwd 4*B*H*S^2*D, halved if causal, bwd 2.5x
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
        us = float(r["time_ms"]) * 1e3 if r["time_ms"] else float(r["time_us"]) if r["time_us"] else flops / tflops / 1e6
        out.append(AttentionRow(key, gpu, call, us, r["source_id"], r["implementation"], tflops=tflops))
    for gpu in (H100, B200):
        for backward in (False, True):
            _alternate([r for r in out if r.gpu == gpu and r.call.backward == backward],
                       lambda r: (r.call.causal, r.call.head_dim, r.call.s_q, r.call.batch, r.key))
    for r in out:
        if r.gpu == H200:
            r.split = "held_out"
    return out


# --- HBM ---------------------------------------------------------------------------------------
@dataclass
class StreamRow:
    """One bandwidth measurement: a gpu-stream occupancy point, or a sized kernel (bytes, time)."""

    key: str
    source: str
    sweep: str | None          # gpu-stream file (a100_80, h200, ...), None for sized rows
    gpu: str | None            # hardware file, None: no hardware file (the sweep model only)
    kernel: str
    GBps: float
    occupancy: float = 1.0     # fraction of the SM's thread slots
    nbytes: float | None = None  # sized rows: bytes moved
    split: str = "fit"
    note: str = field(default="")


def stream_rows(root: Path | None = None) -> list[StreamRow]:
    out, sized = [], []
    for r in _read("hbm_bandwidth.csv", root):
        src = r["source_id"]
        if src == "gpu-benches-gpu-stream":
            sweep = r["source"].split("gpu-stream/")[1].split(".txt")[0]
            key = f"{sweep}:{r['kernel_or_op']}:{r['block_size']}"
            out.append(StreamRow(key, src, sweep, STREAM_GPU[sweep], r["kernel_or_op"], float(r["bandwidth_GBps"]),
                                 float(r["occupancy_pct"]) / 100, split="held_out" if held_by_hash(key) else "fit"))
        elif src in ("cccl-PR7391", "fastcu-sum"):
            elements = _elements(r["problem_size"])
            # bytes moved: add reads two fp16/bf16 inputs and writes one; the sum reads its fp32 input
            nbytes = 3 * 2 * elements if src == "cccl-PR7391" else 4 * elements
            sized.append(StreamRow(f"{src}:{r['kernel_or_op']}:{r['dtype']}:{r['problem_size']}", src, None,
                                   B200 if src == "cccl-PR7391" else H100, r["kernel_or_op"],
                                   float(r["bandwidth_GBps"]), nbytes=nbytes))
        else:
            out.append(StreamRow(f"{src}:{r['kernel_or_op']}:{r['problem_size']}:{len(out)}", src, None, None,
                                 r["kernel_or_op"], float(r["bandwidth_GBps"]), split="excluded",
                                 note="no hardware file (A800 PCIe)" if src == "mli-tb-issue4" else
                                 "copy engine, not an SM kernel"))
    for src in ("cccl-PR7391", "fastcu-sum"):
        _alternate([r for r in sized if r.source == src], lambda r: r.key)
    return out + sized


def _elements(problem: str) -> float:
    """'2^28 = 268435456 elements' -> 268435456; '2^30 elements' -> 2**30."""
    head = problem.split("=")[-1].split()[0] if "=" in problem else problem.split()[0]
    return float(2 ** int(head[2:])) if head.startswith("2^") else float(head)


# --- the split, listed ----------------------------------------------------------------------------
def split_rows(root: Path | None = None) -> list[tuple[str, str, str, str]]:
    """(table, key, hardware, split) of every row of the kernel tables, in table order."""
    rows = [(r.table, r.key, r.gpu, r.split) for r in gemm_rows(root)]
    rows += [("flash_attention.csv", r.key, r.gpu or "", r.split) for r in attention_rows(root)]
    rows += [("hbm_bandwidth.csv", r.key, r.gpu or "", r.split) for r in stream_rows(root)]
    return rows


def write_split_csv(path: Path = SPLIT_CSV, root: Path | None = None) -> None:
    """config/splits/kernel_tables.csv: the rows the rules hold out or keep as checks (every other row
    of the tables is fitted or excluded, as kernel_tables.yaml says), one line each."""
    out = io.StringIO()
    out.write("# Split of the kernel reference tables by the rules of kernel_tables.yaml (echo.fit.kernel_data;\n"
              "# regenerate with python -m echo.fit.kernel_data): the held_out rows (reported, never fitted) and\n"
              "# the check rows (extrapolation checks, never fitted). Every other row is a fit row or excluded.\n")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(("table", "key", "hardware", "split"))
    writer.writerows(r for r in split_rows(root) if r[3] in ("held_out", "check"))
    path.write_text(out.getvalue())


def read_split_csv(path: Path = SPLIT_CSV) -> list[tuple[str, str, str, str]]:
    rows = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return [tuple(r) for r in csv.reader(rows[1:])]


if __name__ == "__main__":
    write_split_csv()
