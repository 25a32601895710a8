"""rule validate_errors: echo.validate.report.run_errors(local, published, out_path); prints it."""

from pathlib import Path

import _stage

sm = snakemake  # noqa: F821 (set by Snakemake)


def main() -> None:
    from echo.validate.report import run_errors

    text = run_errors(Path(sm.input.local), Path(sm.input.published), Path(sm.output.markdown))
    print(text, file=_stage.terminal_out, flush=True)


_stage.run(sm, main)
