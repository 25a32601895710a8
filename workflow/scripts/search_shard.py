"""rule search_shard: one shard of a search's layouts composed, costed and simulated on every
topology (echo.sweep.search_jobs.evaluate); their summary rows."""

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import tempfile
    from pathlib import Path

    from echo.config import Hardware, Topology
    from echo.io import write_parquet
    from echo.sweep.search import evaluate, make_plan, rows_table

    plan = make_plan(sm.wildcards.search)
    spec = sm.params.search
    hardware = Hardware.model_validate(spec["hardware"])
    topologies = [Topology.model_validate(t) for t in spec["topologies"]]
    calib = {t.name: Path(n).parent for t, n in zip(topologies, sm.input.networks, strict=True)}
    out = Path(sm.output.rows)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix=".shard-", dir=out.parent) as work:
        evaluate(plan, plan.shards[int(sm.wildcards.shard)], out.parents[1] / "templates", hardware, topologies,
                 calib, Path(work), sm.threads, rows.extend)
    write_parquet(rows_table(rows), out)


_stage.run(sm, main)
