"""rule validate_search_rankings: echo.sweep.published.run (each measured group searched), its
table and markdown."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.io import atomic_path, write_parquet
    from echo.sweep.published import markdown, run

    table = run(Path(sm.params.work), sm.threads, reference_dir=Path(sm.params.reference),
                config_dir=Path(sm.params.config_dir), calibrate_dir=Path(sm.params.calibrate_dir))
    write_parquet(table, Path(sm.output.table))
    with atomic_path(Path(sm.output.markdown)) as tmp:
        tmp.write_text(markdown(table))


_stage.run(sm, main)
