"""rule sweep_trace: a sweep layout's trace is the trace it shares with layouts that trace alike
(echo/sweep/spec.py): hard-linked (copied where links are impossible), not traced again."""

import os
import shutil
from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    import logging

    log = logging.getLogger("echo.sweep")
    for name in sm.output.keys():
        src, dst = Path(sm.input[name]), Path(sm.output[name])
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        log.info("%s -> %s", src, dst)


_stage.run(sm, main)
