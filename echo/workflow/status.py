"""``python -m echo status``: what is cached and what would re-run, and why.

It asks Snakemake (a dry run, and ``--summary`` for every output of the DAG) and adds what
Snakemake does not say: for a job whose params changed, which config keys changed, by comparing
the params Snakemake recorded for the job's outputs (``.snakemake/metadata``) with the configs
as the rules compute them now (echo.workflow.params: the config slices and the stage's code version).
"""

from __future__ import annotations

import ast
import base64
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from echo.errors import ArtifactError
from echo.io import read_parquet
from echo.workflow.params import CONFIG_PARAMS
from echo.workflow.versions import RULE_STAGE, STAGE_MODULES, code_version

_JOB = re.compile(r"^(local)?rule (\S+):$")
# Pipeline order, for listing jobs.
ORDER = ("trace", "sweep_trace", "dedup", "profile", "calibrate", "overlap", "simulate", "sweep_layouts",
         "sweep_rank", "measure", "compare", "validate_local", "validate", "validate_errors", "plot_experiment",
         "plot_overview", "plot_sweep", "report")
_FIELD = re.compile(r"^\s+(input|output|wildcards|reason|jobid): (.*)$")


@dataclass
class Job:
    rule: str
    wildcards: dict[str, str] = field(default_factory=dict)
    output: list[str] = field(default_factory=list)
    reason: str = ""
    local: bool = False
    changes: list[str] = field(default_factory=list)   # config keys whose value changed

    @property
    def label(self) -> str:
        return " / ".join(self.wildcards.values()) or "-"


def parse_dry_run(text: str) -> list[Job]:
    """The jobs of ``snakemake -n`` output, with their wildcards, outputs and reasons."""
    jobs: list[Job] = []
    current: Job | None = None
    for line in text.splitlines():
        if m := _JOB.match(line):
            current = Job(m.group(2), local=bool(m.group(1)))
            jobs.append(current)
        elif current and (m := _FIELD.match(line)):
            key, value = m.groups()
            if key == "wildcards":
                current.wildcards = dict(kv.split("=", 1) for kv in value.split(", "))
            elif key == "output":
                current.output = value.split(", ")
            elif key == "reason":
                current.reason = value
        elif not line.strip():
            current = None
    return jobs


def parse_summary(text: str) -> list[dict[str, str]]:
    """``snakemake --summary`` rows: output_file, date, rule, log-file(s), status, plan."""
    lines = [ln for ln in text.splitlines() if "\t" in ln]
    if not lines:
        return []
    head = lines[0].split("\t")
    return [dict(zip(head, ln.split("\t"), strict=False)) for ln in lines[1:]]


def damaged(rows: Sequence[dict[str, str]], workdir: Path) -> list[str]:
    """'path: what is wrong; snakemake --forcerun RULE' for each existing Parquet output of the
    summary that fails its checks (echo.io.read_parquet: footer, contract, page checksums).
    Snakemake takes such a file as done: only reading it tells."""
    out = []
    for r in rows:
        name = r.get("output_file", "")
        path = workdir / name
        if not name.endswith(".parquet") or not path.is_file():
            continue
        try:
            read_parquet(path)
        except ArtifactError as e:
            out.append(f"{name}: {e.problem}; snakemake --forcerun {r.get('rule') or '?'}")
    return out


def metadata_path(workdir: Path, output: str) -> Path:
    """Where Snakemake keeps its record of an output (as snakemake/persistence/file.py names it)."""
    folder = workdir / ".snakemake" / "metadata"
    max_len = os.pathconf(folder, "PC_NAME_MAX") if folder.is_dir() else 255
    b64 = base64.urlsafe_b64encode(output.encode()).decode()
    parts = [b64[i:i + max_len - 1] for i in range(0, len(b64), max_len - 1)]
    return folder.joinpath(*["@" + p for p in parts[:-1]], parts[-1])


def recorded_params(workdir: Path, output: str) -> list | None:
    """The params Snakemake recorded when it last made ``output`` (None if it has no record)."""
    try:
        return json.loads(metadata_path(workdir, output).read_text()).get("params")
    except (OSError, ValueError):
        return None


def diff(old: object, new: object, prefix: str = "") -> list[str]:
    """'key: old -> new' for every leaf that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += diff(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if old == new else [f"{prefix or 'value'}: {old!r} -> {new!r}"]


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None  # not a plain value: nothing to compare key by key


def explain_params(job: Job, workdir: Path, config_dir: Path | None = None) -> list[str]:
    """Which config keys (or which stage's code) changed since the job's outputs were made: the
    params the rule computes now (echo.workflow.params, the rules' own functions, and the stage's
    code version) against those Snakemake recorded (as it does, by repr)."""
    recorded = recorded_params(workdir, job.output[0]) if job.output else None
    if not recorded:
        return []
    wildcards = SimpleNamespace(**job.wildcards)
    now = {}
    for name, params in CONFIG_PARAMS.get(job.rule, {}).items():
        try:
            now[name] = params(wildcards, config_dir or workdir / "config")
        except Exception:  # a broken file: the dry run has said so already
            continue
    stage = RULE_STAGE.get(job.rule, job.rule)
    if stage in STAGE_MODULES:
        now["code"] = code_version(stage)
    old = [_literal(r) for r in set(recorded) - {repr(v) for v in now.values()}]
    found: list[str] = []
    for name, value in now.items():
        if repr(value) in recorded:
            continue
        if name == "code":
            found += [f"code of stage {stage} ({o} -> {value})" for o in old
                      if isinstance(o, str) and re.fullmatch(r"[0-9a-f]{12}", o)][:1]
            continue
        same = [o for o in old if isinstance(o, dict) and o.get("name") == value["name"]]
        if same:  # the recorded slice of that name (and most keys in common, should two share it)
            before = max(same, key=lambda o: len(set(o) & set(value)))
            found += [f"{name} {value['name']}: {d}" for d in diff(before, value)]
    return found


def short_reason(job: Job) -> str:
    """Snakemake's reason without the params it dumps in full (the changes are listed instead)."""
    parts = []
    for part in job.reason.split("; "):
        if part.startswith("Params have changed"):
            part = "params changed" + ("" if job.changes else " (no record to compare)")
        elif ": " in part and len(part) > 160:
            head, files = part.split(": ", 1)
            files = files.split(", ")
            part = f"{head}: {files[0]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "")
        parts.append(part)
    return "; ".join(parts)


def snakemake(args: Sequence[str], workdir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE")}
    return subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def status(targets: Sequence[str] = (), workdir: Path | str = ".", config_dir: Path | None = None,
           extra: Sequence[str] = ()) -> tuple[int, str]:
    """(exit code, text): the jobs that would run with their reasons, and what is cached."""
    workdir = Path(workdir).resolve()
    dry_full = snakemake(["-n", *extra, *targets], workdir)
    summary = snakemake(["--summary", *extra, *targets], workdir)
    out, _ = dry_full.communicate()
    summary_out, _ = summary.communicate()
    if dry_full.returncode:
        return dry_full.returncode, f"snakemake could not plan the run:\n{out[-4000:]}"
    jobs = parse_dry_run(out)
    rows = parse_summary(summary_out)
    lines = [f"Echo workflow status{' for ' + ' '.join(targets) if targets else ' (rule all)'} in {workdir}"]
    running = [j for j in jobs if j.rule != "all"]
    planned = {o for j in jobs for o in j.output}
    done = {(r["rule"], r.get("log-file(s)") or r["output_file"]) for r in rows
            if r.get("output_file") not in planned and r.get("status") == "ok"}
    cached = Counter(rule for rule, _ in done)
    lines.append(f"  cached: {len(done)} jobs up to date"
                 + (f" ({', '.join(f'{rule} {n}' for rule, n in sorted(cached.items()))})" if cached else ""))
    code = 0
    if bad := damaged([r for r in rows if r.get("output_file") not in planned], workdir):  # the rest re-run anyway
        code = 1  # a script that asks for status learns that outputs need rebuilding
        lines.append(f"  damaged: {len(bad)} artifacts fail their checks (Snakemake takes them as done):")
        lines.extend(f"    {b}" for b in bad)
    if not running:
        lines.append("  nothing to do: every requested output is up to date" + (" (but see damaged)" if bad else ""))
        return code, "\n".join(lines)
    lines.append(f"  would run {len(running)} jobs ({', '.join(f'{r} {n}' for r, n in Counter(j.rule for j in running).items())}):")
    width = max(len(j.rule) for j in running)
    running.sort(key=lambda j: (ORDER.index(j.rule) if j.rule in ORDER else len(ORDER), j.rule, j.label))
    for j in running:
        if "Params have changed" in j.reason:
            j.changes = explain_params(j, workdir, config_dir)
        lines.append(f"    {j.rule:<{width}}  {j.label}")
        lines.append(f"    {'':<{width}}    why: {short_reason(j)}")
        for change in j.changes:
            lines.append(f"    {'':<{width}}      changed {change}")
    return code, "\n".join(lines)
