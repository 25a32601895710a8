# report: one table of the default experiments' summaries (written, and printed for make run).


rule report:
    input:
        summaries=experiment_summaries(EXPERIMENTS),
    output:
        summaries="results/report/summaries.parquet",
    params:
        code=code_version("report"),
    log:
        "logs/report/report.log",
    benchmark:
        "results/benchmarks/report/report.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/report.py"
