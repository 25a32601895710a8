"""rule plot_experiment: one experiment's Gantt of one iteration and memory per rank, and its
Perfetto trace.json next to them (for the report)."""

import shutil

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import pyarrow.parquet as pq

    from echo.report import plots

    summary = pq.read_table(sm.input.summary).to_pylist()[0]
    w = sm.wildcards
    title = f"{w.workload} on {summary['world_size']} x {w.hardware} / {w.topology}"
    timeline = pq.read_table(sm.input.timeline)
    step = plots._seconds(summary["step_time_s"])
    plots.save(plots.gantt(timeline, f"One iteration of {title}: step {step}, "
                                     f"{summary.get('schedule', '')} schedule"), sm.output.gantt)
    plots.save(plots.memory(summary, pq.read_table(sm.input.ranks), sm.params.memory_gib, title), sm.output.memory)
    shutil.copyfile(sm.input.trace, sm.output.trace)


_stage.run(sm, main)
