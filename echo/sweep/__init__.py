"""sweep: design-space sweeps (config/sweeps/{sweep}.yaml) expanded into layouts, and their ranking."""

from echo.sweep.rank import LAYOUTS, RANKING, best, layouts_table, ranking_table
from echo.sweep.spec import (
    AXES,
    Candidate,
    Expansion,
    Sweep,
    expand,
    expansion,
    is_sweep_name,
    layout_tokens,
    load_sweep,
    shared_trace,
    split_name,
    sweep_workload,
)

__all__ = [
    "AXES", "LAYOUTS", "RANKING", "Candidate", "Expansion", "Sweep", "best", "expand", "expansion", "is_sweep_name",
    "layout_tokens", "layouts_table", "load_sweep", "ranking_table", "shared_trace", "split_name", "sweep_workload",
]
