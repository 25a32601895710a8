"""rule import_kineto: echo.profile.gpu_import.import_traces(files, hardware) -> write_import(out_dir)."""

import logging
from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware
    from echo.profile.gpu_import import describe, import_traces, write_import

    hardware = Hardware.model_validate(sm.params.hardware)
    files = [Path(p) for p in sm.input.traces]
    imp = import_traces(files, hardware)
    write_import(imp, Path(sm.output.activity).parent)
    for line in describe(imp).splitlines():
        logging.getLogger("echo.profile.gpu_import").info(line)


_stage.run(sm, main)
