"""rule search: a search's shards ranked, its fronts and figures (echo.sweep.search.finish)."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from pathlib import Path

    import pyarrow.parquet as pq

    from echo.config import Hardware
    from echo.sweep.search import finish, make_plan

    plan = make_plan(sm.wildcards.search)
    rows = [r for f in sm.input.shards for r in pq.read_table(f).to_pylist()]
    checks = pq.read_table(sm.input.verify).to_pylist()
    capacity = Hardware.model_validate(sm.params.search["hardware"]).memory_gib
    res = finish(plan, rows, checks, capacity, Path(sm.output.ranking).parent)
    line = (f"search {sm.wildcards.search}: {res['kept']} layouts ranked ({res['fit']} fit, {res['traced']} traced "
            f"in full); best: {', '.join(r['tokens'] for r in res['best'])}")
    print(line)
    print(line, file=_stage.terminal_out, flush=True)


_stage.run(sm, main)
