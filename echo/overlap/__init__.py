"""overlap: how much compute slows while communication runs on the same device.

- ``slowdown_table(hardware, measured=None)`` -> ``Slowdown`` (s per op class, with provenance):
  what the simulator applies (``echo.overlap.table``).
- ``run_overlap(hardware, out_path)``: the ``overlap`` rule's stage, measuring this machine
  (``echo.overlap.measure``; only for ``kind: cpu`` hardware, the local device).
"""

from __future__ import annotations

import logging
from pathlib import Path

from echo import versioning
from echo.overlap.table import OP_CLASSES, PUBLISHED, SLOWDOWN, Slowdown, read_measured, slowdown_table

log = logging.getLogger(__name__)

# The overlap rule's code version (params: code=code_version("overlap")) covers this package.
# TODO(lead): move this entry into echo.versioning.STAGE_MODULES; setdefault keeps it harmless.
versioning.STAGE_MODULES.setdefault("overlap", ("echo.overlap", "echo.config"))


def run_overlap(hardware, out_path: Path) -> None:
    """Measure the overlap slowdown of this machine (``hardware.kind`` must be cpu) into
    ``out_path`` (SLOWDOWN rows, one per op class)."""
    import importlib

    from echo.errors import ConfigError
    from echo.io import write_parquet

    # by name: the simulate stage imports this package for the table, and its code version
    # (which follows import statements) need not change with the measurement's code
    measure_slowdown = importlib.import_module("echo.overlap.measure").measure_slowdown

    if hardware.kind != "cpu":
        raise ConfigError(f"config/hardware/{hardware.name}.yaml", "kind",
                          "the overlap slowdown is measured on this machine only (kind: cpu); GPUs use "
                          "echo.overlap.table.GPU_TABLE")
    table = measure_slowdown()
    write_parquet(table, out_path, SLOWDOWN)
    for row in table.to_pylist():
        log.info("overlap %-13s %-36s alone %9.1f us, beside %s %9.1f us: s = %.3f", row["op_class"],
                 row["kernel"], row["alone_us"], row["comm_op"], row["overlapped_us"], row["slowdown"])


__all__ = ["OP_CLASSES", "PUBLISHED", "SLOWDOWN", "Slowdown", "read_measured", "run_overlap", "slowdown_table"]
