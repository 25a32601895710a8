"""python -m echo.fit [--write] [hardware ...]: fit each hardware file's kernel model (default: every
fitted and transferred one), print the mean errors and, with --write, replace the compute_model
section of config/hardware/<hardware>.yaml with the fit's values, provenance and fitted_by (the code
version of today's fit). `make fit` runs the same fit through the workflow (results/fit/*.json)."""

from __future__ import annotations

import json
import sys

from echo.config import CONFIG_ROOT
from echo.fit import kernels
from echo.workflow.versions import code_version


def main(argv: list[str]) -> None:
    write = "--write" in argv
    names = [a for a in argv if not a.startswith("--")] or [*kernels.FITTED, *kernels.SAME_SILICON]
    code = code_version("fit")
    for name in names:
        doc = kernels.fit_kernels(name)
        print(f"{name}: mean |error| % {json.dumps(doc['errors'], default=float)}")
        path = CONFIG_ROOT / "hardware" / f"{name}.yaml"
        if write and path.is_file():
            kernels.write_compute_model(path, doc, code)
            print(f"  wrote {path} (fit code {code})")


if __name__ == "__main__":
    main(sys.argv[1:])
