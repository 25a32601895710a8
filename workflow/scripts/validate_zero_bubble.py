"""rule validate_zero_bubble: echo.validate.zero_bubble.run_zero_bubble(rows, inputs, hardware,
topology, out_path, markdown_path)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware, Topology, Workload
    from echo.validate.zero_bubble import run_zero_bubble, zb_rows

    inputs = {}
    for w, ops, classes, kernels in zip(sm.params.workloads, sm.input.ops, sm.input.rank_classes, sm.input.kernels,
                                        strict=True):
        workload = Workload.model_validate(w)
        inputs[workload.name] = {"workload": workload, "trace_dir": Path(ops).parent, "rank_classes": Path(classes),
                                 "kernels": Path(kernels), "calib_dir": Path(sm.input.network).parent}
    run_zero_bubble(zb_rows(Path(sm.params.reference)), inputs, Hardware.model_validate(sm.params.hardware),
                    Topology.model_validate(sm.params.topology), Path(sm.output.table), Path(sm.output.markdown))


_stage.run(sm, main)
