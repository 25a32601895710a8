"""rule dedup: echo.dedup.run_dedup(workload, trace_dir, out_path)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Workload
    from echo.dedup import run_dedup

    workload = Workload.model_validate(sm.params.workload)
    run_dedup(workload, Path(sm.input.ops).parent, Path(sm.output.rank_classes))


_stage.run(sm, main)
