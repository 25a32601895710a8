"""Helpers of the simulate and overlap rule files (workflow/rules/{simulate,overlap}.smk), kept
here so the rule files hold rules only."""

from __future__ import annotations

from collections.abc import Mapping

from echo.errors import ConfigError

# config["simulate"] (optional), e.g. --config 'simulate={mode: full}'; first value = default.
# overlap_grad_reduce None: as the workload's parallel.overlap_grad_reduce says (default off).
OPTIONS = {"mode": ("symmetric", "full"), "overlap_grad_reduce": (None, False, True)}


def options(given: object) -> dict:
    """config["simulate"], checked: only the keys and values of OPTIONS."""
    given = given or {}
    if not isinstance(given, Mapping):
        raise ConfigError("config/config.yaml", "simulate", f"expected a mapping; got {given!r}")
    for key, value in given.items():
        if key not in OPTIONS:
            raise ConfigError("config/config.yaml", f"simulate.{key}", f"unknown option; known: {', '.join(OPTIONS)}")
        if value not in OPTIONS[key]:
            raise ConfigError("config/config.yaml", f"simulate.{key}",
                              f"expected one of {OPTIONS[key]}; got {value!r}")
    return {key: given.get(key, values[0]) for key, values in OPTIONS.items()}


def overlap_input(hardware) -> list[str]:
    """The simulate job's overlap slowdown input: this machine's measurement for cpu hardware;
    GPUs use the table in echo/overlap/table.py (covered by the code version)."""
    return [f"results/overlap/{hardware.name}/slowdown.parquet"] if hardware.kind == "cpu" else []


def overlap_device(hardware) -> dict:
    """The overlap rule's params: refuses a GPU (nothing to measure on this machine)."""
    if hardware.kind != "cpu":
        raise ConfigError(f"config/hardware/{hardware.name}.yaml", "kind",
                          "the overlap slowdown is measured on this machine only (kind: cpu); GPUs use the "
                          "published figures in echo/overlap/table.py")
    return {"name": hardware.name, "kind": hardware.kind}
