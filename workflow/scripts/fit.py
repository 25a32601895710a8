"""rule fit: echo.fit.fit_hardware(hardware, code, reference_dir, config_root)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.fit import fit_hardware
    from echo.io import write_json

    doc = fit_hardware(sm.wildcards.hardware, sm.params.code, reference_dir=Path(sm.params.reference),
                       config_root=Path("config"))
    write_json(doc, sm.output.fit)


_stage.run(sm, main)
