"""Artifact I/O: atomic (nothing partial is ever left where Snakemake would take it as done) and
checked (each Parquet file records its contract and page checksums, and every read checks them:
a truncated, damaged or schema-altered file raises ArtifactError naming the rule to re-run)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from echo.errors import ArtifactError


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


# Where a file's contract is kept: the Parquet footer's key-value metadata. The content's own
# checksums are Parquet's page CRC32s (written with write_page_checksum, verified on every read).
CONTRACT_KEY = b"echo.contract"
# The rule that writes the files under results/<first folder>/, for the re-run hint of a damaged
# artifact (the workflow's rules: workflow/rules/*.smk; a sweep's or search's own rules are named
# by Snakemake's --summary, which `python -m echo status` reads).
RULE_OF_FOLDER = {"trace": "trace", "dedup": "dedup", "profile": "profile", "calibrate": "calibrate",
                  "overlap": "overlap", "simulate": "simulate", "measure": "measure", "validate": "validate",
                  "sweep": "sweep_rank", "search": "search", "report": "report", "import": "import_kineto"}


def rule_hint(path: str | os.PathLike) -> str:
    """How to rebuild ``path``: ``snakemake --forcerun RULE`` where its folder names the rule."""
    parts = Path(path).parts
    if "results" in parts[:-1]:
        folder = parts[parts.index("results") + 1]
        if folder in RULE_OF_FOLDER:
            return f"re-run the rule that writes it: snakemake --forcerun {RULE_OF_FOLDER[folder]} (or delete the file)"
    return "delete it and re-run the step that writes it (snakemake --summary names the rule)"


def _kind(t: pa.DataType) -> str:
    """A column type as the contract states it: a list's item field is unnamed, since Parquet
    renames it (item on write, element on read)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_kind(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ", ".join(f"{f.name}: {_kind(f.type)}" for f in t) + ">"
    return str(t)


def _columns(schema: pa.Schema) -> list[list[str]]:
    """A schema's contract: [column, type] in order."""
    return [[f.name, _kind(f.type)] for f in schema]


def write_parquet(table: pa.Table, path: str | os.PathLike, schema: pa.Schema | None = None) -> None:
    """Write ``table`` (cast to ``schema`` when given, which checks its columns) atomically, with
    its contract (``schema``'s columns, else the table's own) in the footer and a CRC32 per page."""
    if schema is not None:
        missing = [f.name for f in schema if f.name not in table.column_names]
        if missing:
            raise ValueError(f"{path}: table lacks contract columns {missing}")
        extra = [c for c in table.column_names if c not in schema.names]
        table = table.select(schema.names + extra).cast(
            pa.schema(list(schema) + [table.schema.field(c) for c in extra])
        )
    contract = json.dumps(_columns(schema if schema is not None else table.schema)).encode()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), CONTRACT_KEY: contract})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, write_page_checksum=True)


def _mismatch(found: pa.Schema, expected: list[list[str]]) -> str | None:
    """What differs between a file's columns and a contract's (None: every column, its type)."""
    have = {f.name: _kind(f.type) for f in found}
    missing = [name for name, _ in expected if name not in have]
    altered = [f"{name} is {have[name]}, not {kind}" for name, kind in expected
               if name in have and have[name] != kind]
    if missing or altered:
        return "; ".join(([f"lacks columns {missing}"] if missing else []) + altered)
    return None


def check_parquet(path: str | os.PathLike, schema: pa.Schema | None = None) -> pq.ParquetFile:
    """The open file ``path``, once its footer parses and its columns are the contract's: the
    one the file records and, when given, ``schema`` (the consumer's). Raises ArtifactError."""
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(path, f"not a readable Parquet file (truncated or damaged: {e})",
                            rule_hint(path)) from None
    found = pf.schema_arrow
    recorded = (found.metadata or {}).get(CONTRACT_KEY)
    if recorded is None:
        raise ArtifactError(path, "records no Echo contract (written by another tool or an older Echo)",
                            rule_hint(path))
    try:
        contracts = [("its recorded contract", json.loads(recorded))]
    except ValueError:
        raise ArtifactError(path, "its recorded contract is damaged", rule_hint(path)) from None
    if schema is not None:
        contracts.append(("the contract its reader expects", _columns(schema)))
    for which, contract in contracts:
        if (problem := _mismatch(found, contract)) is not None:
            raise ArtifactError(path, f"does not match {which}: {problem}", rule_hint(path))
    return pf


def read_parquet(path: str | os.PathLike, schema: pa.Schema | None = None,
                 columns: list[str] | None = None) -> pa.Table:
    """The table of an Echo artifact, checked (check_parquet) and read with its page checksums
    verified; ``columns`` reads only those. pq.ParquetFile, unlike pq.read_table, does not import
    pyarrow.dataset and pandas (a second of a small stage's wall time)."""
    pf = check_parquet(path, schema)
    try:
        table = pf.read(columns=columns)
    except (pa.ArrowException, OSError) as e:
        raise ArtifactError(path, f"its content fails its checksums or does not decode ({e})",
                            rule_hint(path)) from None
    return table.replace_schema_metadata(None)


def write_json(obj: object, path: str | os.PathLike) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1, default=str))
