# report: the default experiments' summaries as one table (written, and printed for make run), and
# the figures of Snakemake's own report (`snakemake --report report.html`):
#   results/report/step_breakdown.svg, predicted_vs_measured.svg        all experiments
#   results/report/experiments/{workload}/{hardware}/{topology}/        gantt.svg, memory.svg, trace.json
#   results/report/sweeps/{sweep}/heatmap.svg                           the sweeps of config["sweeps"]
#   results/report/searches/{search}/time_to_train.svg                  the searches of config["searches"]
#   results/plan/{workload}/{hardware}/{topology}/plan.parquet          each experiment's run (config["plan"]):
#       interruptions, goodput, time to train, GPU-hours, cost, energy; summaries.parquet gains them
# The report rule depends on every figure, so `rule all` makes them and the report finds them.

report: "../report/workflow.rst"


rule plot_experiment:
    input:
        summary=paths.SIMULATE("summary.parquet"),
        timeline=paths.SIMULATE("timeline.parquet"),
        trace=paths.SIMULATE("trace.json"),
        ranks=paths.TRACE("ranks.parquet"),
    output:
        gantt=report(
            paths.EXPERIMENT_FIGURES("gantt.svg"),
            caption="../report/gantt.rst",
            category="2. Iteration timeline (Gantt)",
            labels={"workload": "{workload}", "hardware": "{hardware}", "topology": "{topology}"},
        ),
        memory=report(
            paths.EXPERIMENT_FIGURES("memory.svg"),
            caption="../report/memory.rst",
            category="3. Memory per rank",
            labels={"workload": "{workload}", "hardware": "{hardware}", "topology": "{topology}"},
        ),
        trace=report(
            paths.EXPERIMENT_FIGURES("trace.json"),
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
        summaries=paths.simulated(EXPERIMENTS, "summary.parquet"),
        timelines=paths.simulated(EXPERIMENTS, "timeline.parquet"),
    output:
        breakdown=report(
            paths.REPORT("step_breakdown.svg"),
            caption="../report/breakdown.rst",
            category="1. Step-time breakdown",
            labels={"figure": "all experiments"},
        ),
        validation=report(
            paths.REPORT("predicted_vs_measured.svg"),
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
        ranking=paths.SWEEP("ranking.parquet"),
        layouts=paths.SWEEP("layouts.parquet"),
    output:
        heatmap=report(
            paths.SWEEP_FIGURES("heatmap.svg"),
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


rule plan_experiment:
    input:
        summary=paths.SIMULATE("summary.parquet"),
    output:
        plan=paths.PLAN("plan.parquet"),
    params:
        workload=workload_params,
        hardware=hardware_params,
        topology=topology_params,
        site=site_params(PLAN.site),
        tokens=PLAN.tokens,
        code=code_version("report"),
    localrule: True
    log:
        "logs/plan/{workload}/{hardware}/{topology}.log",
    benchmark:
        "results/benchmarks/plan/{workload}/{hardware}/{topology}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/plan.py"


rule plot_time_to_train:
    input:
        ranking=paths.SEARCH("ranking.parquet"),
    output:
        table=paths.SEARCH("time_to_train.parquet"),
        figure=report(
            paths.SEARCH_FIGURES("time_to_train.svg"),
            caption="../report/time_to_train.rst",
            category="7. Time to train",
            labels={"search": "{search}"},
        ),
    params:
        search=search_params,
        site=site_params(PLAN.site),
        tokens=PLAN.tokens,
        code=code_version("report"),
    localrule: True
    log:
        "logs/report/searches/{search}.log",
    benchmark:
        "results/benchmarks/report/searches/{search}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/plot_time_to_train.py"


rule report:
    input:
        summaries=paths.simulated(EXPERIMENTS, "summary.parquet"),
        plans=paths.planned(EXPERIMENTS),
        figures=paths.experiment_figures(EXPERIMENTS)
        + paths.sweep_figures(SWEEPS)
        + paths.search_figures(SEARCHES)
        + [paths.REPORT("step_breakdown.svg"), paths.REPORT("predicted_vs_measured.svg")],
    output:
        summaries=paths.REPORT("summaries.parquet"),
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
