"""Cache of CPU kernel timings across workloads: ``{cache_dir}/cpu_kernels.parquet`` (each kernel
timed alone) and ``cpu_kernels_inloop.parquet`` (replayed in its traced task, echo.profile.inloop).

A timing is reusable only on the same CPU model, torch version and thread count, and when taken
by the same timing method (``measure.METHOD``), so those are part of each row's identity besides
the kernel key; rows of a file written before a column existed match nothing. Writers merge under an exclusive lock (two
profile jobs of different workloads may share the cache) and replace the file atomically, so a
reader never sees a partial file.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import torch

from echo.errors import ArtifactError
from echo.io import read_parquet, write_json, write_parquet

log = logging.getLogger(__name__)

FILE = "cpu_kernels.parquet"
INLOOP_FILE = "cpu_kernels_inloop.parquet"
SCHEMA = pa.schema([
    ("kernel_key", pa.string()),
    ("name", pa.string()),
    ("duration_us", pa.float64()),
    ("threads", pa.int32()),
    ("cpu", pa.string()),
    ("torch", pa.string()),
    ("method", pa.string()),
])
IDENTITY = ("kernel_key", "threads", "cpu", "torch", "method")


@functools.cache
def cpu_model() -> str:
    """This machine's CPU model name (the cache must not carry timings to another CPU)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load(cache_dir: Path, threads: int, method: str, file: str = FILE) -> dict[str, float]:
    """kernel_key -> duration_us of timings valid here (``file``: FILE, or INLOOP_FILE for the
    in-loop replay timings of echo.profile.inloop)."""
    path = Path(cache_dir) / file
    if not path.is_file():
        return {}
    t = _read(path)
    mask = pc.and_(pc.and_(pc.equal(t["threads"], threads), pc.equal(t["cpu"], cpu_model())),
                   pc.and_(pc.equal(t["torch"], torch.__version__), pc.equal(t["method"], method)))
    t = t.filter(mask)
    return dict(zip(t["kernel_key"].to_pylist(), t["duration_us"].to_pylist(), strict=True))


def store(cache_dir: Path, new: dict[str, tuple[str, float]], threads: int, method: str, file: str = FILE) -> None:
    """Merge ``new`` (kernel_key -> (name, duration_us)) into the cache file ``file``."""
    path = Path(cache_dir) / file
    n = len(new)
    rows = pa.table({
        "kernel_key": list(new), "name": [v[0] for v in new.values()],
        "duration_us": [v[1] for v in new.values()], "threads": [threads] * n,
        "cpu": [cpu_model()] * n, "torch": [torch.__version__] * n, "method": [method] * n,
    }, schema=SCHEMA)
    with locked(path):
        if path.is_file():
            rows = pa.concat_tables([_others(_read(path), rows), rows])
        write_parquet(rows, path, SCHEMA)


def _read(path: Path) -> pa.Table:
    """The cache file's rows; a damaged one (or one from an Echo that wrote no contract) is only
    a cache: its timings are dropped, with a warning, and measured again."""
    try:
        return _complete(read_parquet(path))
    except ArtifactError as e:
        log.warning("profile cache dropped: %s", e)
        return SCHEMA.empty_table()


def _complete(t: pa.Table) -> pa.Table:
    """``t`` with every SCHEMA column (an older file's missing ones empty), cast to SCHEMA."""
    for f in SCHEMA:
        if f.name not in t.column_names:
            t = t.append_column(f.name, pa.array([""] * len(t), pa.string()).cast(f.type)
                                if pa.types.is_string(f.type) else pa.nulls(len(t), f.type))
    return t.select(SCHEMA.names).cast(SCHEMA)


def _others(old: pa.Table, new: pa.Table) -> pa.Table:
    """Rows of ``old`` that ``new`` does not replace (same identity)."""
    replaced = {tuple(r[c] for c in IDENTITY) for r in new.select(IDENTITY).to_pylist()}
    keep = [tuple(r[c] for c in IDENTITY) not in replaced for r in old.select(IDENTITY).to_pylist()]
    return old.filter(pa.array(keep, pa.bool_()))


@contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def measured_once(cache_dir: Path | None, file: str, method: str, measure: Callable[[], dict]) -> dict:
    """A figure of this machine measured once per CPU model, torch version and ``method``:
    read from ``{cache_dir}/{file}`` (``cached`` True), else ``measure()`` now, stamped with the
    CPU, time and load and stored there. The file stays locked while measuring, so a second
    profile job waits for the figure instead of measuring beside the first (two measurements
    side by side would time each other's load)."""
    ident = f"{cpu_model()}|{torch.__version__}|{method}"
    if not cache_dir:
        return {**_stamped(measure()), "cached": False}
    path = Path(cache_dir) / file
    with locked(path):
        table = json.loads(path.read_text()) if path.is_file() else {}
        if table.get(ident):
            return {**table[ident], "cached": True}
        table[ident] = _stamped(measure())
        write_json(table, path)
    return {**table[ident], "cached": False}


def _stamped(row: dict) -> dict:
    return {**row, "cpu": cpu_model(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
