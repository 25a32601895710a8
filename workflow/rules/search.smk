# search: a sweep file's layouts by the thousand (echo/sweep/search.py): each rank composed from
# layer templates traced once (results/templates/, shared by every search), costed and simulated
# in worker processes over the job's cores; a sample of ranks checked against full traces.
#   results/search/{search}/layouts.parquet    every combination: kept, or dropped with key and reason
#   results/search/{search}/ranking.parquet    kept layouts x topologies by step time, those that fit first
#   results/search/{search}/pareto.parquet     the fronts of step time against memory and GPU count
#   results/search/{search}/verify.parquet     the sampled ranks compared with their full traces
# A killed search resumes from results/search/{search}/partial/ (same spec and code).


rule search:
    output:
        layouts=paths.SEARCH("layouts.parquet"),
        ranking=paths.SEARCH("ranking.parquet"),
        pareto=paths.SEARCH("pareto.parquet"),
        verify=paths.SEARCH("verify.parquet"),
        fronts=multiext(paths.SEARCH("front_"), "memory.svg", "gpus.svg"),
    params:
        search=search_params,
        templates=paths.TEMPLATES(""),
        code=code_version("search"),
    threads: workflow.cores
    log:
        "logs/search/{search}.log",
    benchmark:
        "results/benchmarks/search/{search}.tsv"
    conda:
        "../envs/echo.yaml"
    script:
        "../scripts/search.py"
