"""rule calibrate: echo.network.run_calibrate(topology, out_dir, logs)."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.config import Topology
    from echo.network import run_calibrate

    topology = Topology.model_validate(sm.params.topology)
    run_calibrate(topology, Path(sm.output.collectives).parent, logs=list(sm.input.logs),
                  priority=sm.params.priority)


_stage.run(sm, main)
