"""rule validate_local: echo.validate.report.run_local(compare_paths, measured_paths, out_path)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.validate.report import run_local

    run_local([Path(p) for p in sm.input.compares], [Path(p) for p in sm.input.measured], Path(sm.output.table))


_stage.run(sm, main)
