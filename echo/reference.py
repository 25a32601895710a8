"""The reference folder of published measurements, which Echo reads but does not ship (docs/DESIGN.md,
"Reference data"); its files are named relative to it (``nccl-tests/azure-ndv4-a100/...log``).
One setting says where it is, the first given winning: the workflow's ``validate.reference_dir``
(passed as ``configured``), ``$ECHO_REFERENCE``, ``shared/reference`` beside the checkout."""

from __future__ import annotations

import os
from pathlib import Path

from echo.errors import ConfigError

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "reference"


def reference_root(configured: str | Path | None = None) -> Path:
    """Where the reference folder is (it may be absent)."""
    chosen = configured or os.environ.get("ECHO_REFERENCE")
    return Path(chosen).expanduser().absolute() if chosen else DEFAULT


def reference_file(name: str | Path, root: str | Path | None = None, *, config_file: str | Path | None = None,
                   key: str = "") -> Path:
    """The existing file ``name`` of the reference folder (``root``: as ``configured`` above). A
    missing one (or one outside the folder) raises FileNotFoundError saying how to point the
    setting elsewhere; with ``config_file``, a ConfigError of that file and ``key``."""
    base, rel = reference_root(root), Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        reason = f"'{name}' must be relative to the reference folder, inside it"
    elif (base / rel).is_file():
        return base / rel
    else:
        reason = (f"'{name}' not found in the reference folder {base}; set ECHO_REFERENCE (or the workflow's "
                  "validate.reference_dir) to the folder, or put shared/reference beside the checkout")
    if config_file is not None:
        raise ConfigError(config_file, key, reason)
    raise FileNotFoundError(reason)
