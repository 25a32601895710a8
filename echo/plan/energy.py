"""GPU-hours, cost and energy of a run.

Energy follows the board power at the simulated utilization: a GPU draws its idle power plus the
span to its board limit (TDP) in proportion to the share of the step its kernels run (the
simulated compute time over the step time: exposed communication and the pipeline bubble run
near idle), and idle power while the job restarts and reloads. Each host adds what it draws
besides its GPUs, the building multiplies all of it by its PUE. The linear interpolation is an
assumption (a GEMM-bound step runs at the power limit, a GPU waiting on NCCL well below it);
it is said in every plan's provenance.
"""

from __future__ import annotations

from echo.config.hardware import GpuPower


def gpu_power_w(power: GpuPower, busy: float) -> float:
    """One GPU's mean draw, W, when its kernels run ``busy`` (0..1) of the time."""
    if not 0.0 <= busy <= 1.0:
        raise ValueError(f"busy share must be within [0, 1], got {busy}")
    idle, tdp = power.idle_w.value, power.tdp_w.value
    return idle + (tdp - idle) * busy


def energy_mwh(gpus: int, hosts: int, training_h: float, down_h: float, power: GpuPower, busy: float,
               host_overhead_w: float, pue: float) -> float:
    """Facility energy, MWh: GPUs at their training draw for ``training_h`` and idle for ``down_h``
    (restarts, reloads), hosts' overhead throughout, times the PUE."""
    gpu_wh = gpus * (gpu_power_w(power, busy) * training_h + power.idle_w.value * down_h)
    host_wh = hosts * host_overhead_w * (training_h + down_h)
    return (gpu_wh + host_wh) * pue / 1e6
