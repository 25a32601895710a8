"""rule sweep_rank: a sweep's layouts ranked by step time among those that fit in memory
(written, and the best printed on the terminal)."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import pyarrow.parquet as pq

    from echo.io import write_parquet
    from echo.report.audit import render_table
    from echo.sweep import RANKING, ranking_table

    ranking = ranking_table(pq.read_table(sm.input.layouts), list(sm.input.summaries))
    write_parquet(ranking, sm.output.ranking, RANKING)
    shown = ["rank", "tokens", "topology", "step_time_s", "mfu", "peak_mem_gib", "fits"]
    text = render_table(ranking.select(shown), title=f"sweep {sm.wildcards.sweep}: layouts by step time")
    print(text)
    print(text, file=_stage.terminal_out, flush=True)


_stage.run(sm, main)
