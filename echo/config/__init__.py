"""Typed, validated configuration: workloads, hardware, topologies and sites (docs/DESIGN.md, "Contracts")."""

from echo.config.hardware import Hardware
from echo.config.loader import (
    CONFIG_ROOT,
    config_path,
    load_hardware,
    load_site,
    load_topology,
    load_workload,
    parse_hardware,
    parse_site,
    parse_topology,
    parse_workload,
)
from echo.config.site import Site
from echo.config.topology import Topology
from echo.config.workload import Workload

__all__ = [
    "CONFIG_ROOT", "Hardware", "Site", "Topology", "Workload", "config_path", "load_hardware", "load_site",
    "load_topology", "load_workload", "parse_hardware", "parse_site", "parse_topology", "parse_workload",
]
