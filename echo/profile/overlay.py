"""A hardware profile overlay: a real job's measured kernels (echo.profile.gpu_import) laid over
the hardware model, for the kernels they cover.

Built from an import's ``model_error`` rows, events that ran alone only (a kernel beside an NCCL
kernel measures the overlap, not the kernel):

- ``exact``: the measured median of each (op, shapes, dtypes) signature, for a traced kernel of
  the very same call;
- ``regimes``: per shape regime - op class, GEMM format, the model's bound (compute, memory, launch)
  and the decade of the work (GEMM FLOPs, streamed bytes) - the median of measured / modelled
  over the regime's shapes, where at least MIN_SHAPES shapes fall in it and the factor predicts
  the regime's shapes better than the model does when each is left out of its own factor (a
  regime whose errors are shape-specific, e.g. wave quantization, keeps the model). A kernel of a
  covered regime gets the model's time times that factor.

Everything else keeps the model. The split is declared before any error is looked at: a shape
whose signature hash is divisible by HOLDOUT_EVERY is held out; the overlay is fitted on the
others, and its error on the held-out shapes (with the model's beside it) is written into the
overlay, so the figure it reports is not scored on its own fit rows.

The profile stage (``run_profile(overlay=...)``) applies it to a GPU hardware's modelled kernels;
its kernels.parquet says which: source ``overlay`` (measured, same call), ``model+overlay`` (the
regime's factor) or ``model``.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from echo.config import Hardware
from echo.io import write_json
from echo.profile import roofline
from echo.profile.gemm_model import gemm_call
from echo.profile.kernel import Kernel, Result

HOLDOUT_EVERY = 4
MIN_SHAPES = 3
SCHEMA = "echo-overlay 1"


def held_out(signature: str) -> bool:
    """The declared split: one shape in HOLDOUT_EVERY, by its signature's hash."""
    return int(hashlib.sha1(signature.encode()).hexdigest()[:8], 16) % HOLDOUT_EVERY == 0


def regime(op_class: str, fmt: str, bound: str, work: float) -> str:
    """op class | format | bound | decade of the work: the unit a factor covers."""
    decade = math.floor(math.log10(work)) if work > 0 else -1
    return f"{op_class}|{fmt}|{bound}|1e{decade}"


def _class(op_class: str) -> str:
    return op_class.split(" (")[0]  # "gemm (fp32)" -> gemm: the format is a field of its own


def build_overlay(rows: list[dict], hardware: str, sources: list[str]) -> dict:
    """The overlay of ``rows`` (IMPORTED_MODEL_ERROR rows of one or more imports)."""
    rows = [r for r in rows if r["isolated"] and r["signature"] and r["measured_us"] > 0 and r["predicted_us"] > 0]
    fit = [r for r in rows if not held_out(r["signature"])]
    hold = [r for r in rows if held_out(r["signature"])]
    ratios: dict[str, list[float]] = defaultdict(list)
    shapes: dict[str, set] = defaultdict(set)
    for r in fit:
        key = regime(_class(r["op_class"]), r["fmt"], r["bound"], r["work"])
        ratios[key].append(r["measured_us"] / r["predicted_us"])
        shapes[key].add(r["signature"])
    regimes = {}
    for k, v in sorted(ratios.items()):
        if len(shapes[k]) < MIN_SHAPES:
            continue
        with_factor, without = _leave_one_out(v)
        if with_factor < without:  # the factor predicts a regime's unseen shapes better than the model
            regimes[k] = {"factor": float(statistics.median(v)), "shapes": len(shapes[k]), "events": len(v),
                          "loo_mean_abs_error": with_factor, "model_mean_abs_error": without}
    exact: dict[str, list[float]] = defaultdict(list)
    for r in fit:
        exact[r["signature"]].append(r["measured_us"])
    doc = {"schema": SCHEMA, "hardware": hardware, "sources": sources,
           "split": {"rule": f"sha1(signature) % {HOLDOUT_EVERY} == 0 is held out", "fit_shapes": len(
               {r["signature"] for r in fit}), "held_out_shapes": len({r["signature"] for r in hold})},
           "min_shapes": MIN_SHAPES, "regimes": regimes,
           "exact": {s: float(statistics.median(v)) for s, v in sorted(exact.items())}}
    doc["validation"] = _validation(hold, regimes)
    return doc


def _leave_one_out(ratios: list[float]) -> tuple[float, float]:
    """Within the fit rows of a regime: mean |error| of each shape predicted with the median
    factor of the others, and without any factor (the model's)."""
    with_factor = [abs(statistics.median(ratios[:i] + ratios[i + 1:]) / r - 1) for i, r in enumerate(ratios)]
    return statistics.fmean(with_factor), statistics.fmean(abs(1 / r - 1) for r in ratios)


def _validation(hold: list[dict], regimes: dict) -> dict:
    """Mean |error| on the held-out shapes, the model's and the overlay's, per op class."""
    by_class: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in hold:
        key = regime(_class(r["op_class"]), r["fmt"], r["bound"], r["work"])
        factor = regimes.get(key, {}).get("factor", 1.0)
        m = r["measured_us"]
        by_class[r["op_class"]].append((abs(r["predicted_us"] / m - 1), abs(r["predicted_us"] * factor / m - 1)))
    return {c: {"shapes": len(v), "model_mean_abs_error": statistics.fmean(a for a, _ in v),
                "overlay_mean_abs_error": statistics.fmean(b for _, b in v),
                "covered": sum(1 for r in hold if r["op_class"] == c and regime(
                    _class(r["op_class"]), r["fmt"], r["bound"], r["work"]) in regimes)}
            for c, v in sorted(by_class.items())}


def write_overlay(doc: dict, path: Path) -> None:
    write_json(doc, path)


OVERLAYS_DIR = Path("imports/overlay")


def dropped_in_overlay(hardware: str, root: Path = OVERLAYS_DIR) -> dict[str, str]:
    """``{"overlay": path}`` of an overlay put at ``{root}/{hardware}.json`` to be used by every
    profile job on that hardware (the profile rule's optional input), or ``{}``. Copying an overlay
    there is the opt-in: building one (rule fit_overlay) changes no profile by itself."""
    path = Path(root) / f"{hardware}.json"
    return {"overlay": str(path)} if path.is_file() else {}


def load_overlay(path: Path, hardware: Hardware) -> dict:
    """An overlay file, refused (ValueError naming it) when it is of another schema or hardware."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not an overlay ({exc})") from None
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema '{doc.get('schema')}', expected '{SCHEMA}'")
    if doc.get("hardware") != hardware.name:
        raise ValueError(f"{path}: an overlay of hardware '{doc.get('hardware')}', not '{hardware.name}'")
    return doc


def apply_overlay(doc: dict, kernels: list[Kernel], hardware: Hardware) -> dict[str, Result]:
    """kernel_key -> Result for the kernels the overlay covers (the others are not in the dict)."""
    from echo.profile.gpu_trace import signature_id
    from echo.profile.kineto import kernel_signature

    out = {}
    for k in kernels:
        try:
            sig = signature_id(kernel_signature(k))
        except ValueError:  # unreadable args: no signature to look up
            sig = None
        if sig in doc["exact"]:
            out[k.kernel_key] = Result(doc["exact"][sig], "overlay", 0, None)
            continue
        est = roofline.estimate(hardware, k)
        call = gemm_call(k.base, k.args) if k.op_class == "gemm" else None
        fmt = call.fmt if call is not None else ""
        work = call.flops if call is not None else k.bytes
        factor = doc["regimes"].get(regime(k.op_class, fmt, est.bound, work))
        if factor is not None:
            out[k.kernel_key] = Result(est.duration_us * factor["factor"], "model+overlay", 0, est.bound)
    return out
