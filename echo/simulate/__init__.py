"""simulate: compose classes, the pipeline schedule, streams and collectives into one step.

Two levels (DESIGN.md section 2): chunk.py reduces a traced chunk's ops to task durations;
engine.py runs those tasks through the schedule (schedule.py) across pipeline stages, one
timeline per stage whatever the world size. summary.py accounts for time, FLOPs and memory,
perfetto.py writes the timeline, stage.py is the stage entry point.
"""

from echo.simulate.chunk import MissingKernelError, Op, RankCosts, TaskCost, reduce_rank, simulate_ops
from echo.simulate.engine import EngineOptions, EngineResult, Event, StageTimes, simulate
from echo.simulate.schedule import SCHEDULES, Task, in_flight, stage_orders
from echo.simulate.stage import run_simulate
from echo.simulate.summary import ClassInfo, summary_table

__all__ = [
    "SCHEDULES", "ClassInfo", "EngineOptions", "EngineResult", "Event", "MissingKernelError", "Op",
    "RankCosts", "StageTimes", "Task", "TaskCost", "in_flight", "reduce_rank", "run_simulate", "simulate",
    "simulate_ops", "stage_orders", "summary_table",
]
