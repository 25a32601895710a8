# simulate: compose the classes, the schedule, streams, collectives and the overlap slowdown into
# one iteration's timeline on {hardware} GPUs connected by {topology}.
#
# Options (optional, default as below; echo/simulate/workflow.py), e.g.
# --config 'simulate={mode: full}':
#   simulate:
#     mode: symmetric           # symmetric (one timeline per pipeline stage) | full (every rank)
#     overlap_grad_reduce: null # gradient buckets overlap the last backward (Megatron-LM's flag);
#                               # null: as the workload's parallel.overlap_grad_reduce (default off)

from echo.simulate import workflow as simulate_workflow


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
        overlap=lambda w: simulate_workflow.overlap_input(hardware_config(w.hardware)),
    output:
        summary="results/simulate/{workload}/{hardware}/{topology}/summary.parquet",
        timeline="results/simulate/{workload}/{hardware}/{topology}/timeline.parquet",
        trace="results/simulate/{workload}/{hardware}/{topology}/trace.json",
    params:
        workload=workload_params,
        hardware=hardware_params,
        topology=placed_topology_params,
        options=lambda w: simulate_workflow.options(config.get("simulate")),
        code=code_version("simulate"),
    log:
        "logs/simulate/{workload}/{hardware}/{topology}.log",
    benchmark:
        "results/benchmarks/simulate/{workload}/{hardware}/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/simulate.py"
