"""overlap: how much compute slows while communication runs on the same device.

- ``slowdown_table(hardware, measured=None)`` -> ``Slowdown`` (s per op class, with provenance):
  what the simulator applies (``echo.overlap.table``).
- ``echo.overlap.measure.run_overlap(hardware, out_path)``: the ``overlap`` rule's stage,
  measuring this machine (only for ``kind: cpu`` hardware, the local device).
"""

from echo.overlap.table import OP_CLASSES, PUBLISHED, SLOWDOWN, Slowdown, read_measured, slowdown_table

__all__ = ["OP_CLASSES", "PUBLISHED", "SLOWDOWN", "Slowdown", "read_measured", "slowdown_table"]
