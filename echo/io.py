"""Atomic artifact I/O: nothing partial is ever left where Snakemake would take it as done."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; rename it onto ``path`` only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_parquet(table: pa.Table, path: str | os.PathLike, schema: pa.Schema | None = None) -> None:
    """Write ``table`` (cast to ``schema`` when given, which checks its columns) atomically."""
    if schema is not None:
        missing = [f.name for f in schema if f.name not in table.column_names]
        if missing:
            raise ValueError(f"{path}: table lacks contract columns {missing}")
        extra = [c for c in table.column_names if c not in schema.names]
        table = table.select(schema.names + extra).cast(
            pa.schema(list(schema) + [table.schema.field(c) for c in extra])
        )
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_parquet(path: str | os.PathLike) -> pa.Table:
    return pq.read_table(path)


def write_json(obj: object, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, default=str))
