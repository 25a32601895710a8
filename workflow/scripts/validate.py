"""rule validate: echo.validate.published.run_validate(rows, summary_paths, out_path, plot_path)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.validate.published import published_rows, run_validate

    rows = [r for r in published_rows(Path(sm.params.reference)) if r.name in set(sm.params.rows)]
    paths = {Path(p).parents[2].name: Path(p) for p in sm.input.summaries}
    run_validate(rows, paths, Path(sm.output.table), Path(sm.output.plot))


_stage.run(sm, main)
