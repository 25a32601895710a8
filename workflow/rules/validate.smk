# validate: predictions against reality.
#   compare         results/validate/{workload}/{hardware}/{topology}/compare.parquet
#                   a real run on this machine (rule measure) next to its prediction
#   validate_local  results/validate/local.parquet        the local layouts' step-time errors
#   validate        results/validate/published.parquet    published cluster measurements (+ .png)
#   validate_errors results/validate/errors.md            the tables of errors (for the README)
# `make validate` asks for errors.md, which needs all of them.

from echo.validate.published import SOURCES
from echo.validate.targets import LOCAL_TARGET, measured_here, validate_targets

# config["validate"] (optional): local, published, reference_dir (echo.validate.targets)
LOCAL_VALIDATION, PUBLISHED_ROWS, REFERENCE = validate_targets(config.get("validate"))


rule compare:
    input:
        validated("workload", "hardware", "topology"),
        lambda w: measured_here(hardware_config(w.hardware), topology_config(w.topology), CONFIG_DIR),
        measured="results/measure/{workload}/measured.parquet",
        phases="results/measure/{workload}/phases.parquet",
        summary="results/simulate/{workload}/{hardware}/{topology}/summary.parquet",
        timeline="results/simulate/{workload}/{hardware}/{topology}/timeline.parquet",
    output:
        compare="results/validate/{workload}/{hardware}/{topology}/compare.parquet",
    params:
        code=code_version("validate"),
    log:
        "logs/validate/compare/{workload}/{hardware}/{topology}.log",
    benchmark:
        "results/benchmarks/validate/compare/{workload}/{hardware}/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/compare.py"


rule validate_local:
    input:
        compares=[f"results/validate/{w}/{LOCAL_TARGET[0]}/{LOCAL_TARGET[1]}/compare.parquet" for w in LOCAL_VALIDATION],
        measured=[f"results/measure/{w}/measured.parquet" for w in LOCAL_VALIDATION],
    output:
        table="results/validate/local.parquet",
    params:
        code=code_version("validate"),
    log:
        "logs/validate/local.log",
    benchmark:
        "results/benchmarks/validate/local.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/validate_local.py"


rule validate:
    input:
        references=[REFERENCE / s.file for s in SOURCES],
        summaries=[f"results/simulate/{r.name}/{r.hardware}/{r.topology}/summary.parquet" for r in PUBLISHED_ROWS],
    output:
        table="results/validate/published.parquet",
        plot="results/validate/published.png",
    params:
        rows=[r.name for r in PUBLISHED_ROWS],
        reference=lambda w, input: str(Path(input.references[0]).parent),
        code=code_version("validate"),
    log:
        "logs/validate/published.log",
    benchmark:
        "results/benchmarks/validate/published.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/validate.py"


rule validate_errors:
    input:
        local="results/validate/local.parquet",
        published="results/validate/published.parquet",
    output:
        markdown="results/validate/errors.md",
    params:
        code=code_version("validate"),
    log:
        "logs/validate/errors.log",
    benchmark:
        "results/benchmarks/validate/errors.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/validate_errors.py"
