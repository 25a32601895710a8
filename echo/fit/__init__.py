"""echo.fit: a GPU's compute-model parameters fitted to published measurements, above the stages
(it traces, profiles, simulates and reads the published tables; no stage imports it):
echo.fit.compute fits ``matmul_efficiency`` to the best GEMM of a shape search (every GPU of
hardware.csv) and ``hbm_efficiency`` to Korthikanti et al. Table 4's per-layer times (A100);
echo.fit.step fits ``sustained_compute`` to the Megatron-Core table's step times (H100). One
parameter set per GPU, no per-row factors; the others keep the hardware file's values (assumed, or
transferred from another GPU's fit). The rule fit (``make fit``) writes results/fit/{hardware}.json;
the hardware file carries its values and names it in ``compute_model.fitted_by`` with its code
version, and ``stale_fits`` lists the files fitted by other code than today's.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from echo.config import CONFIG_ROOT, load_hardware, load_topology, load_workload
from echo.fit import compute, step
from echo.fit.common import Fit, network_model, parameters
from echo.reference import reference_root

log = logging.getLogger(__name__)
# what the fits beyond the best GEMM's fit, by hardware: (parameters, topology of the collectives)
MORE = {compute.KORTHIKANTI_HARDWARE: (("hbm_efficiency",), compute.KORTHIKANTI_TOPOLOGY),
        step.STEP_HARDWARE: (step.STEP_FIT_PARAMS, step.STEP_TOPOLOGY)}


def fitted_parameters(name: str) -> tuple[str, ...]:
    """The compute-model parameters the fit of hardware ``name`` fits (none: it has no fit)."""
    return ("matmul_efficiency", *MORE.get(name, ((),))[0]) if name in compute.BEST_GEMM_TFLOPS else ()


def reference_tables(name: str) -> list[str]:
    """The files of the reference folder that the fit of ``name`` reads (ValueError: it has no fit)."""
    if not fitted_parameters(name):
        raise ValueError(f"no fit for hardware '{name}'; fitted: {', '.join(compute.BEST_GEMM_TFLOPS)}")
    more = {compute.KORTHIKANTI_HARDWARE: compute.KORTHIKANTI_CSV, step.STEP_HARDWARE: step.STEP_SOURCE.file}
    return [compute.HARDWARE_CSV, *([more[name]] if name in more else [])]


def step_workloads(name: str, reference_dir: Path | None = None) -> list[str]:
    """The workloads of the published rows whose steps the fit of ``name`` simulates (traced by the workflow)."""
    return [r.name for r in step.step_rows(reference_dir)] if name == step.STEP_HARDWARE else []


def fit_config(name: str, reference_dir: Path | None = None, config_root: Path | None = None) -> dict:
    """What the fit of ``name`` reads from the config folder (the rule's params, so an edit re-runs it): the
    hardware file without what the fit gives (fitted values, provenance, source, fitted_by), the topology, the workloads."""
    hw = load_hardware(name, root=config_root).model_dump()
    drop = {*fitted_parameters(name), "source", "provenance", "fitted_by"}
    out = {"hardware": {**hw, "compute_model": {k: v for k, v in hw["compute_model"].items() if k not in drop}}}
    if name in MORE:
        out["topology"] = load_topology(MORE[name][1], root=config_root).model_dump()
    out["workloads"] = {w: load_workload(w, root=config_root).model_dump() for w in step_workloads(name, reference_dir)}
    return out


def fit_hardware(name: str, code: str, *, reference_dir: Path | None = None, config_root: Path | None = None,
                 traces: dict[str, tuple[Path, Path]] | None = None, network_json: Path | None = None,
                 jobs: int = 2) -> dict:
    """The fit of hardware ``name`` as results/fit/{hardware}.json holds it: fitted values, every parameter
    after the fit, each reference row (fit, held out or untraceable; predicted and measured), the split, the
    inputs and ``code`` (the fit's code version). ``traces``: (trace folder, rank classes) of each workload of
    step_workloads(name); ``network_json``: the calibrate stage's model of the step fit's topology (default nominal)."""
    ref, tables = reference_root(reference_dir), reference_tables(name)
    try:
        problems = compute.check_reference(ref, name)
        hashes = {t: hashlib.sha256((ref / t).read_bytes()).hexdigest()[:16] for t in tables}
    except FileNotFoundError as exc:
        problems, hashes = [f"{exc}: using the figures copied into {compute.__name__}"], {}
    for line in problems:
        log.warning("reference: %s", line)
    hw, gemm = compute.fit_gemm(load_hardware(name, root=config_root))
    lines = [f"  best GEMM: model {gemm['model_best_tflops']:.1f} TFLOP/s at {gemm['best_shape']} vs measured "
             f"{gemm['measured_tflops']:.1f} ({gemm['error_pct']:+.2f}%)"]
    if name == compute.KORTHIKANTI_HARDWARE:
        result = compute.fit_layers(hw, network_model(compute.KORTHIKANTI_TOPOLOGY), jobs=jobs)
        lines += compute.layer_lines(result.rows)
    elif name == step.STEP_HARDWARE:
        cases = step.step_cases(traces or {}, reference_dir, config_root)
        result = step.fit_steps(hw, cases, network_model(step.STEP_TOPOLOGY, network_json))
        lines += step.step_lines(result.rows)
    else:
        result = Fit(name, {}, parameters(hw), [], {"fit": [], "held_out": []})
    fitted = {"matmul_efficiency": gemm["matmul_efficiency"], **result.fitted}
    log.info("%s: fitted %s (fit code %s)\n%s", name, fitted, code, "\n".join(lines))
    inputs = {"config": fit_config(name, reference_dir, config_root), "reference": hashes,
              "reference_problems": problems, "traces": {w: [str(p) for p in t] for w, t in (traces or {}).items()},
              "network": str(network_json) if network_json else f"nominal {MORE[name][1]}" if name in MORE else None}
    split = {**result.split, "fit": [gemm["row"], *result.split["fit"]]}  # the best GEMM's row, then the table's
    return {**result.to_dict(), "fitted": fitted, "split": split, "code": code, "gemm": gemm, "inputs": inputs}


def stale_fits(code: str, config_root: Path | None = None) -> list[str]:
    """'<file>: why' for each hardware file whose ``compute_model.fitted_by`` names other fit code than
    ``code`` (code_version("fit") today), or other parameters than the fit fits."""
    out = []
    for path in sorted(Path(config_root or CONFIG_ROOT).glob("hardware/*.yaml")):
        by, want = load_hardware(path.stem, root=config_root).compute_model.fitted_by, fitted_parameters(path.stem)
        if (by.parameters if by else ()) != want:
            out.append(f"{path}: the fit fits {list(want)}; compute_model.fitted_by names {by and list(by.parameters)}")
        elif by and by.code != code:
            out.append(f"{path}: fitted by fit code {by.code}, the fit is now {code}: run `make fit` and copy the "
                       f"values and code of {by.fit} into the file")
    return out
