"""rule fit: echo.fit.fit_hardware(hardware, code, reference_dir, config_root, traces, network_json)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.fit import fit_hardware
    from echo.io import write_json

    traces = {w: (Path(ops).parent, Path(classes))
              for w, ops, classes in zip(sm.params.workloads, sm.input.ops, sm.input.rank_classes, strict=True)}
    network = Path(sm.input.network[0]) if len(sm.input.network) else None
    doc = fit_hardware(sm.wildcards.hardware, sm.params.code, reference_dir=Path(sm.params.reference),
                       config_root=Path("config"), traces=traces, network_json=network, jobs=sm.threads)
    write_json(doc, sm.output.fit)


_stage.run(sm, main)
