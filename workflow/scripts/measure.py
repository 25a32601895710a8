"""rule measure: echo.validate.run_measure(workload, out_dir, **settings)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Workload
    from echo.validate import run_measure

    run_measure(Workload.model_validate(sm.params.workload), Path(sm.output.measured).parent, **sm.params.run)


_stage.run(sm, main)
