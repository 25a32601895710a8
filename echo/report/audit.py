"""Ask the results SQL questions: one DuckDB view per artifact kind over all files of that kind.

The views are given by the caller, {view name: file pattern under the results folder} (the
workflow's are echo.workflow.paths.VIEWS, e.g. ``kernels``: profile/{workload}/{hardware}/kernels.parquet),
plus ``benchmarks``, Snakemake's results/benchmarks/{rule}/{target}.tsv. Every view reads all
files of its kind (``read_parquet`` over a glob, columns unioned by name) and gains the
wildcards of each file's path as columns (``workload``, ``hardware``, ``topology``) where the
files do not have them already. Views whose files do not exist yet are left out. ``python -m echo audit`` lists the views and
their columns; ``python -m echo audit "SELECT ..."`` prints the result as a table.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from echo.artifacts import SUMMARY


@dataclass(frozen=True)
class ViewSpec:
    name: str
    pattern: str              # under the results dir; each {wildcard} matches one path component
    kind: str = "parquet"     # parquet | tsv

    @property
    def glob(self) -> str:
        return re.sub(r"\{[a-z]+\}", "*", self.pattern)

    @property
    def wildcards(self) -> list[str]:
        return re.findall(r"\{([a-z]+)\}", self.pattern)

    @property
    def regex(self) -> str:
        """A regex over the file's path whose groups are the wildcards, anchored at the end."""
        parts = re.split(r"(\{[a-z]+\})", self.pattern)
        body = "".join("([^/]+)" if p.startswith("{") else re.escape(p) for p in parts)
        return f"{body}$"


BENCHMARKS = "benchmarks"
MAX_ROWS = 200


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def connect(results_dir: Path | str, views: Mapping[str, str]) -> tuple[duckdb.DuckDBPyConnection, dict[str, int]]:
    """An in-memory DuckDB connection with a view per artifact kind of ``views`` (name -> file
    pattern) that has files under ``results_dir``; also returns {view: number of files}."""
    results = Path(results_dir)
    con = duckdb.connect(":memory:")
    made: dict[str, int] = {}
    for spec in (ViewSpec(name, pattern) for name, pattern in views.items()):
        files = sorted(results.glob(spec.glob))
        if not files:
            continue
        source = (f"read_parquet({_quote((results / spec.glob).as_posix())}, "
                  "filename = true, union_by_name = true, hive_partitioning = false)")
        present = {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
        added = [
            f"regexp_extract(filename, {_quote(spec.regex)}, {i}) AS {_ident(w)}"
            for i, w in enumerate(spec.wildcards, start=1)
            if w not in present
        ]
        select = ", ".join(["* EXCLUDE (filename)", *added])
        con.execute(f"CREATE VIEW {_ident(spec.name)} AS SELECT {select} FROM {source}")
        made[spec.name] = len(files)
    bench = sorted(results.glob(f"{BENCHMARKS}/*/**/*.tsv"))
    if bench:
        pattern = _quote((results / BENCHMARKS).as_posix() + "/**/*.tsv")
        con.execute(
            f"CREATE VIEW {BENCHMARKS} AS SELECT "
            f"regexp_extract(filename, '{BENCHMARKS}/([^/]+)/', 1) AS rule, "
            f"regexp_extract(filename, '{BENCHMARKS}/[^/]+/(.+)[.]tsv$', 1) AS target, "
            f"* EXCLUDE (filename) FROM read_csv({pattern}, delim = '\t', header = true, "
            "filename = true, union_by_name = true, nullstr = ['NA', '-'])"
        )
        made[BENCHMARKS] = len(bench)
    return con, made


def audit(sql: str | None, results_dir: Path | str, views: Mapping[str, str], max_rows: int = MAX_ROWS) -> str:
    """With no SQL: the views and their columns. With SQL: its result as a readable table."""
    con, made = connect(results_dir, views)
    try:
        if not sql or not sql.strip():
            return describe(con, made, Path(results_dir), views)
        rel = con.sql(sql)
        if rel is None:  # a statement without a result (SET, CREATE ...)
            return "ok"
        rows = rel.limit(max_rows + 1).fetchall()
        note = f"first {max_rows} rows shown" if len(rows) > max_rows else f"{len(rows)} rows"
        return render_rows(rel.columns, [str(t) for t in rel.types], rows[:max_rows], caption=note)
    finally:
        con.close()


def describe(con: duckdb.DuckDBPyConnection, made: dict[str, int], results_dir: Path, views: Iterable[str]) -> str:
    if not made:
        return f"no results under {results_dir} yet (views appear as their files are written)"
    lines = [f"views over {results_dir}:"]
    for name, n in made.items():
        cols = con.execute(f"DESCRIBE {_ident(name)}").fetchall()
        lines.append(f"  {name} ({n} file{'s' if n != 1 else ''})")
        lines.append("    " + ", ".join(f"{c[0]} {c[1]}" for c in cols))
    missing = [name for name in views if name not in made]
    if missing:
        lines.append(f"not yet written: {', '.join(missing)}")
    return "\n".join(lines)


# --- rendering ------------------------------------------------------------------------------


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    return str(value)


def render_rows(columns: Sequence[str], types: Sequence[str] | None, rows: Sequence[Sequence[object]],
                title: str | None = None, caption: str | None = None) -> str:
    """Rows as a plain-text (no colour) box table, wide enough not to wrap."""
    cells = [[_cell(v) for v in row] for row in rows]
    table = Table(title=title, caption=caption, show_lines=False)
    for i, col in enumerate(columns):
        numeric = bool(types) and any(t in types[i].upper() for t in ("INT", "DOUBLE", "FLOAT", "DECIMAL"))
        table.add_column(col, justify="right" if numeric else "left", no_wrap=True, overflow="fold")
    for row in cells:
        table.add_row(*row)
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    width = max(80, sum(widths) + 3 * len(widths) + 4)
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False, no_color=True, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def render_table(table: pa.Table, title: str | None = None, caption: str | None = None) -> str:
    """A pyarrow table (all of it) as text."""
    types = [str(f.type) for f in table.schema]
    types = ["DOUBLE" if t.startswith(("double", "float")) else "INT" if "int" in t else t for t in types]
    rows = list(zip(*(table.column(i).to_pylist() for i in range(table.num_columns)), strict=True))
    return render_rows(table.column_names, types, rows, title=title, caption=caption)


# --- summaries ------------------------------------------------------------------------------


def summaries(paths: Sequence[Path | str]) -> pa.Table:
    """The given summary.parquet files as one table (extra columns kept, missing ones null),
    ordered by workload, hardware, topology."""
    tables = [pq.read_table(p) for p in paths]
    if not tables:
        return SUMMARY.empty_table()
    table = pa.concat_tables(tables, promote_options="permissive")
    keys = [k for k in ("workload", "hardware", "topology") if k in table.column_names]
    return table.sort_by([(k, "ascending") for k in keys]) if keys else table


def with_plans(table: pa.Table, plan_paths: Sequence[Path | str]) -> pa.Table:
    """The summaries with each experiment's plan (echo.plan.table.plan_record: interruptions,
    goodput, time to train, cost, energy) joined on workload, hardware and topology; the plan's
    site, tokens and figures become ``plan_``-prefixed columns (a summary without a plan: nulls)."""
    keys = ["workload", "hardware", "topology"]
    plans = [pq.read_table(p) for p in plan_paths]
    if not plans or table.num_rows == 0:
        return table
    plan = pa.concat_tables(plans, promote_options="permissive")
    # by hand, not Table.join: Acero joins no list columns, and a summary has per-stage lists
    by_key = {tuple(r[k] for k in keys): r for r in plan.to_pylist()}
    rows = [by_key.get(k, {}) for k in zip(*(table.column(k).to_pylist() for k in keys), strict=True)]
    for field in plan.schema:
        if field.name not in keys:
            table = table.append_column(pa.field(f"plan_{field.name}", field.type),
                                        pa.array([r.get(field.name) for r in rows], field.type))
    return table


def summaries_table(paths: Sequence[Path | str], results_dir: Path | str = "results") -> str:
    """The given summary files (those under ``results_dir``) as a printable table of the contract columns."""
    if not paths:
        return f"no simulation summaries under {results_dir} yet"
    table = summaries(paths)
    shown = [c for c in SUMMARY.names if c in table.column_names]
    return render_table(table.select(shown), title=f"Echo: predicted step times ({len(paths)} experiments)")
