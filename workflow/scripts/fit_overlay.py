"""rule fit_overlay: echo.profile.overlay.build_overlay(model_error rows, hardware) -> write_overlay."""

import logging
from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.io import read_parquet
    from echo.profile.overlay import build_overlay, write_overlay

    doc = build_overlay(read_parquet(sm.input.model_error).to_pylist(), sm.wildcards.hardware,
                        [str(sm.input.model_error)])
    write_overlay(doc, Path(sm.output.overlay))
    for cls, v in doc["validation"].items():
        logging.getLogger("echo.profile.overlay").info(
            "held out, %s: mean |error| model %.1f%% -> overlay %.1f%% over %d shapes", cls,
            100 * v["model_mean_abs_error"], 100 * v["overlay_mean_abs_error"], v["shapes"])


_stage.run(sm, main)
