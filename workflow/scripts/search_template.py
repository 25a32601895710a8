"""rule search_template: the template jobs of one block signature of a search, traced labelled
(echo.trace.template), each into its {stages}x{depth} folder."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from pathlib import Path

    from echo.config.workload import Workload
    from echo.trace.template import run_template_jobs

    jobs = [(Path(sm.output[0]) / shape, Workload.model_validate(job["workload"]), job["ranks"])
            for shape, job in sorted(sm.params.jobs.items())]
    run_template_jobs(jobs, sm.threads)


_stage.run(sm, main)
