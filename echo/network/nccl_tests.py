"""Read nccl-tests output (``all_reduce_perf``, ``all_gather_perf``, ... any ``*_perf``) into rows.

What a log holds and what this reader takes from it:

- the options header ``# nThread 1 nGpus 8 minBytes 8 maxBytes 1073741824 step: 2(factor)
  warmup iters: 5 iters: 20 [agg iters: 1] validation: 1 [graph: 0]``;
- the device listing ``#  Rank  3 [Group 0] Pid 63417 on node-000000 device  3 [0x00]
  A100-SXM4-40GB``: how many ranks, on which hosts (so the log itself tells the placement:
  GPUs per node and node names), on which GPU model;
- the table: column names from its header line (``size count type redop [root] time algbw busbw
  error|#wrong``, out-of-place then in-place), one row per size and data type; ``N/A`` in the
  error columns (validation off) reads as null;
- the closing ``# Avg bus bandwidth`` line; a table that stops without it was cut short.

Launcher prefixes (``[1,0]<stdout>:`` from Open MPI's ``--tag-output``, ``0:`` from ``srun
--label``) are removed, ``<stderr>`` lines, NCCL's own ``NCCL INFO``/``WARN`` chatter and its
``NCCL version 2.26.2+cuda12.8`` line (``NCCL_DEBUG=VERSION``) are skipped.

A run that forced NCCL's choice says so (``nccl_algo``, ``nccl_proto`` columns, as the
environment variables read, e.g. ``Ring``): from NCCL's own ``NCCL_ALGO set by environment to
Ring`` line (``NCCL_DEBUG=INFO``), or from a ``NCCL_ALGO=Ring`` / ``NCCL_PROTO=Simple`` setting on
a comment line before the first header (the command line pasted above the output).

Device listings shortened by whoever copied the log (``#  [... ranks 1-14 abbreviated ...]``,
optionally ``[... ranks 1-30 abbreviated: 8 per host on a, b, c, d ...]``) are filled in: ranks
sit on hosts in blocks of ``g`` consecutive ranks (``g`` as stated, else the last listed rank's
device index + 1), which every listed rank must agree with (its device is its rank mod g, its
host that of its block); hosts no listed rank names are called ``<abbreviated host i>``. Which collective a log measured comes from its ``# Collective test starting:`` line
(newer nccl-tests), else from its file name (``all_reduce_perf_16gpus.log``), and is checked
against the data: busbw/algbw is nccl-tests' bus factor of that collective (2(n-1)/n for
all-reduce, (n-1)/n for all-gather, ...), so a log of another collective under a misleading name
is refused. Every problem is a ``LogFormatError`` naming the file, the line and the reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from echo.errors import ConfigError
from echo.reference import reference_file

# nccl-tests binary (without _perf) -> echo's op name
COLLECTIVES = {
    "all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all", "broadcast": "broadcast", "reduce": "reduce", "sendrecv": "sendrecv",
    "gather": "gather", "scatter": "scatter", "hypercube": "hypercube",
}

# One row per measured point (size x data type x out-of-place/in-place) of every log.
MEASUREMENTS = pa.schema([
    ("source", pa.string()),         # the file it came from (nccl_tests) or "gloo_benchmark"
    ("line", pa.int32()),            # line of the row in that file (-1 for benchmarks)
    ("op", pa.string()),             # echo op name: all_reduce, all_gather, all_to_all, ...
    ("collective", pa.string()),     # nccl-tests binary: all_reduce_perf, ...
    ("gpus", pa.int32()),            # ranks in the run
    ("nodes", pa.int32()),           # distinct hosts in the device listing
    ("gpus_per_node", pa.int32()),   # fewest ranks on one host
    ("gpus_per_thread", pa.int32()), # nGpus: GPUs one thread drives (their launches are serial)
    ("bytes", pa.int64()),           # nccl-tests' size column
    ("count", pa.int64()),
    ("dtype", pa.string()),
    ("redop", pa.string()),
    ("placement", pa.string()),      # out_of_place | in_place
    ("time_us", pa.float64()),
    ("algbw_GBps", pa.float64()),
    ("busbw_GBps", pa.float64()),
    ("error", pa.float64()),         # max abs error (validation on), null for N/A
    ("wrong", pa.int64()),           # #wrong column of newer nccl-tests, null where absent or N/A
    ("warmup_iters", pa.int32()),
    ("iters", pa.int32()),
    ("device", pa.string()),         # GPU model named in the device listing
    ("nccl_algo", pa.string()),      # NCCL_ALGO the run forced (e.g. Ring), null: NCCL's own choice
    ("nccl_proto", pa.string()),     # NCCL_PROTO the run forced (e.g. Simple), null: NCCL's own choice
])

_PREFIX = re.compile(r"^(?:\[\d+(?:,\d+)*\]<(stdout|stderr)>:|\d+: )")
_NCCL_CHATTER = re.compile(r"\bNCCL (?:INFO|WARN|TRACE|ABORT)\b")
_NCCL_VERSION = re.compile(r"^NCCL version \S+$")
_ENV_SET = re.compile(r"\b(NCCL_ALGO|NCCL_PROTO) set by environment to (\S+)")
_ENV_ASSIGN = re.compile(r"\b(NCCL_ALGO|NCCL_PROTO)=([^\s'\"]+)")
_ABBREVIATED = re.compile(r"^#\s*\[\.\.\.\s*ranks\s+(?P<lo>\d+)\s*-\s*(?P<hi>\d+)\s+abbreviated"
                          r"(?::\s*(?P<per>\d+)\s+per host on\s+(?P<hosts>[^.\]]*?))?\s*\.*\s*\]\s*$")
_DEVICE = re.compile(
    r"^#\s*Rank\s+(?P<rank>\d+)\s+(?:Group\s+\d+\s+)?Pid\s+(?P<pid>\d+)\s+on\s+(?P<host>\S+)\s+"
    r"device\s+(?P<device>\d+)\s+\[(?P<bus>[^\]]*)\]\s+(?P<name>.*?)\s*$")
_OPTIONS = {
    "nThread": r"nThread\s+(\d+)", "nGpus": r"nGpus\s+(\d+)", "minBytes": r"minBytes\s+(\d+)",
    "maxBytes": r"maxBytes\s+(\d+)", "step": r"step:\s*(\d+)", "warmup_iters": r"warmup iters:\s*(\d+)",
    "iters": r"(?<!warmup )(?<!agg )iters:\s*(\d+)", "agg_iters": r"agg iters:\s*(\d+)",
    "validation": r"validation:\s*(\d+)", "graph": r"graph:\s*(\d+)",
}
_STEP_KIND = re.compile(r"step:\s*\d+\((factor|bytes)\)")
_STARTING = re.compile(r"Collective test starting:\s*(\w+?)_perf\b")
_FILE_OP = re.compile(r"(" + "|".join(sorted(COLLECTIVES, key=len, reverse=True)) + r")_perf")
_INT_COLS = {"size", "count", "root"}
_FLOAT_COLS = {"time", "algbw", "busbw"}
_REQUIRED = ("size", "count", "type", "time", "algbw", "busbw")


class LogFormatError(ConfigError):
    """An nccl-tests log that cannot be read: names the file, the line (when there is one) and why."""

    def __init__(self, file: str | Path, line: int | None, reason: str):
        super().__init__(str(file), f"line {line}" if line else "-", reason)
        self.line = line


@dataclass(frozen=True)
class Device:
    rank: int
    pid: int
    host: str
    device: int
    bus_id: str
    name: str


@dataclass
class Run:
    """One nccl-tests run: its options, devices and table rows."""

    path: str
    header_line: int
    source: str = ""                # what the measurements' source column says (default: path)
    options: dict[str, int | str] = field(default_factory=dict)
    devices: list[Device] = field(default_factory=list)
    collective: str = ""            # nccl-tests name without _perf, e.g. all_reduce
    rows: list[dict] = field(default_factory=list)
    avg_busbw_GBps: float | None = None
    out_of_bounds_ok: bool | None = None
    env: dict[str, str] = field(default_factory=dict)  # NCCL_ALGO / NCCL_PROTO the run forced
    # (first rank, last rank, GPUs per host or None, host names) of a shortened device listing
    abbreviated: tuple[int, int, int | None, tuple[str, ...], int] | None = None

    @property
    def op(self) -> str:
        return COLLECTIVES[self.collective]

    @property
    def ranks(self) -> int:
        return len(self.devices)

    @property
    def hosts(self) -> list[str]:
        """Host names in order of first appearance."""
        return list(dict.fromkeys(d.host for d in self.devices))

    @property
    def per_host(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for d in self.devices:
            counts[d.host] = counts.get(d.host, 0) + 1
        return counts

    @property
    def gpus_per_node(self) -> int:
        return min(self.per_host.values())

    @property
    def device_name(self) -> str:
        names = sorted({d.name for d in self.devices})
        return names[0] if len(names) == 1 else "/".join(names)

    def table(self) -> pa.Table:
        """The run's rows in the MEASUREMENTS schema."""
        base = {"source": self.source or self.path, "op": self.op, "collective": f"{self.collective}_perf", "gpus": self.ranks,
                "nodes": len(self.hosts), "gpus_per_node": self.gpus_per_node,
                "gpus_per_thread": self.options["nGpus"],
                "warmup_iters": self.options.get("warmup_iters"), "iters": self.options.get("iters"),
                "device": self.device_name, "nccl_algo": self.env.get("NCCL_ALGO"),
                "nccl_proto": self.env.get("NCCL_PROTO")}
        rows = [{**base, **row} for row in self.rows]
        return pa.Table.from_pylist(rows, schema=MEASUREMENTS)


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw / algbw of a collective (its name without _perf) on n ranks."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "alltoall", "gather", "scatter", "hypercube"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, sendrecv


def _strip(raw: str) -> tuple[str, bool]:
    """(line without launcher prefix, whether it came from stderr)."""
    line = raw.rstrip("\r\n")
    m = _PREFIX.match(line)
    if not m:
        return line, False
    return line[m.end():], m.group(1) == "stderr"


def _number(text: str, kind: type, file: str, line: int, column: str):
    """One numeric cell; N/A is None where allowed (error columns)."""
    if text == "N/A":
        if column in ("error", "#wrong"):
            return None
        raise LogFormatError(file, line, f"column '{column}' is N/A; a measurement is needed here")
    try:
        value = kind(text)
    except ValueError:
        raise LogFormatError(file, line, f"column '{column}': {text!r} is not a number") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise LogFormatError(file, line, f"column '{column}': {text!r} is not a finite number")
    return value


def _columns(text: str, file: str, line: int) -> list[str]:
    """Column names of the table header, with the out-of-place / in-place groups told apart."""
    names = text.lstrip("#").split()
    out, group = [], 0
    for name in names:
        if name == "time":
            group += 1
        out.append(f"{name}@{group}" if group and name in ("time", "algbw", "busbw", "error", "#wrong") else name)
    missing = [c for c in _REQUIRED if c not in names]
    if missing or group not in (1, 2):
        raise LogFormatError(file, line, f"table header lacks {missing or 'one or two time/algbw/busbw groups'}: {text.strip()!r}")
    return out


class _Reader:
    """Line-by-line state machine over one file."""

    def __init__(self, path: str | Path, text: str | None = None, source: str | None = None):
        self.path = str(path)
        self.source = source
        if text is None:
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise LogFormatError(path, None, f"cannot read: {exc.strerror or exc}") from None
            if b"\0" in data[:65536]:
                raise LogFormatError(path, None, "not an nccl-tests log: binary content")
            text = data.decode("utf-8", errors="replace")
        self.lines = text.splitlines()
        self.runs: list[Run] = []
        self.run: Run | None = None
        self.columns: list[str] | None = None
        self.table_line = 0
        self.last_row_line = 0
        self.explicit: dict[int, tuple[str, int]] = {}  # run index -> (collective, line) from "test starting"
        self.pending: tuple[str, int] | None = None
        self.banner_env: dict[str, str] = {}  # NCCL_ALGO=... on the command line above the first run

    def fail(self, line: int | None, reason: str) -> LogFormatError:
        return LogFormatError(self.path, line, reason)

    def read(self) -> list[Run]:
        for number, raw in enumerate(self.lines, start=1):
            line, stderr = _strip(raw)
            body = line.strip()
            if m := _ENV_SET.search(body):
                if self.run is not None:
                    self.run.env[m.group(1)] = m.group(2)
                else:
                    self.banner_env[m.group(1)] = m.group(2)
            if stderr or not body or _NCCL_CHATTER.search(body) or _NCCL_VERSION.match(body):
                continue
            if m := _STARTING.search(body):
                # printed before the options header of the run it names (newer nccl-tests)
                self.pending = (m.group(1), number)
                continue
            if body.startswith("#"):
                self.comment(body, number)
                continue
            if self.columns is None:
                if self.run is None and not self.runs:
                    raise self.fail(number, "not an nccl-tests log: text before any '# nThread ... nGpus ...' header: "
                                            f"{body[:60]!r}")
                raise self.fail(number, f"unexpected text outside a table: {body[:60]!r}")
            self.data_row(body, number)
        if self.columns is not None:
            raise self.fail(self.last_row_line or self.table_line,
                            "the table stops without nccl-tests' closing '# Avg bus bandwidth' line: the log was cut short")
        if not self.runs:
            raise self.fail(None, "not an nccl-tests log: no '# nThread ... nGpus ...' header found")
        for index, run in enumerate(self.runs):
            run.env = {**self.banner_env, **run.env}
            self.finish(run, self.explicit.get(index))
        return self.runs

    # --- comment lines: header, devices, table header, footer ---------------------------
    def comment(self, body: str, number: int) -> None:
        if body.startswith("# nThread") or re.match(r"#\s*nThread\b", body):
            if self.columns is not None:
                raise self.fail(number, "a new run starts before the table above it was closed: the log was cut short")
            self.run = Run(self.path, number, self.source or "", self.options(body, number))
            self.runs.append(self.run)
            if self.pending:
                self.explicit[len(self.runs) - 1], self.pending = self.pending, None
            return
        if self.run is None:
            if not self.runs:  # banner lines before the first header (version, environment, command)
                self.banner_env.update(dict(_ENV_ASSIGN.findall(body)))
            return
        if m := _DEVICE.match(body):
            self.run.devices.append(Device(int(m["rank"]), int(m["pid"]), m["host"], int(m["device"]),
                                           m["bus"], m["name"]))
            return
        if m := _ABBREVIATED.match(body):
            if self.run.abbreviated is not None or self.columns is not None:
                raise self.fail(number, "a second shortened device listing in one run")
            hosts = tuple(h.strip() for h in (m["hosts"] or "").split(",") if h.strip())
            self.run.abbreviated = (int(m["lo"]), int(m["hi"]), int(m["per"]) if m["per"] else None, hosts, number)
            return
        words = body.lstrip("#").split()
        if self.columns is None and {"size", "count", "time"} <= set(words):
            self.columns = _columns(body, self.path, number)
            self.table_line = number
            return
        if self.columns is not None and not self.run.rows and (not words or "(B)" in words or "out-of-place" in words):
            return  # unit line under the column names
        if "Out of bounds values" in body:
            self.run.out_of_bounds_ok = "FAILED" not in body
            return
        if m := re.match(r"#\s*Avg bus bandwidth\s*:\s*(\S+)", body):
            if self.columns is None:
                raise self.fail(number, "'# Avg bus bandwidth' without a table above it")
            if not self.run.rows:
                raise self.fail(number, "the table has no rows")
            try:
                self.run.avg_busbw_GBps = float(m.group(1))
            except ValueError:
                raise self.fail(number, f"average bus bandwidth {m.group(1)!r} is not a number") from None
            self.columns = None
            return
        if self.columns is not None and self.run.rows:
            # nccl-tests prints nothing but rows between the header and its footer
            raise self.fail(number, f"unexpected comment inside the table: {body[:60]!r}")

    def options(self, body: str, number: int) -> dict[str, int | str]:
        opts: dict[str, int | str] = {}
        for key, pattern in _OPTIONS.items():
            if m := re.search(pattern, body):
                opts[key] = int(m.group(1))
        for key in ("nThread", "nGpus", "minBytes", "maxBytes", "iters"):
            if key not in opts:
                raise self.fail(number, f"options header lacks '{key}': {body[:100]!r}")
        if m := _STEP_KIND.search(body):
            opts["step_kind"] = m.group(1)
        return opts

    # --- table rows ---------------------------------------------------------------------
    def data_row(self, body: str, number: int) -> None:
        assert self.run is not None and self.columns is not None
        cells = body.split()
        cols = self.columns
        if len(cells) != len(cols):
            last = number == self._last_content_line()
            why = "the log was cut short mid-row" if last and len(cells) < len(cols) else "malformed row"
            raise self.fail(number, f"{why}: expected {len(cols)} columns ({' '.join(c.split('@')[0] for c in cols)}), "
                                    f"got {len(cells)}: {body[:80]!r}")
        values: dict[str, object] = {}
        for col, cell in zip(cols, cells, strict=True):
            name = col.split("@")[0]
            if name in _INT_COLS:
                values[col] = _number(cell, int, self.path, number, name)
            elif name in _FLOAT_COLS or name == "error":
                values[col] = _number(cell, float, self.path, number, name)
            elif name == "#wrong":
                values[col] = _number(cell, int, self.path, number, name)
            else:
                values[col] = cell
        size, count = values["size"], values["count"]
        if size <= 0 or count <= 0:
            raise self.fail(number, f"size {size} and count {count} must be positive")
        groups = sorted({int(c.split("@")[1]) for c in cols if "@" in c})
        for group in groups:
            time_us, algbw = values[f"time@{group}"], values[f"algbw@{group}"]
            placement = "out_of_place" if group == 1 else "in_place"
            if time_us <= 0:
                raise self.fail(number, f"{placement} time {time_us} us is not positive")
            implied = size / time_us / 1e3
            if abs(implied - algbw) > 0.006 + 0.03 * implied:
                raise self.fail(number, f"{placement}: size/time = {implied:.2f} GB/s but the algbw column says "
                                        f"{algbw}: a damaged cell?")
            self.run.rows.append({
                "line": number, "bytes": size, "count": count, "dtype": values["type"],
                "redop": values.get("redop", "none"), "placement": placement, "time_us": time_us,
                "algbw_GBps": algbw, "busbw_GBps": values[f"busbw@{group}"],
                "error": values.get(f"error@{group}"), "wrong": values.get(f"#wrong@{group}"),
            })
        self.last_row_line = number

    def _last_content_line(self) -> int:
        for i in range(len(self.lines), 0, -1):
            if self.lines[i - 1].strip():
                return i
        return 0

    # --- a finished run: collective, placement, consistency ----------------------------
    def finish(self, run: Run, explicit: tuple[str, int] | None) -> None:
        if not run.devices:
            raise self.fail(run.header_line, "no '# Using devices' listing after the header: cannot tell the ranks "
                                             "and their hosts")
        if run.abbreviated is not None:
            self.fill_abbreviated(run)
        ranks = sorted(d.rank for d in run.devices)
        if ranks != list(range(len(ranks))):
            raise self.fail(run.header_line, f"device listing has ranks {ranks[:8]}..., not 0..{len(ranks) - 1}")
        per_proc = int(run.options["nThread"]) * int(run.options["nGpus"])
        if len(ranks) % per_proc:
            raise self.fail(run.header_line, f"{len(ranks)} ranks listed, not a multiple of nThread x nGpus = {per_proc}")
        if not run.rows:
            raise self.fail(run.header_line, "no table rows")
        named = _FILE_OP.search(Path(self.path).name)
        if explicit and named and explicit[0] != named.group(1):
            raise self.fail(explicit[1], f"the log says it ran {explicit[0]}_perf but the file is named "
                                         f"{named.group(1)}_perf")
        claimed = explicit[0] if explicit else (named.group(1) if named else None)
        if claimed is not None and claimed not in COLLECTIVES:
            raise self.fail(explicit[1] if explicit else None, f"unknown nccl-tests binary {claimed}_perf")
        run.collective = self._check_factor(run, claimed)

    def fill_abbreviated(self, run: Run) -> None:
        """Fill a shortened device listing in (module docstring): blocks of g ranks per host."""
        lo, hi, per, hosts, line = run.abbreviated
        listed = {d.rank: d for d in run.devices}
        n = len(listed) + (hi - lo + 1)
        if lo > hi or any(lo <= r <= hi for r in listed) or sorted([*listed, *range(lo, hi + 1)]) != list(range(n)):
            raise self.fail(line, f"shortened device listing: ranks {lo}-{hi} and the listed ranks "
                                  f"{sorted(listed)} do not make 0..{n - 1}")
        g = per if per is not None else listed[max(listed)].device + 1
        if g < 1 or n % g:
            raise self.fail(line, f"shortened device listing: {n} ranks do not fill hosts of {g} GPUs; "
                                  "state 'N per host on a, b, ...'")
        if hosts and len(hosts) != n // g:
            raise self.fail(line, f"shortened device listing names {len(hosts)} hosts for {n} ranks of {g} per host")
        names: dict[int, str] = dict(enumerate(hosts))
        for d in listed.values():
            block = d.rank // g
            if d.device != d.rank % g:
                raise self.fail(line, f"shortened device listing: rank {d.rank} is device {d.device}, not "
                                      f"{d.rank % g} as blocks of {g} ranks per host would place it")
            if names.setdefault(block, d.host) != d.host:
                raise self.fail(line, f"shortened device listing: rank {d.rank} is on {d.host}, not on "
                                      f"{names[block]} with the other ranks of its block of {g}")
        if len(set(names.values())) != len(names):
            raise self.fail(line, "shortened device listing: one host holds ranks of two blocks")
        model = run.devices[0].name
        fill = [Device(r, -1, names.get(r // g, f"<abbreviated host {r // g}>"), r % g, "", model)
                for r in range(lo, hi + 1)]
        run.devices = sorted([*run.devices, *fill], key=lambda d: d.rank)

    def _check_factor(self, run: Run, claimed: str | None) -> str:
        """The collective whose bus factor the rows show; the claimed one if it agrees."""
        n = run.ranks
        usable = [r for r in run.rows if r["algbw_GBps"] >= 1.0]
        if not usable:
            if claimed is None:
                raise self.fail(run.header_line, "cannot tell which collective this is (no '# Collective test "
                                                 "starting' line, no <name>_perf in the file name)")
            return claimed
        ratios = np.array([r["busbw_GBps"] / r["algbw_GBps"] for r in usable])
        ratio = float(np.median(ratios))
        worst = usable[int(np.argmax(np.abs(ratios - ratio)))]
        if abs(worst["busbw_GBps"] / worst["algbw_GBps"] - ratio) > 0.02 * ratio + 0.01 / worst["algbw_GBps"]:
            raise self.fail(worst["line"], f"busbw/algbw = {worst['busbw_GBps'] / worst['algbw_GBps']:.3f} here but "
                                           f"{ratio:.3f} elsewhere in the table: a damaged cell?")
        fits = [c for c in COLLECTIVES if abs(bus_factor(c, n) - ratio) <= 0.02 * ratio]
        if claimed is not None:
            if claimed not in fits:
                kinds = ", ".join(f"{c}_perf" for c in fits) or "no nccl-tests collective"
                raise self.fail(usable[0]["line"], f"busbw/algbw = {ratio:.3f} on {n} ranks fits {kinds}, "
                                                   f"not {claimed}_perf (factor {bus_factor(claimed, n):.3f}): "
                                                   "a log of another collective?")
            return claimed
        if "all_reduce" in fits and n > 2:
            return "all_reduce"
        raise self.fail(run.header_line, f"cannot tell which collective this is (busbw/algbw = {ratio:.3f} fits "
                                         f"{', '.join(fits) or 'none'}); name the file <collective>_perf*.log")


def read_runs(path: str | Path, text: str | None = None, source: str | None = None) -> list[Run]:
    """Every run in one nccl-tests log (usually one). ``text``: the log's content, if already
    read; ``source``: the name its rows carry (default: ``path``)."""
    return _Reader(path, text, source).read()


def read_log(path: str | Path, text: str | None = None, source: str | None = None) -> pa.Table:
    """One log as a MEASUREMENTS table (all its runs)."""
    return pa.concat_tables([run.table() for run in read_runs(path, text, source)])


def read_logs(paths: Iterable[str | Path]) -> pa.Table:
    """Several logs as one MEASUREMENTS table (an empty one for no logs)."""
    tables = [read_log(p) for p in paths]
    return pa.concat_tables(tables) if tables else MEASUREMENTS.empty_table()


# --- where a topology's logs live --------------------------------------------------------

def resolve_logs(logs: Sequence[str], config_file: str | Path, root: str | Path | None = None) -> list[Path]:
    """Existing paths of a topology's ``calibration.logs``, named relative to the reference folder
    (``root``, as for ``echo.reference.reference_root``); a missing one is a ConfigError."""
    return [reference_file(name, root, config_file=config_file, key=f"calibration.logs.{i}")
            for i, name in enumerate(logs)]
