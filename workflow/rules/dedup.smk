# dedup: which ranks run the same graph? One row per rank of the job: its class and the traced
# representative whose graph it shares.


rule dedup:
    input:
        validated("workload"),
        **paths.trace_tables(),
    output:
        rank_classes=paths.DEDUP("rank_classes.parquet"),
    params:
        workload=trace_workload_params,
        code=code_version("dedup"),
    log:
        "logs/dedup/{workload}.log",
    benchmark:
        "results/benchmarks/dedup/{workload}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/dedup.py"
