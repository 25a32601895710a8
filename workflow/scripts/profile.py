"""rule profile: echo.profile.run_profile(hardware, trace_dir, out_path, cache_dir, imported, ranks_on_host, overlay)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Hardware
    from echo.profile import run_profile

    hardware = Hardware.model_validate(sm.params.hardware)
    imported = Path(sm.input.imported) if "imported" in sm.input.keys() else None
    overlay = Path(sm.input.overlay) if "overlay" in sm.input.keys() else None
    note = run_profile(hardware, Path(sm.input.ops).parent, Path(sm.output.kernels),
                       cache_dir=Path(sm.params.cache_dir), imported=imported,
                       ranks_on_host=sm.params.ranks_on_host, overlay=overlay)
    if Path(sm.output.note) != Path(sm.output.kernels).with_name("profile.json"):
        raise RuntimeError(f"profile.json is written next to kernels.parquet, not at {sm.output.note}")
    del note


_stage.run(sm, main)
