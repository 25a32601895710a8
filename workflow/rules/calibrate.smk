# calibrate: how long does a collective of n bytes over a group of this shape take on
# {topology}? Fit from measurements (a local gloo benchmark) or from the nominal figures.


rule calibrate:
    input:
        validated("topology"),
    output:
        collectives="results/calibrate/{topology}/collectives.parquet",
        network="results/calibrate/{topology}/network.json",
    params:
        topology=topology_params,
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
