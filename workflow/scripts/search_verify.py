"""rule search_verify: sampled ranks of a search traced in full and compared with their composed
graphs (echo.sweep.search_jobs.verify_composition); a difference fails the job, naming the layout."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import tempfile
    from pathlib import Path

    import pyarrow as pa

    from echo.io import write_parquet
    from echo.sweep.search import VERIFY, make_plan, verify_composition

    plan = make_plan(sm.wildcards.search)
    out = Path(sm.output.verify)
    with tempfile.TemporaryDirectory(prefix=".verify-", dir=out.parent) as work:
        checks = verify_composition(plan.composed, out.parent / "templates", plan.exp.sweep.verify, Path(work),
                                    sm.threads)
    write_parquet(pa.Table.from_pylist(checks, schema=VERIFY), out, VERIFY)


_stage.run(sm, main)
