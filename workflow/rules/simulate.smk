# simulate: compose the classes, the schedule, streams, collectives and the overlap slowdown into
# one iteration's timeline on {hardware} GPUs connected by {topology}.
#
# Options (optional, default as below; echo/workflow/settings.py), e.g.
# --config 'simulate={mode: full}':
#   simulate:
#     mode: symmetric           # symmetric (one timeline per pipeline stage) | full (every rank)
#     overlap_grad_reduce: null # gradient buckets overlap the last backward (Megatron-LM's flag);
#                               # null: as the workload's parallel.overlap_grad_reduce (default off)


rule simulate:
    input:
        validated("workload", "hardware", "placement"),
        simulate_mode_checked(SETTINGS.simulate.mode),
        **paths.trace_tables(),
        rank_classes=paths.DEDUP("rank_classes.parquet"),
        kernels=paths.PROFILE("kernels.parquet"),
        collectives=paths.CALIBRATE("collectives.parquet"),
        network=paths.CALIBRATE("network.json"),
        overlap=overlap_input,
    output:
        summary=paths.SIMULATE("summary.parquet"),
        timeline=paths.SIMULATE("timeline.parquet"),
        trace=paths.SIMULATE("trace.json"),
        schedule=paths.SIMULATE("schedule.parquet"),
    params:
        workload=workload_params,
        hardware=hardware_params,
        topology=placed_topology_params,
        options=SETTINGS.simulate.model_dump(),
        code=code_version("simulate"),
    log:
        "logs/simulate/{workload}/{hardware}/{topology}.log",
    benchmark:
        "results/benchmarks/simulate/{workload}/{hardware}/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/simulate.py"
