"""What the measure and validate rules ask of the config while Snakemake builds the DAG.

Kept here rather than in the rule files (Snakemake's linter wants rule files without function
definitions); each check returns ``[]`` so that it can stand in a rule's ``input:`` as a check
that adds no files.
"""

from __future__ import annotations

from pathlib import Path

from echo.config import Hardware, Topology, Workload
from echo.config.loader import config_path
from echo.errors import ConfigError
from echo.reference import reference_root
from echo.validate.published import SOURCES, Row, published_rows

LOCAL_TARGET = ("local-cpu", "local-gloo")  # hardware and topology of this machine


def measurable(workload: Workload) -> list:
    """Refuses (MeasureRefused) a workload this machine cannot train for real."""
    from echo.validate.measure import check_measurable

    check_measurable(workload)
    return []


def measured_here(hardware: Hardware, topology: Topology, root: Path | None = None) -> list:
    """A real run on this machine is compared only with predictions for this machine: a cpu
    hardware file and a topology calibrated by a gloo benchmark."""
    if hardware.kind != "cpu":
        raise ConfigError(config_path("hardware", hardware.name, root), "kind",
                          "a real run on this machine is compared only with a cpu hardware file (local-cpu)")
    if topology.calibration.source != "gloo_benchmark":
        raise ConfigError(config_path("topology", topology.name, root), "calibration.source",
                          "a real run on this machine is compared only with a gloo-calibrated topology (local-gloo)")
    return []


def published_targets(published: bool | tuple[str, ...] = True,
                      reference_dir: Path | None = None) -> tuple[list[Row], Path]:
    """(the published rows to simulate, the reference folder) of the workflow's settings
    validate.published (true: every row of both tables; or row names) and validate.reference_dir
    (the reference folder, echo.reference)."""
    reference = reference_root(reference_dir)
    # without the reference folder's tables there is nothing to simulate;
    # the validate rule still names the tables as inputs, so asking for it says what is missing
    present = all((reference / s.file).is_file() for s in SOURCES)
    rows = published_rows(reference) if present else []
    if published is not True:
        bad = [n for n in published if n not in {r.name for r in rows}]
        if bad:
            raise ConfigError("config/config.yaml", "validate.published", f"no published row named {bad[0]}")
        rows = [r for r in rows if r.name in published]
    return rows, reference
