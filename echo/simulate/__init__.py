"""simulate: compose classes, the pipeline schedule, streams and collectives into one step.

Two levels (DESIGN.md section 2): chunk.py turns a traced chunk's ops into task programs and
replays them on a device (gpu.py: streams, overlap slowdown, link sharing), overlaps.py adds the
overlaps the trace does not record (Megatron's grad-reduce / param-gather / TP-comm flags); engine.py runs the
tasks through the schedule (schedule.py) across pipeline stages, one timeline per stage whatever
the world size (symmetric mode); full.py runs every rank with collectives as rendezvous (full
mode, for small jobs and to check symmetric mode). summary.py accounts for time, FLOPs and
memory, perfetto.py writes the timeline, stage.py is the stage entry point.

Names are imported on first use (by module name, not by import statements): other stages import
``echo.training.schedule`` (the one definition of the pipeline orders), and their code versions
(echo.versioning follows import statements) should not change with the engine's code.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "chunk": ("MissingKernelError", "Op", "OpContext", "Program", "RankCosts", "TaskCost", "reduce_rank",
              "simulate_ops"),
    "engine": ("EngineOptions", "EngineResult", "Event", "StageTimes", "simulate"),
    "full": ("RankSpec", "Relabel", "simulate_full"),
    "overlaps": ("with_buckets", "with_param_gather", "with_tp_overlap"),
    "gpu": ("Flow", "Gpu", "fair_share", "max_min_share", "no_sharing"),
    "schedule": ("SCHEDULES", "Task", "in_flight", "stage_orders"),
    "stage": ("run_simulate",),
    "summary": ("ClassInfo", "summary_table"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'echo.simulate' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
