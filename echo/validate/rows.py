"""The published tables Echo validates against (``Source``) and one measurement of them mapped onto
an Echo workload (``Row``): the vocabulary echo.validate.published and echo.validate.bridge share."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """One published table and where it ran."""

    key: str          # workload name prefix
    file: str
    hardware: str
    topology: str
    citation: str


SC21 = Source("sc21", "megatron_sc21_table1_a100.csv", "a100-sxm-80gb", "dgx-a100-hdr",
              "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
              "Megatron-LM, SC21, Table 1")
MCORE = Source("mcore-h100", "megatron_core_h100.csv", "h100-sxm-80gb", "dgx-h100-ndr",
               "NVIDIA Megatron-LM README, performance section (Megatron-Core r0.8.0)")
BRIDGE = Source("mbridge", "megatron_bridge_perf_all.csv", "h100-sxm-80gb", "dgx-h100-ndr",
                "NVIDIA-NeMo Megatron-Bridge performance summary (docs/performance-summary*.md)")
SOURCES = (SC21, MCORE, BRIDGE)


@dataclass(frozen=True)
class Row:
    """One published measurement, mapped onto an Echo workload."""

    source: Source
    label: str                # the row's model size as printed, e.g. "145.6B" (Megatron-Bridge: the container)
    workload: dict            # the YAML content of the generated workload file
    gpus: int
    tflops_per_gpu: float
    measured_step_s: float
    model_tag: str = "gpt"    # the model in the workload name
    system: tuple[str, str] | None = None   # (hardware, topology) where the source's rows ran on several
    workload_name: str = ""   # the workload's name where several rows share one workload (Megatron-Bridge)
    split: str = "validation"  # fit | validation: the table's declared split (config/splits/)
    published_note: str = ""  # the header's "Published:" line where several rows share the workload

    @property
    def name(self) -> str:
        return self.workload_name or f"{self.source.key}-{self.model_tag}-{self.label.lower()}"

    @property
    def hardware(self) -> str:
        return self.system[0] if self.system else self.source.hardware

    @property
    def topology(self) -> str:
        return self.system[1] if self.system else self.source.topology


def _read(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def write_workloads_main(write, argv: list[str] | None = None) -> None:
    """``python -m <module> [CONFIG_DIR] [REFERENCE_DIR]``: (re)write a table's workload files with
    ``write(config_dir, reference_dir)`` and print their paths."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    config_dir = Path(args[0]) if args else Path(__file__).resolve().parents[2] / "config"
    for p in write(config_dir, args[1] if len(args) > 1 else None):
        print(p)
