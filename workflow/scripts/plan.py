"""rule plan_experiment: echo.plan.plan(workload, hardware, topology, site, summary row, tokens) as
one row (echo.plan.table.plan_record)."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware, Site, Topology, Workload
    from echo.io import read_parquet, write_parquet
    from echo.plan import plan
    from echo.plan.table import plan_record, plan_table

    rows = read_parquet(sm.input.summary).to_pylist()
    if len(rows) != 1:
        raise ValueError(f"{sm.input.summary}: expected one summary row, found {len(rows)}")
    p = plan(Workload.model_validate(sm.params.workload), Hardware.model_validate(sm.params.hardware),
             Topology.model_validate(sm.params.topology), Site.model_validate(sm.params.site), rows[0],
             float(sm.params.tokens))
    write_parquet(plan_table([plan_record(p)]), sm.output.plan)


_stage.run(sm, main)
