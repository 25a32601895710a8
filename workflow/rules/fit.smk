# fit: the compute-model parameters of {hardware} fitted to published measurements (echo.fit).
# results/fit/{hardware}.json holds the fitted values, which reference rows were fitted and which
# held out, the inputs and the fit's code version. Only asked for by path or by `make fit`, never
# by rule all: it needs the reference folder (echo.reference) and, for the H100 step-time fit, the
# traces of the Megatron-Core rows. The values go into the hardware file with
# compute_model.fitted_by naming this fit and its code version (tests/test_fit.py fails while a
# file's recorded code version is not today's).

from echo.fit import fit_config, reference_tables, step_workloads
from echo.fit.step import STEP_HARDWARE, STEP_TOPOLOGY
from echo.reference import reference_root

FIT_REFERENCE = reference_root(SETTINGS.validation.reference_dir)


rule fit:
    input:
        validated("hardware"),
        # the reference tables it reproduces (a hardware without a fit fails here); for the step-time
        # fit, the trace, rank classes and network model of each published row it simulates
        reference=lambda wc: [str(FIT_REFERENCE / t) for t in reference_tables(wc.hardware)],
        ops=lambda wc: [paths.TRACE("ops.parquet", workload=w) for w in step_workloads(wc.hardware, FIT_REFERENCE)],
        rank_classes=lambda wc: [
            paths.DEDUP("rank_classes.parquet", workload=w) for w in step_workloads(wc.hardware, FIT_REFERENCE)
        ],
        network=lambda wc: [paths.CALIBRATE("network.json", topology=STEP_TOPOLOGY)] * (wc.hardware == STEP_HARDWARE),
    output:
        fit=paths.fit(),
    params:
        config=lambda wildcards: fit_config(wildcards.hardware, FIT_REFERENCE, CONFIG_DIR),
        workloads=lambda wildcards: step_workloads(wildcards.hardware, FIT_REFERENCE),
        reference=str(FIT_REFERENCE),
        code=code_version("fit"),
    threads: 2
    log:
        "logs/fit/{hardware}.log",
    benchmark:
        "results/benchmarks/fit/{hardware}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/fit.py"
