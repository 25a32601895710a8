# overlap: how much does compute slow while communication runs on the same device? Measured on
# this machine (hardware of kind cpu) by timing kernels of every op class with and without
# concurrent gloo all-reduce traffic; GPUs take published figures from echo/overlap/table.py and
# need no job. The simulate rule reads the measurement for cpu hardware.


rule overlap:
    input:
        validated("hardware"),
    output:
        slowdown=paths.OVERLAP("slowdown.parquet"),
    params:
        device=overlap_device,
        code=code_version("overlap"),
    # both cores: the measurement is of contention, so nothing else may run beside it
    threads: 2
    log:
        "logs/overlap/{hardware}.log",
    benchmark:
        "results/benchmarks/overlap/{hardware}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/overlap.py"
