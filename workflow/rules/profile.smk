# profile: how long does each distinct kernel of the workload take on {hardware}? Measured on
# this machine for a cpu hardware file, modelled (roofline + calibrated efficiency) for a GPU.


rule profile:
    input:
        validated("hardware"),
        ops="results/trace/{workload}/ops.parquet",
        comms="results/trace/{workload}/comms.parquet",
        deps="results/trace/{workload}/deps.parquet",
        ranks="results/trace/{workload}/ranks.parquet",
    output:
        kernels="results/profile/{workload}/{hardware}/kernels.parquet",
    params:
        hardware=hardware_params,
        code=code_version("profile"),
    threads: profile_threads
    log:
        "logs/profile/{workload}/{hardware}.log",
    benchmark:
        "results/benchmarks/profile/{workload}/{hardware}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/profile.py"
