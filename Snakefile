# Echo: simulate one iteration of large-scale distributed training without the cluster.
#
# The pipeline (docs/DESIGN.md, "The pipeline"), one rule file per stage:
#
#   trace     results/trace/{workload}/{ops,comms,deps,ranks}.parquet
#   dedup     results/dedup/{workload}/rank_classes.parquet
#   profile   results/profile/{workload}/{hardware}/kernels.parquet
#   calibrate results/calibrate/{topology}/{collectives.parquet,network.json}
#   simulate  results/simulate/{workload}/{hardware}/{topology}/{summary.parquet,timeline.parquet,trace.json}
#   report    results/report/summaries.parquet (and a printed table), the figures of
#             `snakemake --report report.html` under results/report/
#   sweep     results/sweep/{sweep}/{layouts,ranking}.parquet: config/sweeps/{sweep}.yaml's layouts,
#             workloads named {sweep}--{tokens} that run through the stages above
#   import    results/import/{job}/{hardware}/: a real job's GPU Kineto traces (imports/gpu/{job}/), read
#             and checked against the hardware's model (rules in profile.smk; asked for by path)
#   search    results/search/{search}/{layouts,ranking,pareto,verify}.parquet, front_*.svg: the same
#             kind of file's layouts by the thousand, each rank composed from layer templates:
#             a job per block signature (templates/), the checks, a job per shard (shards/), the ranking
#
# `rule all` runs the default experiments of config/config.yaml; any other combination of
# existing config files is run by asking for its path, e.g.
#   snakemake --cores 2 results/simulate/tiny-tp2/h100-sxm-80gb/dgx-h100-ndr/summary.parquet
# Each rule receives only its own config slice (validated; echo/workflow/params.py) and its stage's
# code version as params, so an edited topology re-runs only that topology's calibrate/simulate/report jobs.

import sys

sys.path.insert(0, workflow.basedir)  # the echo package next to this Snakefile


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/trace.smk"
include: "workflow/rules/dedup.smk"
include: "workflow/rules/profile.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/overlap.smk"
include: "workflow/rules/simulate.smk"
include: "workflow/rules/sweep.smk"
include: "workflow/rules/search.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/fit.smk"


localrules:
    all,
    report,


rule all:
    input:
        paths.simulated(EXPERIMENTS),
        paths.REPORT("summaries.parquet"),
