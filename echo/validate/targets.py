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
from echo.validate.published import REFERENCE_DIR, SOURCES, Row, published_rows

# the three tiny layouts of the acceptance check, then the other small layouts
DEFAULT_LOCAL = ["tiny-dp2", "tiny-tp2", "tiny-pp2", "tiny-dp2-zero1", "tiny-dp2-recompute",
                 "tiny-pp2-interleaved", "tiny-tp2pp2"]
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


def validate_targets(cfg: dict | None) -> tuple[list[str], list[Row], Path]:
    """config["validate"] -> (workloads measured here and compared on local-cpu/local-gloo, the
    published rows to simulate, the reference folder). Keys: ``local`` (default the three tiny
    workloads), ``published`` (true: every row of both tables, the default; or a list of
    workload names), ``reference_dir`` (default ../shared/reference next to the repository)."""
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - {"local", "published", "reference_dir"})
    if unknown:
        raise ConfigError("config/config.yaml", f"validate.{unknown[0]}",
                          "unknown key; allowed: local, published, reference_dir")
    local = cfg.get("local", DEFAULT_LOCAL)
    if not isinstance(local, list) or not all(isinstance(w, str) for w in local):
        raise ConfigError("config/config.yaml", "validate.local", f"expected a list of workload names, got {local!r}")
    reference = Path(cfg.get("reference_dir") or REFERENCE_DIR)
    # without the reference tables (a checkout without ../shared) there is nothing to simulate;
    # the validate rule still names the tables as inputs, so asking for it says what is missing
    present = all((reference / s.file).is_file() for s in SOURCES)
    rows = published_rows(reference) if present else []
    chosen = cfg.get("published", True)
    if chosen is not True:
        if not isinstance(chosen, list):
            raise ConfigError("config/config.yaml", "validate.published", f"expected true or a list, got {chosen!r}")
        names = {r.name for r in rows}
        bad = [n for n in chosen if n not in names]
        if bad:
            raise ConfigError("config/config.yaml", "validate.published", f"no published row named {bad[0]}")
        rows = [r for r in rows if r.name in chosen]
    return local, rows, reference
