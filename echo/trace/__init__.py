"""trace: run each distinct rank's real training step under fake tensors and a fake process group."""

from echo.trace.runner import check_traceable, run_trace, trace_ranks

__all__ = ["check_traceable", "run_trace", "trace_ranks"]
