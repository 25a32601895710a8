"""simulate: compose classes, the pipeline schedule, streams and collectives into one step.

Two levels (docs/DESIGN.md, "Scale"): costing.py prices a traced rank's ops (kernel times, the
network's ``CollectiveCosts``) into task programs, program.py holds a program's ops and replays
it on a device (gpu.py: streams, overlap slowdown, link sharing), overlaps.py adds the overlaps
the trace does not record (Megatron's grad-reduce / param-gather / TP-comm flags); engine.py runs
the tasks through the schedule (echo.training.schedule) across pipeline stages, one timeline per
stage whatever the world size (symmetric mode); full.py runs every rank with collectives as
rendezvous (full mode, for small jobs and to check symmetric mode). summary.py accounts for time,
FLOPs and memory, perfetto.py writes the timeline, schedule_table.py the schedule's p2p order,
stage.py is the stage entry point.
"""

from echo.simulate.costing import MissingKernelError, OpContext, reduce_rank
from echo.simulate.engine import EngineOptions, EngineResult, Event, StageTimes, simulate
from echo.simulate.full import RankSpec, Relabel, simulate_full
from echo.simulate.gpu import Flow, Gpu, fair_share, max_min_share, no_sharing
from echo.simulate.overlaps import with_buckets, with_param_gather, with_tp_overlap
from echo.simulate.program import Op, Program, RankCosts, TaskCost, simulate_ops
from echo.simulate.stage import run_simulate
from echo.simulate.summary import ClassInfo, summary_table

__all__ = ["ClassInfo", "EngineOptions", "EngineResult", "Event", "Flow", "Gpu", "MissingKernelError", "Op",
           "OpContext", "Program", "RankCosts", "RankSpec", "Relabel", "StageTimes", "TaskCost", "fair_share",
           "max_min_share", "no_sharing", "reduce_rank", "run_simulate", "simulate", "simulate_full",
           "simulate_ops", "summary_table", "with_buckets", "with_param_gather", "with_tp_overlap"]
