"""rule compare: echo.validate.run_compare(measured_dir, simulate_dir, out_path)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.validate import run_compare

    run_compare(Path(sm.input.measured).parent, Path(sm.input.summary).parent, Path(sm.output.compare))


_stage.run(sm, main)
