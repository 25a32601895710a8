"""``python -m echo status``: what is cached and what would re-run, and why.

It asks Snakemake (a dry run, and ``--summary`` for every output of the DAG) and adds what
Snakemake does not say: for a job whose params changed, which config keys changed, by comparing
the params Snakemake recorded for the job's outputs (``.snakemake/metadata``) with the configs
as they are now (workload, hardware, topology slices and the stage's code version).
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

_JOB = re.compile(r"^(local)?rule (\S+):$")
# Pipeline order, for listing jobs.
ORDER = ("trace", "sweep_trace", "dedup", "profile", "calibrate", "simulate", "sweep_layouts", "sweep_rank",
         "plot_experiment", "plot_overview", "plot_sweep", "report")
# The stage whose code version a rule carries in params, where it is not the rule's own name.
RULE_STAGE = {"plot_experiment": "report", "plot_overview": "report", "plot_sweep": "report",
              "sweep_layouts": "sweep", "sweep_rank": "sweep"}
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


def current_slices(job: Job, config_dir: Path | None) -> dict[str, dict]:
    """The config slices a job's params hold now, by the name they carry."""
    from echo.config import load_hardware, load_topology, load_workload
    from echo.sweep import is_sweep_name, sweep_workload

    out = {}
    for kind, load in (("workload", load_workload), ("hardware", load_hardware), ("topology", load_topology)):
        name = job.wildcards.get(kind)
        if name is None:
            continue
        try:
            if kind == "workload" and is_sweep_name(name):
                out[kind] = sweep_workload(name, root=config_dir).model_dump()
            else:
                out[kind] = load(name, root=config_dir).model_dump()
        except Exception as exc:  # a broken file: the dry run has said so already
            out[kind] = {"error": str(exc)}
    return out


def explain_params(job: Job, workdir: Path, config_dir: Path | None) -> list[str]:
    """Which config keys (or which stage's code) changed since the job's outputs were made."""
    from echo.versioning import STAGE_MODULES, code_version

    recorded = recorded_params(workdir, job.output[0]) if job.output else None
    if not recorded:
        return []
    slices = current_slices(job, config_dir)
    found: list[str] = []
    for text in recorded:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, dict) and "name" in value:
            for kind, now in slices.items():
                if now.get("name") == value["name"]:
                    found += [f"{kind} {value['name']}: {d}" for d in diff(value, now)]
        elif isinstance(value, str) and re.fullmatch(r"[0-9a-f]{12}", value):
            stage = RULE_STAGE.get(job.rule, job.rule)
            if stage in STAGE_MODULES and value != code_version(stage):
                found.append(f"code of stage {stage} ({value} -> {code_version(stage)})")
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
    if not running:
        lines.append("  nothing to do: every requested output is up to date")
        return 0, "\n".join(lines)
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
    return 0, "\n".join(lines)
