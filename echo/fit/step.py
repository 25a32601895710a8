"""The kernel model checked against whole jobs' published step times (H100): machinery, fitting nothing.

The Megatron-Core r0.8.0 table (megatron_core_h100.csv, echo.validate.published) gives whole jobs'
step times. Each row is reproduced the way the workflow predicts it: the row's workload
(config/workloads/mcore-h100-gpt-*.yaml, overlap flags included) traced and deduplicated by the
workflow, every kernel costed by echo.profile.roofline, the step simulated end to end
(echo.simulate.run_simulate, symmetric mode) with the dgx-h100-ndr network model of the calibrate
stage. ``fit_steps`` can still fit compute-model parameters (least squares on the relative step-time
error of ``STEP_FIT_ROWS``, the odd rows held out), but by default it fits none
(``STEP_FIT_PARAMS`` is empty): a kernel parameter fitted on step times would absorb everything
else the simulation gets wrong (it did: ``sustained_compute`` 0.914 on H100, removed), so the kernel
model's parameters come from per-kernel tables only (echo.fit.kernels) and step times validate it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from echo.config import Hardware, load_topology, load_workload
from echo.config.workload import Workload
from echo.fit.common import FIT_BOUNDS, Fit, parameters, with_params
from echo.io import read_parquet, write_parquet
from echo.profile.kernel import Kernel
from echo.profile.stage import distinct_kernels, kernels_table, model_kernels
from echo.simulate import run_simulate
from echo.validate.published import MCORE, Row, source_rows

STEP_SOURCE = MCORE  # the published table, and the hardware and topology it ran on
STEP_HARDWARE, STEP_TOPOLOGY = MCORE.hardware, MCORE.topology
STEP_FIT_ROWS = ("7.1B", "32B", "119B", "314B")
STEP_FIT_PARAMS: tuple[str, ...] = ()  # no compute-model parameter is fitted on step times


@dataclass(frozen=True)
class StepCase:
    """One published row, ready to be simulated with any compute-model parameters."""

    label: str
    workload: Workload
    measured_step_s: float
    trace_dir: Path
    rank_classes: Path
    kernels: tuple[Kernel, ...]


def step_rows(reference_dir: Path | None = None) -> list[Row]:
    """The published rows of ``STEP_SOURCE`` (``reference_dir`` as for echo.reference.reference_root)."""
    return source_rows(STEP_SOURCE, reference_dir)


def step_cases(traces: dict[str, tuple[Path, Path]], reference_dir: Path | None = None,
               config_dir: Path | None = None) -> list[StepCase]:
    """Every published row of ``STEP_SOURCE`` with the workflow's (trace folder, rank classes) of
    its workload, from ``traces``. Raises FileNotFoundError, naming what is missing."""
    out, missing = [], []
    for r in step_rows(reference_dir):
        trace, classes = (Path(p) for p in traces[r.name]) if r.name in traces else (Path("-"), Path("-"))
        if not (trace / "ops.parquet").is_file() or not classes.is_file():
            missing.append(r.name)
            continue
        out.append(StepCase(r.label, load_workload(r.name, root=config_dir), r.measured_step_s, trace, classes,
                            tuple(distinct_kernels(read_parquet(trace / "ops.parquet")))))
    if missing:
        raise FileNotFoundError(f"no trace or rank classes of {', '.join(missing)}: the fit simulates these rows")
    return out


def step_times(hw: Hardware, cases: Sequence[StepCase], network, topology: str = STEP_TOPOLOGY) -> dict[str, float]:
    """Simulated step time (s) of each case with ``hw``'s compute model."""
    topo = load_topology(topology)
    out = {}
    with tempfile.TemporaryDirectory(prefix="echo-fit-step-") as tmp:
        for c in cases:
            folder = Path(tmp) / c.workload.name
            kernels = folder / "kernels.parquet"
            write_parquet(kernels_table(list(c.kernels), model_kernels(list(c.kernels), hw)), kernels)
            summary = run_simulate(c.workload, hw, topo, c.trace_dir, c.rank_classes, kernels, folder,
                                   folder / "simulate", network=network)
            out[c.label] = float(summary["step_time_s"][0].as_py())
    return out


def fit_step_times(hw: Hardware, cases: Sequence[StepCase], network, params: Sequence[str] = STEP_FIT_PARAMS,
                   topology: str = STEP_TOPOLOGY) -> dict[str, float]:
    """The ``params`` minimising the squared relative step-time error over ``cases`` (rounded to
    3 decimals; one parameter: bounded scalar search, more: Nelder-Mead from the file's values)."""
    from scipy.optimize import minimize, minimize_scalar

    if not params:
        return {}

    def loss(values) -> float:
        h = with_params(hw, {p: float(v) for p, v in zip(params, values, strict=True)})
        got = step_times(h, cases, network, topology)
        return sum((got[c.label] / c.measured_step_s - 1) ** 2 for c in cases)

    if len(params) == 1:
        lo, hi = FIT_BOUNDS[params[0]]
        res = minimize_scalar(lambda v: loss([v]), bounds=(lo, hi), method="bounded", options={"xatol": 1e-4})
        values = [res.x]
    else:
        start = [hw.compute_model.value(p) for p in params]
        res = minimize(loss, start, method="Nelder-Mead", bounds=[FIT_BOUNDS[p] for p in params],
                       options={"xatol": 1e-4, "fatol": 1e-6})
        values = list(res.x)
    return {p: round(float(v), 3) for p, v in zip(params, values, strict=True)}


def fit_steps(hw: Hardware, cases: Sequence[StepCase], network, fit_rows: Sequence[str] = STEP_FIT_ROWS,
              params: Sequence[str] = STEP_FIT_PARAMS) -> Fit:
    """Fit ``params`` of ``hw`` on the ``fit_rows`` of the published table, then report every row
    (the held-out ones with the fitted values, untouched by the fit)."""
    fit_cases = [c for c in cases if c.label in fit_rows]
    if len(fit_cases) != len(fit_rows):
        raise ValueError(f"fit rows {list(fit_rows)} not all among the cases {[c.label for c in cases]}")
    if 2 * len(fit_cases) > len(cases):
        raise ValueError(f"fitting on {len(fit_cases)} of {len(cases)} rows: at most half may be fitted")
    fitted = fit_step_times(hw, fit_cases, network, params)
    hw = with_params(hw, fitted)
    got = step_times(hw, cases, network)
    rows = [{"label": c.label, "split": "fit" if c.label in fit_rows else "held-out", "predicted_s": got[c.label],
             "measured_s": c.measured_step_s, "error_pct": 100 * (got[c.label] / c.measured_step_s - 1)}
            for c in cases]
    return Fit(hw.name, fitted, parameters(hw), rows,
               {"fit": list(fit_rows), "held_out": [r["label"] for r in rows if r["split"] == "held-out"]})


def step_lines(rows: Sequence[dict]) -> list[str]:
    out = [f"  {r['label']:<6} {r['split']:<9} predicted {r['predicted_s']:8.3f} s vs {r['measured_s']:8.3f} s "
           f"({r['error_pct']:+6.1f}%)" for r in rows]
    for split in ("fit", "held-out"):
        errs = [abs(r["error_pct"]) for r in rows if r["split"] == split]
        if errs:
            out.append(f"  {split}: mean |error| {sum(errs) / len(errs):.1f}%, max {max(errs):.1f}% over {len(errs)} rows")
    return out
