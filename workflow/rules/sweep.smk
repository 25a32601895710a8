# sweep: a design-space sweep (config/sweeps/{sweep}.yaml) expands into layouts, workloads named
# {sweep}--{tokens} that the common.smk loader resolves from the sweep file, so each one runs
# through the ordinary trace/dedup/profile/simulate rules at results/.../{workload}/... paths.
#   results/sweep/{sweep}/layouts.parquet    every combination of the axes: kept, or dropped with why
#   results/sweep/{sweep}/workloads/*.yaml   the kept layouts as workload files (to read or copy)
#   results/sweep/{sweep}/ranking.parquet    kept layouts x topologies by step time, those that fit first
# Layouts that differ only in what the tracer does not read (the schedule) share one trace,
# {sweep}--trace-{tokens}, traced once and linked under each layout's name (rule sweep_trace).

ruleorder: sweep_trace > trace


rule sweep_trace:
    input:
        unpack(shared_trace_files),
    output:
        **paths.trace_tables(),
    wildcard_constraints:
        workload=LAYOUT_NAME,
    localrule: True
    log:
        "logs/sweep_trace/{workload}.log",
    benchmark:
        "results/benchmarks/sweep_trace/{workload}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/sweep_trace.py"


rule sweep_layouts:
    input:
        sweep_checked,
    output:
        layouts=paths.SWEEP("layouts.parquet"),
        workloads=directory(paths.SWEEP("workloads")),
    params:
        sweep=sweep_params,
        code=code_version("sweep"),
    localrule: True
    log:
        "logs/sweep/{sweep}/layouts.log",
    benchmark:
        "results/benchmarks/sweep/{sweep}/layouts.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/sweep_layouts.py"


rule sweep_rank:
    input:
        layouts=paths.SWEEP("layouts.parquet"),
        summaries=sweep_summaries,
    output:
        ranking=paths.SWEEP("ranking.parquet"),
    params:
        code=code_version("sweep"),
    localrule: True
    log:
        "logs/sweep/{sweep}/rank.log",
    benchmark:
        "results/benchmarks/sweep/{sweep}/rank.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/sweep_rank.py"
