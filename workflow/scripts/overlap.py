"""rule overlap: echo.overlap.measure.run_overlap(hardware, out_path) (this machine's overlap slowdown)."""

from pathlib import Path
from types import SimpleNamespace

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.overlap.measure import run_overlap

    run_overlap(SimpleNamespace(**sm.params.device), Path(sm.output.slowdown))


_stage.run(sm, main)
