"""rule simulate: echo.simulate.run_simulate(workload, hardware, topology, trace_dir,
rank_classes_path, kernels_path, calib_dir, out_dir)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware, Topology, Workload
    from echo.simulate import run_simulate

    run_simulate(
        Workload.model_validate(sm.params.workload),
        Hardware.model_validate(sm.params.hardware),
        Topology.model_validate(sm.params.topology),
        Path(sm.input.ops).parent,
        Path(sm.input.rank_classes),
        Path(sm.input.kernels),
        Path(sm.input.collectives).parent,
        Path(sm.output.summary).parent,
    )


_stage.run(sm, main)
