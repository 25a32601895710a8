"""rule report: the default experiments' summaries and their plans, as one table (written), the
summaries printed."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.io import write_parquet
    from echo.report.audit import summaries, summaries_table, with_plans

    paths = [Path(p) for p in sm.input.summaries]
    # each experiment's run as config["plan"] sets it (rule plan_experiment), beside its step
    write_parquet(with_plans(summaries(paths), list(sm.input.plans)), sm.output.summaries)
    text = summaries_table(paths)
    print(text)  # into the log
    print(text, file=_stage.terminal_out, flush=True)  # and on the terminal


_stage.run(sm, main)
