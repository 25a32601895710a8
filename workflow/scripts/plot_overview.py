"""rule plot_overview: the step-time breakdown of every experiment, and predicted vs measured
step times where measurements exist."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import pyarrow.parquet as pq

    from echo.report import plots
    from echo.report.measured import measurement_points

    summaries = [pq.read_table(p).to_pylist()[0] for p in sm.input.summaries]
    optimizer = [plots.optimizer_seconds(pq.read_table(t), s.get("critical_stage") or 0)
                 for s, t in zip(summaries, sm.input.timelines, strict=True)]
    plots.save(plots.step_breakdown(summaries, optimizer), sm.output.breakdown)
    files = [f for f in sm.params.measurements if Path(f).is_file()]
    points = measurement_points(files, summaries)
    print(f"{len(points)} predicted/measured pairs from {len(files)} files")
    plots.save(plots.predicted_vs_measured(points), sm.output.validation)


_stage.run(sm, main)
