"""rule plot_sweep: a sweep's heatmap of step times."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import pyarrow.parquet as pq

    from echo.report import plots

    layouts = pq.read_table(sm.input.layouts)
    kept = sum(layouts.column("kept").to_pylist())
    title = (f"Sweep {sm.wildcards.sweep}: {kept} layouts simulated, "
             f"{layouts.num_rows - kept} combinations dropped")
    plots.save(plots.sweep_heatmap(pq.read_table(sm.input.ranking), title), sm.output.heatmap)


_stage.run(sm, main)
