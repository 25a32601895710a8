# calibrate: how long does a collective of n bytes over a group of this shape take on
# {topology}? Fit from measurements (nccl-tests logs the topology names, or a local gloo
# benchmark) or from the nominal figures. The logs are inputs, so a changed log re-runs this;
# they are named relative to the reference folder (echo.reference; validate.reference_dir or
# $ECHO_REFERENCE), and a missing one fails while the DAG is built, naming the topology file and key.

from echo.network.nccl_tests import resolve_logs
from echo.reference import reference_root


rule calibrate:
    input:
        validated("topology"),
        logs=lambda wildcards: [
            str(p)
            for p in resolve_logs(
                topology_config(wildcards.topology).calibration.logs,
                config_path("topology", wildcards.topology, CONFIG_DIR),
                root=reference_root(SETTINGS.validation.reference_dir),
            )
        ],
    output:
        collectives=paths.CALIBRATE("collectives.parquet"),
        network=paths.CALIBRATE("network.json"),
        measurements=paths.CALIBRATE("measurements.parquet"),
        plot=paths.CALIBRATE("busbw.png"),
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
