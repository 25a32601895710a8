"""rule report: the default experiments' summaries, as one table (written and printed)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.io import write_parquet
    from echo.report.audit import summaries, summaries_table

    paths = [Path(p) for p in sm.input.summaries]
    write_parquet(summaries(paths), sm.output.summaries)
    text = summaries_table(paths)
    print(text)  # into the log
    print(text, file=_stage.terminal_out, flush=True)  # and on the terminal


_stage.run(sm, main)
