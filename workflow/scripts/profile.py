"""rule profile: echo.profile.run_profile(hardware, trace_dir, out_path)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware
    from echo.profile import run_profile

    hardware = Hardware.model_validate(sm.params.hardware)
    run_profile(hardware, Path(sm.input.ops).parent, Path(sm.output.kernels))


_stage.run(sm, main)
