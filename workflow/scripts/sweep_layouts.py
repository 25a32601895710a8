"""rule sweep_layouts: every candidate layout of a sweep (kept, or dropped with the key and the
reason) as a table, and the kept ones as workload files."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import pyarrow as pa
    import yaml

    from echo.io import write_parquet
    from echo.sweep import LAYOUTS

    layouts = pa.Table.from_pylist(sm.params.sweep["layouts"], schema=LAYOUTS)
    write_parquet(layouts, sm.output.layouts, LAYOUTS)
    folder = Path(sm.output.workloads)
    folder.mkdir(parents=True, exist_ok=True)
    for name, workload in sm.params.sweep["workloads"].items():
        body = {k: v for k, v in workload.items() if k != "name"}
        (folder / f"{name}.yaml").write_text(f"# generated from config/sweeps/{sm.wildcards.sweep}.yaml\n"
                                             + yaml.safe_dump(body, sort_keys=False))
    kept = sum(layouts.column("kept").to_pylist())
    print(f"sweep {sm.wildcards.sweep}: {layouts.num_rows} combinations, {kept} kept, "
          f"{layouts.num_rows - kept} dropped")
    for row in layouts.to_pylist():
        if not row["kept"]:
            print(f"  dropped {row['tokens']}: {row['key']}: {row['reason']}")


_stage.run(sm, main)
