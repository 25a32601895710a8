# simulate: compose the classes, the schedule, the streams and the collectives into one
# iteration's timeline on {hardware} GPUs connected by {topology}.


rule simulate:
    input:
        validated("workload", "hardware", "placement"),
        ops="results/trace/{workload}/ops.parquet",
        comms="results/trace/{workload}/comms.parquet",
        deps="results/trace/{workload}/deps.parquet",
        ranks="results/trace/{workload}/ranks.parquet",
        rank_classes="results/dedup/{workload}/rank_classes.parquet",
        kernels="results/profile/{workload}/{hardware}/kernels.parquet",
        collectives="results/calibrate/{topology}/collectives.parquet",
        network="results/calibrate/{topology}/network.json",
    output:
        summary="results/simulate/{workload}/{hardware}/{topology}/summary.parquet",
        timeline="results/simulate/{workload}/{hardware}/{topology}/timeline.parquet",
        trace="results/simulate/{workload}/{hardware}/{topology}/trace.json",
    params:
        workload=workload_params,
        hardware=hardware_params,
        topology=placed_topology_params,
        code=code_version("simulate"),
    log:
        "logs/simulate/{workload}/{hardware}/{topology}.log",
    benchmark:
        "results/benchmarks/simulate/{workload}/{hardware}/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/simulate.py"
