"""A design-space sweep: config/sweeps/{sweep}.yaml, and the layouts it expands into.

A sweep fixes a model (and its training settings), a GPU count, a hardware and one or more
topologies, and lists values for the axes to sweep::

    description: GPT-3 175B on 1,024 A100s
    base: gpt3-175b            # optional workload file: its model/parallel/training are the defaults
    gpus: 1024
    hardware: a100-sxm-80gb
    topologies: [dgx-a100-hdr]
    axes:                      # any of AXES; each a list of values
      tp: [4, 8]
      pp: [8, 16]
      schedule: [1f1b, interleaved]
      virtual_stages: [1, 2]

``model:``, ``training:`` and ``parallel:`` blocks (the keys of a workload file) may be given
instead of, or on top of, ``base``. ``dp`` is derived as gpus / (tp x pp x cp) unless it is an
axis itself. Every combination of the axes' values is a candidate layout. A candidate is dropped,
with the key and the reason, when the GPU count does not factor, when the workload would be
refused (``Workload.contradictions``), when the tracer cannot trace it yet
(``echo.trace.check_traceable``), or when it repeats another candidate (interleaved with one
virtual stage is 1F1B).

Each kept layout is a workload named ``{sweep}--{tokens}``, e.g. ``gpt3-175b-a100--tp8-pp8-dp16``:
tokens for tp, pp and dp always, and for every other setting that differs from Echo's defaults
(cp1 ep1 z1 1f1b v1 mb1 rnone sp0 pv0), so a name depends on the layout only, not on which axes the
sweep happens to list. The workflow resolves these names from the sweep file (no generated config
files are needed to build the DAG), so ``results/simulate/{workload}/...`` paths keep working.

Traces are shared: the tracer records one forward and one backward per chunk and the optimizer
step, and does not read the pipeline schedule (only virtual_stages) or the global batch. Layouts
that differ only in those share one trace, ``{sweep}--trace-{tokens}`` (the layout's tokens with
the schedule normalised), which the workflow traces once and links under each layout's name.
Each layout's dedup re-traces a sampled rank with the layout's own settings and fails loudly if it
does not hash like the shared trace, so a tracer that starts reading the schedule cannot make
sharing silently wrong.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError

from echo.config.loader import CONFIG_ROOT, config_path, load_workload, parse_workload, read_yaml
from echo.config.workload import DUAL_SCHEDULES, V_SCHEDULES, Workload
from echo.config.workload import NOT_TRACED as NOT_TRACED_KEYS
from echo.errors import ConfigError

SEP = "--"                    # between the sweep's name and a layout's tokens
TRACE_PREFIX = "trace-"       # tokens of a shared trace start with this

# The axes a sweep may list, in the order names and the product use, and where each lives.
AXES: dict[str, str] = {
    "tp": "parallel", "pp": "parallel", "dp": "parallel", "cp": "parallel", "ep": "parallel",
    "zero": "parallel", "schedule": "parallel", "virtual_stages": "parallel",
    "micro_batch": "training", "recompute": "training", "sequence_parallel": "parallel",
    "post_validation": "parallel",
}
# Settings the name leaves out when they hold Echo's default value.
DEFAULTS: dict[str, Any] = {
    "cp": 1, "ep": 1, "zero": 1, "schedule": "1f1b", "virtual_stages": 1, "micro_batch": 1,
    "recompute": "none", "sequence_parallel": False, "post_validation": False,
}
# The sweep axes the tracer does not read (echo.config.workload.NOT_TRACED): layouts differing
# only in these share a trace.
NOT_TRACED = tuple(a for a in NOT_TRACED_KEYS["parallel"] if a in AXES)


def sweep_path(name: str, root: Path | None = None) -> Path:
    """config/sweeps/{name}.yaml, or ``name`` itself when it is a path ending in .yaml (a spec kept
    elsewhere, e.g. one a validation writes; its layouts are named after the file's stem)."""
    if name.endswith((".yaml", ".yml")):
        if not Path(name).is_file():
            raise ConfigError(Path(name), "sweep", "no such spec file")
        return Path(name)
    folder = (root or CONFIG_ROOT) / "sweeps"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        raise ConfigError(path, "sweep", f"unknown sweep '{name}'; known: {', '.join(known) or 'none'}")
    return path


class Sweep(BaseModel):
    """A whole sweep file (config/sweeps/{name}.yaml)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="the file's stem")
    description: str = Field("", description="free text")
    base: str | None = Field(None, description="a workload file whose model/parallel/training are the defaults")
    model: dict[str, Any] = Field(default_factory=dict, description="model keys (over base's)")
    training: dict[str, Any] = Field(default_factory=dict, description="training keys (over base's)")
    parallel: dict[str, Any] = Field(default_factory=dict, description="parallel keys for unswept axes (over base's)")
    gpus: PositiveInt | list[PositiveInt] = Field(
        description="GPUs of every layout (= tp x pp x dp x cp), or a list of GPU counts to search over")
    hardware: str = Field(description="a hardware file's name")
    topologies: list[str] = Field(min_length=1, description="topology files' names")
    axes: dict[str, list[Any]] = Field(description="axis -> values; axes: " + ", ".join(AXES))
    verify: int = Field(1, ge=0, description="ranks each layout's dedup re-traces (checks trace sharing); "
                        "for a search: layouts whose composed rank is checked against a full trace")
    shards: PositiveInt = Field(4, description="a search under Snakemake: jobs its layouts are split into, each "
                                "over its cores (on SLURM, a node each)")
    trace_in_full: int = Field(16, ge=0, description="a search: layouts that layer templates cannot stand for "
                               "(FSDP, FP8, Hugging Face models) are traced in full, up to this many (half a "
                               "minute a rank); more is refused before any tracing, with the reason")

    @property
    def gpu_counts(self) -> list[int]:
        return self.gpus if isinstance(self.gpus, list) else [self.gpus]


@dataclass(frozen=True)
class Candidate:
    """One combination of the axes' values: kept (with its workload) or dropped (with why)."""

    name: str                          # {sweep}--{tokens}
    values: dict[str, Any]             # every axis of AXES, as the layout has it
    workload: Workload | None = None   # None when dropped
    key: str = ""                      # the offending key, when dropped
    reason: str = ""                   # why it was dropped
    trace: str = ""                    # the shared trace's workload name, when kept

    @property
    def kept(self) -> bool:
        return self.workload is not None


@dataclass
class Expansion:
    sweep: Sweep
    path: Path
    candidates: list[Candidate] = field(default_factory=list)
    traces: dict[str, Workload] = field(default_factory=dict)   # shared trace name -> its workload

    @property
    def kept(self) -> list[Candidate]:
        return [c for c in self.candidates if c.kept]

    @property
    def dropped(self) -> list[Candidate]:
        return [c for c in self.candidates if not c.kept]

    def layout(self, name: str) -> Candidate | None:
        return next((c for c in self.candidates if c.name == name), None)


# --- names ---------------------------------------------------------------------------------------


def _token(axis: str, value: Any) -> str:
    if axis == "zero":
        return f"z{value}"
    if axis == "schedule":
        return str(value)
    if axis == "virtual_stages":
        return f"v{value}"
    if axis == "micro_batch":
        return f"mb{value}"
    if axis == "recompute":
        return f"r{value}"
    if axis == "sequence_parallel":
        return f"sp{int(bool(value))}"
    if axis == "post_validation":
        return f"pv{int(bool(value))}"
    return f"{axis}{value}"


def layout_tokens(values: dict[str, Any]) -> str:
    """tp, pp, dp always; every other axis only where it differs from Echo's default."""
    return "-".join(_token(a, values[a]) for a in AXES if values.get(a) is not None
                    and (a in ("tp", "pp", "dp") or values[a] != DEFAULTS.get(a)))


def is_sweep_name(workload: str) -> bool:
    """Whether a workload name belongs to a sweep (a layout or a shared trace)."""
    return SEP in workload


def split_name(workload: str) -> tuple[str, str]:
    """'{sweep}--{tokens}' -> (sweep, tokens)."""
    sweep, _, tokens = workload.partition(SEP)
    return sweep, tokens


def trace_values(values: dict[str, Any]) -> dict[str, Any]:
    """A layout's values as its shared trace has them: settings the tracer does not read set to
    the value that keeps the workload valid (interleaved needs virtual_stages > 1 to differ); a V
    placement (zb-v) or both ways of a pipeline fed from both ends (dualpipe) is traced, so it keeps
    its schedule (Workload.traced); post-validation is simulation only."""
    untraced = {"post_validation": DEFAULTS["post_validation"]}
    if values["schedule"] in (*V_SCHEDULES, *DUAL_SCHEDULES):
        return {**values, **untraced}
    return {**values, **untraced, "schedule": "interleaved" if values["virtual_stages"] > 1 else "1f1b"}


# --- loading and expanding ---------------------------------------------------------------------------


def parse_sweep(data: dict, path: Path) -> Sweep:
    try:
        sweep = Sweep.model_validate({"name": path.stem, **data})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(path, ".".join(str(p) for p in err["loc"]) or "-", err["msg"]) from None
    for axis, values in sweep.axes.items():
        if axis not in AXES:
            raise ConfigError(path, f"axes.{axis}", f"unknown axis; allowed: {', '.join(AXES)}")
        if not isinstance(values, list) or not values:
            raise ConfigError(path, f"axes.{axis}", "expected a non-empty list of values")
        if len(set(map(repr, values))) != len(values):
            raise ConfigError(path, f"axes.{axis}", f"values repeat: {values}")
    if SEP in sweep.name:
        raise ConfigError(path, "sweep", f"a sweep's name may not contain '{SEP}'")
    return sweep


def load_sweep(name: str, root: Path | None = None) -> tuple[Sweep, Path]:
    path = sweep_path(name, root)
    return parse_sweep(read_yaml(path), path), path


def _defaults(sweep: Sweep, path: Path, root: Path | None) -> dict[str, dict[str, Any]]:
    """model/parallel/training before the axes: the base workload's, then the sweep's own."""
    blocks: dict[str, dict[str, Any]] = {"model": {}, "parallel": {}, "training": {}}
    if sweep.base:
        try:
            base = load_workload(sweep.base, root=root)
        except ConfigError as exc:
            raise ConfigError(path, "base", f"{exc}") from None
        for block in blocks:
            blocks[block] = getattr(base, block).model_dump(exclude_unset=False)
    for block in blocks:
        blocks[block] = {**blocks[block], **getattr(sweep, block)}
    return blocks


def _check_names(sweep: Sweep, path: Path, root: Path | None) -> None:
    for kind, names, key in (("hardware", [sweep.hardware], "hardware"), ("topology", sweep.topologies, "topologies")):
        for i, name in enumerate(names):
            try:
                config_path(kind, name, root)
            except ConfigError as exc:
                raise ConfigError(path, key if kind == "hardware" else f"{key}.{i}", exc.reason) from None


def expand(sweep: Sweep, path: Path, root: Path | None = None, traceable=None) -> Expansion:
    """Every combination of the sweep's axes, kept or dropped with a reason.

    ``traceable(workload)`` raises ConfigError for what the tracer cannot trace yet (default:
    ``echo.trace.check_traceable``)."""
    if traceable is None:
        from echo.trace import check_traceable as traceable
    _check_names(sweep, path, root)
    blocks = _defaults(sweep, path, root)
    axes = [a for a in AXES if a in sweep.axes]
    out = Expansion(sweep, path)
    for gpus, combo in itertools.product(sweep.gpu_counts, itertools.product(*(sweep.axes[a] for a in axes))):
        chosen = dict(zip(axes, combo, strict=True))
        parallel = {**blocks["parallel"], **{a: v for a, v in chosen.items() if AXES[a] == "parallel"}}
        training = {**blocks["training"], **{a: v for a, v in chosen.items() if AXES[a] == "training"}}
        if "dp" not in chosen:
            parallel.pop("dp", None)  # derived from the GPU count below
        values = {a: (training if AXES[a] == "training" else parallel).get(a, DEFAULTS.get(a)) for a in AXES}
        out.candidates.append(_candidate(sweep, path, blocks["model"], parallel, training, values, traceable, gpus))
    for c in out.kept:
        trace = _trace_workload(sweep, path, c)
        known = out.traces.setdefault(trace.name, trace)
        if known != trace:  # one name, one workload: trace_values() and the name agree
            raise AssertionError(f"{c.name}: shared trace {trace.name} differs from another layout's")
    return out


def _candidate(sweep: Sweep, path: Path, model: dict, parallel: dict, training: dict, values: dict,
               traceable, gpus: int) -> Candidate:
    def drop(key: str, reason: str) -> Candidate:
        return Candidate(f"{sweep.name}{SEP}{layout_tokens(values)}", values, key=key, reason=reason)

    tp, pp, cp = values["tp"], values["pp"], values["cp"]
    if not all(isinstance(v, int) and v > 0 for v in (tp, pp, cp)):
        return drop("axes", f"tp, pp and cp must be positive integers (tp {tp}, pp {pp}, cp {cp})")
    if values["dp"] is None:
        if gpus % (tp * pp * cp):
            return drop("parallel.dp", f"gpus {gpus} is not divisible by tp x pp x cp = {tp * pp * cp}")
        values["dp"] = parallel["dp"] = gpus // (tp * pp * cp)
    elif not isinstance(values["dp"], int) or tp * pp * cp * values["dp"] != gpus:
        return drop("parallel.dp", f"tp x pp x dp x cp = {tp} x {pp} x {values['dp']} x {cp} is not gpus {gpus}")
    if values["schedule"] == "interleaved" and values["virtual_stages"] == 1 and "1f1b" in sweep.axes.get("schedule", []):
        same = f"{sweep.name}{SEP}{layout_tokens({**values, 'schedule': '1f1b'})}"
        return drop("parallel.schedule", f"interleaved with virtual_stages 1 is 1F1B: same as {same}")
    if values["sequence_parallel"] and tp == 1 and False in sweep.axes.get("sequence_parallel", []):
        # with one tensor-parallel rank there is nothing to shard: the same graph, traced alike
        same = f"{sweep.name}{SEP}{layout_tokens({**values, 'sequence_parallel': False})}"
        return drop("parallel.sequence_parallel", f"sequence parallelism with tp 1 is no parallelism: same as {same}")
    name = f"{sweep.name}{SEP}{layout_tokens(values)}"
    data = {"name": name, "description": f"sweep {sweep.name}: layout {layout_tokens(values)}",
            "model": model, "parallel": parallel, "training": training, "verify": sweep.verify}
    try:
        workload = parse_workload(data, path)
        traceable(workload)
    except ConfigError as exc:
        return drop(exc.key, exc.reason)
    trace = f"{sweep.name}{SEP}{TRACE_PREFIX}{layout_tokens(trace_values(values))}"
    return Candidate(name, values, workload=workload, trace=trace)


def _trace_workload(sweep: Sweep, path: Path, c: Candidate) -> Workload:
    """The workload a shared trace is recorded with: the layout with NOT_TRACED settings normalised."""
    values = trace_values(c.values)
    tokens = layout_tokens(values)
    data = c.workload.model_dump()
    data["parallel"] = {**data["parallel"], **{a: values[a] for a in NOT_TRACED}}
    data.update(name=f"{sweep.name}{SEP}{TRACE_PREFIX}{tokens}",
                description=f"sweep {sweep.name}: trace shared by layouts {tokens} (any schedule)")
    return parse_workload(data, path)


@cache
def _expansion(name: str, root: Path | None) -> Expansion:
    sweep, path = load_sweep(name, root)
    return expand(sweep, path, root)


def expansion(name: str, root: Path | None = None) -> Expansion:
    """The expansion of config/sweeps/{name}.yaml (cached per process)."""
    return _expansion(name, Path(root).resolve() if root else None)


def sweep_workload(name: str, root: Path | None = None) -> Workload:
    """The workload of a sweep layout ``{sweep}--{tokens}`` or of a shared trace
    ``{sweep}--trace-{tokens}``; a ConfigError names the sweep file and why it has no such workload."""
    sweep, tokens = split_name(name)
    exp = expansion(sweep, root)
    if tokens.startswith(TRACE_PREFIX):
        if name in exp.traces:
            return exp.traces[name]
        raise ConfigError(exp.path, "axes", f"no layout of sweep '{sweep}' is traced as '{name}'")
    found = exp.layout(name)
    if found is None:
        some = ", ".join(c.name for c in exp.kept[:3])
        raise ConfigError(exp.path, "axes", f"'{name}' is not a layout of sweep '{sweep}' (e.g. {some})")
    if not found.kept:
        raise ConfigError(exp.path, found.key, f"layout '{name}' is dropped: {found.reason}")
    return found.workload


def shared_trace(name: str, root: Path | None = None) -> str:
    """The shared trace's workload name of a sweep layout."""
    sweep_workload(name, root)  # refuses names that are not kept layouts
    sweep, _ = split_name(name)
    return expansion(sweep, root).layout(name).trace
