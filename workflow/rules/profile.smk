# profile: how long does each distinct kernel of the workload take on {hardware}? Measured on
# this machine for a cpu hardware file (timings cached across workloads in paths.PROFILE_CACHE, so a
# workload times only kernels no earlier one had; scaled to in-loop time by replaying the
# trace's tasks in order; on a host_synchronous device the eager engine's time per op and
# DTensor's dispatch time per call added, and the slowdown of the workload's ranks side by side
# applied, each measured once per CPU and cached there too), modelled (roofline + fitted efficiency)
# for a GPU. A PyTorch profiler (Kineto) Chrome trace of a real run of the workload on that
# hardware, dropped at imports/kineto/{workload}/{hardware}.json (or .json.gz), fills the
# kernels it covers (source = imported); profile.json counts what it could not match. A real
# job's overlay (rule fit_overlay) copied to imports/overlay/{hardware}.json replaces the model's
# time of the kernels it covers on that GPU (source = overlay or model+overlay).

from echo.profile.kineto import dropped_in_trace
from echo.profile.gpu_import import dropped_in_job, rank_files
from echo.profile.overlay import dropped_in_overlay


rule profile:
    input:
        validated("hardware", "numerics"),
        unpack(lambda wc: dropped_in_trace(wc.workload, wc.hardware)),
        unpack(lambda wc: dropped_in_overlay(wc.hardware)),
        **paths.trace_tables(),
    output:
        kernels=paths.PROFILE("kernels.parquet"),
        note=paths.PROFILE("profile.json"),
    params:
        hardware=hardware_params,
        cache_dir=paths.PROFILE_CACHE(),
        ranks_on_host=ranks_on_host,
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


# import_kineto: a real job's GPU profiler (Kineto) traces, read and checked against {hardware}'s
# model. The job's traces are dropped at imports/gpu/{job}/ (one file per rank, .json or .json.gz)
# or imports/gpu/{job}.json(.gz); results/import/{job}/{hardware}/ gets every GPU kernel with its
# op, shapes, collective, step and stream (activity.parquet), the streams' busy and idle time per
# step, the model's error per op class on the measured kernels (model_error.parquet) and the share
# of GPU kernel time matched (import.json; the log says it as "matched 93.4% of GPU time"). Only
# asked for by path (`snakemake results/import/JOB/HARDWARE/import.json`), never by rule all.



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
