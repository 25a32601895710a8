# measure: train {workload} for real on this machine (one gloo process per rank, the tracer's
# model and layout) and time its steps. A workload too big for this machine is refused, naming
# the file and the reason, while the DAG is built (echo.validate.targets.measurable).
# config["measure"] (optional): warmup, iters, profile, priority (echo/workflow/settings.py).

from echo.validate.targets import measurable


rule measure:
    input:
        validated("workload"),
        lambda w: measurable(workload_config(w.workload)),
    output:
        measured=paths.MEASURE("measured.parquet"),
        phases=paths.MEASURE("phases.parquet"),
        events=paths.MEASURE("events.parquet"),
    params:
        workload=workload_params,
        run=SETTINGS.measure.model_dump(),
        code=code_version("measure"),
    # every core: a timing taken next to another job of this workflow measures that job too
    threads: workflow.cores
    log:
        "logs/measure/{workload}.log",
    benchmark:
        "results/benchmarks/measure/{workload}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/measure.py"
