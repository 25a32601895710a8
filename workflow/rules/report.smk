# report: the default experiments' summaries as one table (written, and printed for make run), and
# the figures of Snakemake's own report (`snakemake --report report.html`):
#   results/report/step_breakdown.svg, predicted_vs_measured.svg        all experiments
#   results/report/experiments/{workload}/{hardware}/{topology}/        gantt.svg, memory.svg, trace.json
#   results/report/sweeps/{sweep}/heatmap.svg                           the sweeps of config["sweeps"]
# The report rule depends on every figure, so `rule all` makes them and the report finds them.

report: "../report/workflow.rst"


rule plot_experiment:
    input:
        summary="results/simulate/{workload}/{hardware}/{topology}/summary.parquet",
        timeline="results/simulate/{workload}/{hardware}/{topology}/timeline.parquet",
        trace="results/simulate/{workload}/{hardware}/{topology}/trace.json",
        ranks="results/trace/{workload}/ranks.parquet",
    output:
        gantt=report(
            "results/report/experiments/{workload}/{hardware}/{topology}/gantt.svg",
            caption="../report/gantt.rst",
            category="2. Iteration timeline (Gantt)",
            labels={"workload": "{workload}", "hardware": "{hardware}", "topology": "{topology}"},
        ),
        memory=report(
            "results/report/experiments/{workload}/{hardware}/{topology}/memory.svg",
            caption="../report/memory.rst",
            category="3. Memory per rank",
            labels={"workload": "{workload}", "hardware": "{hardware}", "topology": "{topology}"},
        ),
        trace=report(
            "results/report/experiments/{workload}/{hardware}/{topology}/trace.json",
            caption="../report/perfetto.rst",
            category="6. Perfetto traces",
            labels={"workload": "{workload}", "hardware": "{hardware}", "topology": "{topology}"},
        ),
    params:
        memory_gib=hardware_memory,
        code=code_version("report"),
    localrule: True
    log:
        "logs/report/experiments/{workload}/{hardware}/{topology}.log",
    benchmark:
        "results/benchmarks/report/experiments/{workload}/{hardware}/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/plot_experiment.py"


rule plot_overview:
    input:
        summaries=experiment_summaries(EXPERIMENTS),
        timelines=[s.replace("summary.parquet", "timeline.parquet") for s in experiment_summaries(EXPERIMENTS)],
    output:
        breakdown=report(
            "results/report/step_breakdown.svg",
            caption="../report/breakdown.rst",
            category="1. Step-time breakdown",
            labels={"figure": "all experiments"},
        ),
        validation=report(
            "results/report/predicted_vs_measured.svg",
            caption="../report/validation.rst",
            category="4. Predicted vs measured",
            labels={"figure": "all measurements"},
        ),
    params:
        measurements=measurements,
        code=code_version("report"),
    localrule: True
    log:
        "logs/report/overview.log",
    benchmark:
        "results/benchmarks/report/overview.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/plot_overview.py"


rule plot_sweep:
    input:
        ranking="results/sweep/{sweep}/ranking.parquet",
        layouts="results/sweep/{sweep}/layouts.parquet",
    output:
        heatmap=report(
            "results/report/sweeps/{sweep}/heatmap.svg",
            caption="../report/sweep.rst",
            category="5. Sweeps",
            labels={"sweep": "{sweep}"},
        ),
    params:
        code=code_version("report"),
    localrule: True
    log:
        "logs/report/sweeps/{sweep}.log",
    benchmark:
        "results/benchmarks/report/sweeps/{sweep}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/plot_sweep.py"


rule report:
    input:
        summaries=experiment_summaries(EXPERIMENTS),
        figures=experiment_figures(EXPERIMENTS)
        + sweep_figures(SWEEPS)
        + ["results/report/step_breakdown.svg", "results/report/predicted_vs_measured.svg"],
    output:
        summaries="results/report/summaries.parquet",
    params:
        code=code_version("report"),
    log:
        "logs/report/report.log",
    benchmark:
        "results/benchmarks/report/report.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/report.py"
