"""rule simulate: echo.simulate.run_simulate(workload, hardware, topology, trace_dir,
rank_classes_path, kernels_path, calib_dir, out_dir, overlap=, mode=, overlap_grad_reduce=)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware, Topology, Workload
    from echo.simulate import run_simulate

    options = sm.params.options
    overlap = list(sm.input.overlap)  # the measured slowdown, for cpu hardware only
    run_simulate(
        Workload.model_validate(sm.params.workload),
        Hardware.model_validate(sm.params.hardware),
        Topology.model_validate(sm.params.topology),
        Path(sm.input.ops).parent,
        Path(sm.input.rank_classes),
        Path(sm.input.kernels),
        Path(sm.input.collectives).parent,
        Path(sm.output.summary).parent,
        overlap=Path(overlap[0]) if overlap else None,
        mode=options["mode"],
        overlap_grad_reduce=options["overlap_grad_reduce"],
    )


_stage.run(sm, main)
