"""Network model and the calibrate stage: how long a collective takes on a topology.

- ``NetworkModel`` / ``Estimate``: NCCL-style collective costs (``echo.network.model``).
- ``run_calibrate(topology, out_dir)``: the calibrate stage (``echo.network.calibrate``).
- ``collective_main``: one query, for ``python -m echo collective``.
"""

from echo.network.calibrate import run_calibrate
from echo.network.model import Estimate, NetworkModel, collective_main

__all__ = ["Estimate", "NetworkModel", "collective_main", "run_calibrate"]
