# search: a sweep file's layouts by the thousand (echo/sweep/search.py, search_jobs.py), as jobs
# that spread over --cores N and over SLURM nodes alike: one per block signature (its template
# jobs: small jobs of the layouts' blocks, traced once and labelled block by block), the composition checks (sampled
# ranks traced in full and compared; a difference fails the search before any shard runs), one per
# shard of layouts (each rank composed from the templates, costed and simulated on every topology)
# and the ranking. The plan (which template jobs, which shards) follows from the search file alone.
#   results/search/{search}/templates/{signature}/{stages}x{depth}/   a template job's labelled trace
# (one machine: `python -m echo search` runs the same steps in one process, without the jobs' start-up)
#   results/search/{search}/verify.parquet     the sampled ranks compared with their full traces
#   results/search/{search}/shards/{k}.parquet  shard k's summary rows (layout x topology)
#   results/search/{search}/layouts.parquet    every combination: kept, or dropped with key and reason
#   results/search/{search}/ranking.parquet    kept layouts x topologies by step time, those that fit first
#   results/search/{search}/pareto.parquet     the fronts of step time against memory and GPU count


wildcard_constraints:
    signature="[0-9a-f]{16}",
    shard="[0-9]+",


rule search_template:
    output:
        directory(paths.SEARCH("templates/{signature}")),
    params:
        jobs=search_template_params,
        code=code_version("search"),
    threads: workflow.cores
    log:
        "logs/search/{search}/templates/{signature}.log",
    benchmark:
        "results/benchmarks/search/{search}/templates/{signature}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/search_template.py"


rule search_verify:
    input:
        search_templates,
    output:
        verify=paths.SEARCH("verify.parquet"),
    params:
        search=search_params,
        code=code_version("search"),
    threads: workflow.cores
    log:
        "logs/search/{search}/verify.log",
    benchmark:
        "results/benchmarks/search/{search}/verify.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/search_verify.py"


rule search_shard:
    input:
        unpack(search_shard_inputs),
    output:
        rows=paths.SEARCH("shards/{shard}.parquet"),
    params:
        search=search_params,
        code=code_version("search"),
    threads: workflow.cores
    log:
        "logs/search/{search}/shards/{shard}.log",
    benchmark:
        "results/benchmarks/search/{search}/shards/{shard}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/search_shard.py"


rule search:
    input:
        shards=search_shards,
        verify=paths.SEARCH("verify.parquet"),
    output:
        layouts=paths.SEARCH("layouts.parquet"),
        ranking=paths.SEARCH("ranking.parquet"),
        pareto=paths.SEARCH("pareto.parquet"),
        fronts=multiext(paths.SEARCH("front_"), "memory.svg", "gpus.svg"),
    params:
        search=search_params,
        code=code_version("search"),
    localrule: True
    log:
        "logs/search/{search}/rank.log",
    benchmark:
        "results/benchmarks/search/{search}/rank.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/search.py"
