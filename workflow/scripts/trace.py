"""rule trace: echo.trace.run_trace(workload, out_dir)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Workload
    from echo.trace import run_trace

    workload = Workload.model_validate(sm.params.workload)
    run_trace(workload, Path(sm.output.ops).parent)


_stage.run(sm, main)
