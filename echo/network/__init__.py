"""Network model and the calibrate stage: how long a collective takes on a topology.

- ``NetworkModel`` / ``Estimate``: NCCL-style collective costs (``echo.network.model``, formulas in
  ``echo.network.costs``); ``NetworkModel.concurrent`` shares links between overlapping transfers
  (``echo.network.contention``); ``CollectiveCosts``: what the simulator asks of a network.
- ``run_calibrate(topology, out_dir, logs=None)``: the calibrate stage (``echo.network.calibrate``),
  fitted from nccl-tests logs (``echo.network.nccl_tests``, ``echo.network.fit``) or a local gloo
  benchmark (``echo.network.gloo_bench``), with a bus-bandwidth plot (``echo.network.plots``).
- ``collective_main``: one query, for ``python -m echo collective`` (``echo.network.query``).
"""

from echo.network.calibrate import run_calibrate
from echo.network.model import CollectiveCosts, Estimate, NetworkModel
from echo.network.query import collective_main

__all__ = ["CollectiveCosts", "Estimate", "NetworkModel", "collective_main", "run_calibrate"]
