# fit: the compute-model parameters of {hardware} fitted to published measurements (echo.fit).
# results/fit/{hardware}.json holds the fitted values, which reference rows were fitted and which
# held out, the inputs and the fit's code version. Only asked for by path or by `make fit`, never
# by rule all: it needs the reference folder (echo.reference). The values go into the hardware
# file with compute_model.fitted_by naming this fit and its code version (tests/test_fit.py fails
# while a file's recorded code version is not today's).

from echo.fit import fit_config, reference_tables
from echo.reference import reference_root

FIT_REFERENCE = reference_root(SETTINGS.validation.reference_dir)


rule fit:
    input:
        validated("hardware"),
        # the reference tables it reproduces (a hardware without a fit fails here)
        reference=lambda wc: [str(FIT_REFERENCE / t) for t in reference_tables(wc.hardware)],
    output:
        fit=paths.fit(),
    params:
        config=lambda wildcards: fit_config(wildcards.hardware, FIT_REFERENCE, CONFIG_DIR),
        reference=str(FIT_REFERENCE),
        code=code_version("fit"),
    threads: 1
    log:
        "logs/fit/{hardware}.log",
    benchmark:
        "results/benchmarks/fit/{hardware}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/fit.py"
