"""echo.fit: the GPU kernel model's parameters fitted to published per-kernel measurements, above the
stages (it reads the published tables through echo.reference and runs echo.profile's models; no
stage imports it).

echo.fit.kernels fits each GPU's compute_model (GEMM per input format, flash attention, achievable
HBM bandwidth) on the kernel tables of the reference folder (kernels/, split into fit and held-out
rows by config/splits/kernel_tables.yaml); GPUs of the same silicon take their values, transferred.
Nothing is fitted on step times or per-layer times: a kernel parameter fitted on them would absorb
everything else the simulation gets wrong (``sustained_compute``, fitted on H100 step times, was
removed for that). Step times validate the kernel model (echo.validate.published), and so do
Korthikanti et al.'s per-layer times (echo.fit.compute, tests/test_fit.py).

The rule fit (``make fit``) writes results/fit/{hardware}.json; the hardware file carries its values
and names it in ``compute_model.fitted_by`` with its code version, and ``stale_fits`` lists the files
fitted by other code than today's.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from echo.config import CONFIG_ROOT, load_hardware
from echo.fit import kernel_data, kernels
from echo.reference import reference_root

log = logging.getLogger(__name__)

# The parameters (provenance keys) each GPU's fit fits; tests/test_kernel_model.py checks that the
# fit fits exactly these.
FITTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "a100-sxm-80gb": ("gemm.bf16.peak_fraction", "hbm_efficiency"),
    "h100-sxm-80gb": ("attention", "gemm.bf16", "gemm.blockwise_fp8", "gemm.blockwise_launch_us", "gemm.fp8",
                      "gemm.launch_us", "gemm.tf32", "hbm_efficiency"),
    "h200-sxm-141gb": ("hbm_efficiency",),
    "b200-sxm": ("attention", "gemm.bf16", "gemm.fp8", "gemm.launch_us", "gemm.tf32", "hbm_efficiency"),
}


def fitted_parameters(name: str) -> tuple[str, ...]:
    """The compute-model parameters the fit of hardware ``name`` fits (none: it has no fit of its own)."""
    return FITTED_PARAMETERS.get(name, ())


def reference_tables(name: str) -> list[str]:
    """The files of the reference folder that the fit of ``name`` reads (ValueError: it has no fit)."""
    if name not in kernels.FITTED and name not in kernels.SAME_SILICON:
        raise ValueError(f"no fit for hardware '{name}'; fitted: {', '.join(kernels.FITTED)}, transferred: "
                         f"{', '.join(kernels.SAME_SILICON)}")
    return [f"{kernel_data.KERNELS_DIR}/{t}" for t in kernel_data.TABLES] + ["hardware.csv"]


def fit_config(name: str, reference_dir: Path | None = None, config_root: Path | None = None) -> dict:
    """What the fit of ``name`` reads from the config folder (the rule's params, so an edit re-runs it):
    the hardware file's datasheet figures (not the compute model, which the fit gives, but its SM count),
    the source GPU of a transferred file, and the split declaration."""
    hw = kernels.hardware_for_fit(name, config_root).model_dump()
    root = Path(config_root or CONFIG_ROOT)
    split = root / "splits" / "kernel_tables.yaml"
    out = {"hardware": {k: v for k, v in hw.items() if k != "compute_model"},
           "sm_count": hw["compute_model"]["sm_count"],
           "split": hashlib.sha256(split.read_bytes()).hexdigest()[:16] if split.is_file() else None}
    if name in kernels.SAME_SILICON:
        out["source"] = fit_config(kernels.SAME_SILICON[name][0], reference_dir, config_root)
    return out


def fit_hardware(name: str, code: str, *, reference_dir: Path | None = None, config_root: Path | None = None) -> dict:
    """The fit of hardware ``name`` as results/fit/{hardware}.json holds it: ``compute_model`` (values and
    provenance, ready for the hardware file), ``fitted`` (the fitted values), ``params`` (every parameter),
    ``errors`` (mean |error| % by kind, fit and held-out rows), ``checks`` (extrapolation), ``rows``, the
    inputs and ``code`` (the fit's code version)."""
    ref = reference_root(reference_dir)
    tables = reference_tables(name)
    hashes, problems = {}, []
    for t in tables:
        try:
            hashes[t] = hashlib.sha256((ref / t).read_bytes()).hexdigest()[:16]
        except FileNotFoundError as exc:
            problems.append(str(exc))
    for line in problems:
        log.warning("reference: %s", line)
    result = kernels.fit_kernels(name, reference_dir, config_root)
    cm = result["compute_model"]
    values = {leaf: kernels._provenance_value(cm, leaf) for leaf in kernels._leaf_names(
        {k: v for k, v in cm.items() if k != "provenance"})}
    fitted = {p: (kernels._provenance_value(cm, p) if p in values else
                  {leaf: v for leaf, v in values.items() if leaf.startswith(p + ".")}) for p in result["fitted"]}
    log.info("%s: fitted %s (fit code %s); mean |error| %s", name, sorted(fitted), code, result["errors"])
    inputs = {"config": fit_config(name, reference_dir, config_root), "reference": hashes,
              "reference_problems": problems}
    return {**result, "code": code, "fitted": fitted, "params": values, "inputs": inputs,
            "split": {"declared": kernels.SPLIT, "listed": str(kernel_data.SPLIT_CSV.relative_to(
                kernel_data.SPLIT_CSV.parents[2]))}}


def stale_fits(code: str, config_root: Path | None = None) -> list[str]:
    """'<file>: why' for each hardware file whose ``compute_model.fitted_by`` names other fit code than
    ``code`` (code_version("fit") today), or other parameters than the fit fits."""
    out = []
    for path in sorted(Path(config_root or CONFIG_ROOT).glob("hardware/*.yaml")):
        by, want = load_hardware(path.stem, root=config_root).compute_model.fitted_by, fitted_parameters(path.stem)
        if tuple(sorted(by.parameters if by else ())) != tuple(sorted(want)):
            out.append(f"{path}: the fit fits {list(want)}; compute_model.fitted_by names {by and list(by.parameters)}")
        elif by and by.code != code:
            out.append(f"{path}: fitted by fit code {by.code}, the fit is now {code}: run `make fit` and copy the "
                       f"compute_model and code of {by.fit} into the file")
    return out
