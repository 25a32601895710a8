"""rule plot_time_to_train: echo.sweep.time_to_train.plan_search over the search's ranking."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.io import read_parquet
    from echo.sweep.time_to_train import plan_search

    # the search, hardware, topologies and site were checked with the DAG (params); the config
    # folder is the workflow's
    plan_search(sm.wildcards.search, read_parquet(sm.input.ranking).to_pylist(), float(sm.params.tokens),
                sm.params.site["name"], sm.output.table, sm.output.figure)


_stage.run(sm, main)
