# trace: run one training step of each distinct rank on this CPU, with fake tensors and a fake
# process group, and record what it computes and communicates.


rule trace:
    input:
        validated("workload"),
    output:
        **paths.trace_tables(),
    params:
        workload=trace_workload_params,
        code=code_version("trace"),
    log:
        "logs/trace/{workload}.log",
    benchmark:
        "results/benchmarks/trace/{workload}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/trace.py"
