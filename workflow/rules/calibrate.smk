# calibrate: how long does a collective of n bytes over a group of this shape take on
# {topology}? Fit from measurements (nccl-tests logs the topology names, or a local gloo
# benchmark) or from the nominal figures. The logs are inputs, so a changed log re-runs this;
# they are resolved against the working directory and its parent (shared/ beside the checkout),
# and a missing one fails while the DAG is built, naming the topology file and key.

from echo.network.nccl_tests import resolve_logs


rule calibrate:
    input:
        validated("topology"),
        logs=lambda wildcards: [
            str(p)
            for p in resolve_logs(
                topology_config(wildcards.topology).calibration.logs,
                config_path("topology", wildcards.topology, CONFIG_DIR),
                root=Path.cwd(),
            )
        ],
    output:
        collectives="results/calibrate/{topology}/collectives.parquet",
        network="results/calibrate/{topology}/network.json",
        measurements="results/calibrate/{topology}/measurements.parquet",
        plot="results/calibrate/{topology}/busbw.png",
    params:
        topology=topology_params,
        priority=calibrate_priority,
        code=code_version("calibrate"),
    threads: calibrate_threads
    log:
        "logs/calibrate/{topology}.log",
    benchmark:
        "results/benchmarks/calibrate/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/calibrate.py"
