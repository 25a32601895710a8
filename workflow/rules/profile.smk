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
