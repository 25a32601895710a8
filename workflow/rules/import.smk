# import_kineto: a real job's GPU profiler (Kineto) traces, read and checked against {hardware}'s
# model. The job's traces are dropped at imports/gpu/{job}/ (one file per rank, .json or .json.gz)
# or imports/gpu/{job}.json(.gz); results/import/{job}/{hardware}/ gets every GPU kernel with its
# op, shapes, collective, step and stream (activity.parquet), the streams' busy and idle time per
# step, the model's error per op class on the measured kernels (model_error.parquet) and the share
# of GPU kernel time matched (import.json; the log says it as "matched 93.4% of GPU time"). Only
# asked for by path (`snakemake results/import/JOB/HARDWARE/import.json`), never by rule all.

from echo.profile.gpu_import import dropped_in_job, rank_files


rule import_kineto:
    input:
        validated("hardware"),
        traces=lambda wc: [str(p) for p in rank_files(dropped_in_job(wc.job))],
    output:
        activity=paths.IMPORT("activity.parquet"),
        streams=paths.IMPORT("streams.parquet"),
        model_error=paths.IMPORT("model_error.parquet"),
        summary=paths.IMPORT("import.json"),
    params:
        hardware=hardware_params,
        code=code_version("profile"),
    threads: 1
    log:
        "logs/import/{job}/{hardware}.log",
    benchmark:
        "results/benchmarks/import/{job}/{hardware}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/import_kineto.py"


# fit_overlay: the hardware profile overlay of one imported job (echo.profile.overlay): its
# isolated kernels' measured / modelled ratio per shape regime, fitted on a declared split (one
# shape in four held out, by hash) with the held-out error in the file. Only asked for by path;
# copy the result to imports/overlay/{hardware}.json for the profile rule to use it.
rule fit_overlay:
    input:
        model_error=paths.IMPORT("model_error.parquet"),
    output:
        overlay=paths.OVERLAY("{hardware}.json"),
    params:
        code=code_version("profile"),
    threads: 1
    log:
        "logs/fit_overlay/{job}/{hardware}.log",
    benchmark:
        "results/benchmarks/fit_overlay/{job}/{hardware}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/fit_overlay.py"
