"""A search's strong-scaling view: each GPU count's fastest fitting layout planned for a number of
tokens on a site (``echo.plan.scaling``), as a table and the figure of days and cost against GPU
count. ``python -m echo plan-search`` and the report's rule (``plot_time_to_train``) call it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa

from echo.config import load_hardware, load_site, load_topology
from echo.errors import ConfigError
from echo.io import write_parquet
from echo.plan.scaling import scaling_plans
from echo.plan.table import scaling_rows
from echo.report.plots import save, time_to_train
from echo.sweep.spec import expansion, load_sweep


def plan_search(spec: str, ranking: Sequence[Mapping], tokens: float, site: str, table_path: Path | str,
                figure_path: Path | str, *, config_dir: Path | None = None,
                usd_per_gpu_hour: float | None = None) -> list[dict]:
    """Plan the fastest fitting layout at each GPU count of search ``spec``'s ``ranking`` rows;
    write the table (parquet) and the figure (png or svg, by suffix); return the table's rows."""
    sweep, path = load_sweep(spec, root=config_dir)
    exp = expansion(spec, config_dir)
    if not exp.kept:
        raise ConfigError(path, "axes", "the search keeps no layout")
    hardware = load_hardware(sweep.hardware, root=config_dir)
    topologies = {t: load_topology(t, root=config_dir) for t in {r["topology"] for r in ranking}}
    planned = scaling_plans(exp.kept[0].workload, hardware, topologies, load_site(site, root=config_dir), ranking,
                            tokens, usd_per_gpu_hour=usd_per_gpu_hour)
    rows = scaling_rows(planned)
    if not rows:
        raise ConfigError(path, "gpus", "no layout of the search fits in memory: nothing to plan")
    write_parquet(pa.Table.from_pylist(rows), table_path)
    save(time_to_train(rows, f"{spec}: {tokens:.3g} tokens on {sweep.hardware}, site {site}"), figure_path)
    return rows
