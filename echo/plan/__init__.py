"""From one simulated step to a whole run: interruptions, checkpoints, goodput, time, cost, energy.

The simulator gives the ideal step (``summary.parquet``); a run of weeks also stops for failed
parts and maintenance, writes checkpoints, restarts and recomputes the work lost since its last
checkpoint. ``plan`` combines the step with a site (``config/sites/``: failure rates, storage,
restart, power and price, each with its provenance) and the GPU's board power:

- reliability.py: the job's interruption rate from per-part rates, the checkpoint interval
  that maximizes the effective training time (Young 1974, Daly 2006) and that time's ratio;
- checkpoint.py: the checkpoint's size from the model and its optimizer state, its save and
  load times;
- energy.py: GPU-hours, cost, and energy from board power at the simulated utilization, host
  overhead and the data centre's PUE;
- planner.py: all of it for a number of tokens (and, optionally, a number of days).
"""

from echo.plan.planner import Plan, plan

__all__ = ["Plan", "plan"]
