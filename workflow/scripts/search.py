"""rule search: every layout of a sweep file ranked from composed graphs (echo.sweep.search)."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from pathlib import Path

    from echo.sweep.search import run_search

    res = run_search(sm.wildcards.search, Path(sm.output.ranking).parent, processes=sm.threads,
                     cache_dir=Path(sm.params.templates))
    line = (f"search {sm.wildcards.search}: {res['kept']} layouts ranked ({res['fit']} fit) in {res['wall_s']:.0f} s; "
            f"best: {', '.join(r['tokens'] for r in res['best'])}")
    print(line)
    print(line, file=_stage.terminal_out, flush=True)


_stage.run(sm, main)
