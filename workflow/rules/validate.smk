# validate: predictions against reality.
#   compare         results/validate/{workload}/{hardware}/{topology}/compare.parquet
#                   a real run on this machine (rule measure) next to its prediction
#   validate_local  results/validate/local.parquet        the local layouts' step-time errors
#   validate        results/validate/published.parquet    published cluster measurements (+ .png)
#   validate_errors results/validate/errors.md            the tables of errors (for the README)
#   validate_zero_bubble results/validate/zero_bubble.{parquet,md}  the zero-bubble paper's
#                   measured schedules (one trace per model, each row's schedule simulated from it)
#   validate_search_rankings results/validate/search_rankings.{parquet,md}  the search's ranking of
#                   the layouts the zero-bubble paper measured side by side, next to the measured order
# `make validate` asks for errors.md, which needs all of them.

from echo.validate import zero_bubble as zb
from echo.validate.published import SOURCES
from echo.validate.targets import LOCAL_TARGET, measured_here, published_targets

# config["validate"] (optional): local, published, reference_dir (echo/workflow/settings.py)
LOCAL_VALIDATION = SETTINGS.validation.local
PUBLISHED_ROWS, REFERENCE = published_targets(SETTINGS.validation.published, SETTINGS.validation.reference_dir)
LOCAL_RUNS = [(w, *LOCAL_TARGET) for w in LOCAL_VALIDATION]


rule compare:
    input:
        validated("workload", "hardware", "topology"),
        lambda w: measured_here(hardware_config(w.hardware), topology_config(w.topology), CONFIG_DIR),
        measured=paths.MEASURE("measured.parquet"),
        phases=paths.MEASURE("phases.parquet"),
        summary=paths.SIMULATE("summary.parquet"),
        timeline=paths.SIMULATE("timeline.parquet"),
    output:
        compare=paths.COMPARE("compare.parquet"),
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
        compares=[paths.COMPARE("compare.parquet", workload=w, hardware=h, topology=t) for w, h, t in LOCAL_RUNS],
        measured=[paths.MEASURE("measured.parquet", workload=w) for w in LOCAL_VALIDATION],
    output:
        table=paths.VALIDATE("local.parquet"),
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
        summaries=paths.simulated([(r.name, r.hardware, r.topology) for r in PUBLISHED_ROWS], "summary.parquet"),
    output:
        table=paths.VALIDATE("published.parquet"),
        plot=paths.VALIDATE("published.png"),
        plot_by_layout=paths.VALIDATE("published_by_layout.png"),  # run_validate: <plot stem>_by_layout.png
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
        local=paths.VALIDATE("local.parquet"),
        published=paths.VALIDATE("published.parquet"),
    output:
        markdown=paths.VALIDATE("errors.md"),
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


ZB_WORKLOADS = zb.workload_names(CONFIG_DIR)


rule validate_zero_bubble:
    input:
        references=[REFERENCE / zb.THROUGHPUT, REFERENCE / zb.MODELS],
        ops=[paths.TRACE("ops.parquet", workload=w) for w in ZB_WORKLOADS],
        rank_classes=[paths.DEDUP("rank_classes.parquet", workload=w) for w in ZB_WORKLOADS],
        kernels=[paths.PROFILE("kernels.parquet", workload=w, hardware=zb.HARDWARE) for w in ZB_WORKLOADS],
        network=paths.CALIBRATE("network.json", topology=zb.TOPOLOGY),
        summaries=paths.simulated([(w, zb.HARDWARE, zb.TOPOLOGY) for w in ZB_WORKLOADS], "summary.parquet"),
    output:
        table=paths.VALIDATE("zero_bubble.parquet"),
        markdown=paths.VALIDATE("zero_bubble.md"),
    params:
        workloads=[workload_config(w).model_dump() for w in ZB_WORKLOADS],
        hardware=hardware_config(zb.HARDWARE).model_dump(),
        topology=topology_config(zb.TOPOLOGY).model_dump(),
        reference=lambda w, input: str(Path(input.references[0]).parent),
        code=code_version("validate"),
    log:
        "logs/validate/zero_bubble.log",
    benchmark:
        "results/benchmarks/validate/zero_bubble.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/validate_zero_bubble.py"


rule validate_search_rankings:
    input:
        references=[REFERENCE / zb.THROUGHPUT, REFERENCE / zb.MODELS],
        collectives=paths.CALIBRATE("collectives.parquet", topology=zb.TOPOLOGY),
        workloads=[CONFIG_DIR / "workloads" / f"{w}.yaml" for w in ZB_WORKLOADS],
    output:
        table=paths.VALIDATE("search_rankings.parquet"),
        markdown=paths.VALIDATE("search_rankings.md"),
    params:
        reference=lambda w, input: str(Path(input.references[0]).parent),
        config_dir=lambda w, input: str(Path(input.workloads[0]).parent.parent),
        calibrate_dir=lambda w, input: str(Path(input.collectives).parent.parent),
        work=lambda w, output: str(Path(output.table).with_suffix("")),  # specs, searches, templates
        code=code_version("search"),
    threads: workflow.cores
    log:
        "logs/validate/search_rankings.log",
    benchmark:
        "results/benchmarks/validate/search_rankings.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/validate_search_rankings.py"
