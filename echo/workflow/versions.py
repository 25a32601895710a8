"""Per-stage code versions: a short hash of the source a stage runs, for Snakemake's ``params``.

Snakemake re-runs a job when its params change, but it does not see the package code a rule's
script imports. Each rule therefore carries ``params: code=code_version("<stage>")``: a hash of
the stage's own modules plus every ``echo`` module they import, followed transitively through
the source (``import echo.x``, ``from echo.x import y``, ``from . import y``, also imports inside
functions). A change to a stage's logic re-runs that stage (and, through its outputs, what is
downstream); a change to a shared helper (``echo/io.py``, ``echo/artifacts.py``, ...) re-runs
every stage that imports it; a change to a stage nobody imports re-runs only that stage.

Only file contents count (not mtimes or paths), so a fresh checkout has the same versions.
Packages that do not exist yet hash as absent, which keeps the workflow buildable while a stage
is still being written.
"""

from __future__ import annotations

import ast
import hashlib
from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # echo/, above this echo/workflow/
PACKAGE = PACKAGE_DIR.name  # "echo"

# The modules that define each stage, the one table of them; what they import is followed from
# there (so the tracer's echo.training comes with echo.trace).
STAGE_MODULES: dict[str, tuple[str, ...]] = {
    "trace": ("echo.trace", "echo.config"),
    "dedup": ("echo.dedup", "echo.config"),
    "profile": ("echo.profile", "echo.config"),
    "calibrate": ("echo.network", "echo.config"),
    "overlap": ("echo.overlap", "echo.config"),
    "simulate": ("echo.simulate", "echo.config"),
    "report": ("echo.report",),
    "measure": ("echo.validate.measure", "echo.training", "echo.config"),
    "validate": ("echo.validate", "echo.config"),
    "sweep": ("echo.sweep", "echo.config"),
    "search": ("echo.sweep", "echo.trace", "echo.config"),  # composes, costs and simulates: imports follow
    "fit": ("echo.fit", "echo.config"),
}
# The stage whose code version a rule carries (params: code=code_version(...)), where it is not
# the rule's own name.
RULE_STAGE = {"plot_experiment": "report", "plot_overview": "report", "plot_sweep": "report",
              "sweep_layouts": "sweep", "sweep_rank": "sweep", "compare": "validate",
              "validate_local": "validate", "validate_errors": "validate", "import_kineto": "profile",
              "fit_overlay": "profile", "validate_search_rankings": "search"}


def _module_files(module: str, root: Path, whole_package: bool) -> list[Path]:
    """The source files of a module: one ``.py`` file, a package's ``__init__.py``, or (for a
    stage's own packages) every ``.py`` file under the package."""
    parts = module.split(".")[1:]
    base = root.joinpath(*parts) if parts else root
    if base.is_dir():
        if whole_package:
            return sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts)
        init = base / "__init__.py"
        return [init] if init.is_file() else []
    single = base.with_suffix(".py")
    return [single] if single.is_file() else []


def _module_of(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted module name, is a package __init__) of a file under the package root."""
    rel = path.relative_to(root).with_suffix("")
    parts = [PACKAGE, *rel.parts]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _imports(path: Path, root: Path) -> set[str]:
    """The ``echo`` modules a file imports (absolute or relative, anywhere in the file)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError:
        return set()  # the hash of its bytes still changes; nothing more to follow
    module, is_pkg = _module_of(path, root)
    package = module if is_pkg else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            # `from echo import io` / `from echo.trace import recorder` name submodules
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _with_parents(module: str) -> list[str]:
    """A module and the packages above it (importing a.b.c runs a/__init__ and a/b/__init__)."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def stage_files(stage: str, root: Path = PACKAGE_DIR) -> list[Path]:
    """Every source file a stage's code can run, found by following ``echo`` imports."""
    if stage not in STAGE_MODULES:
        raise KeyError(f"unknown stage '{stage}'; known: {', '.join(STAGE_MODULES)}")
    seen_modules: set[str] = set()
    files: set[Path] = set()
    todo = [m for seed in STAGE_MODULES[stage] for m in _with_parents(seed)]
    while todo:
        module = todo.pop()
        if module in seen_modules:
            continue
        seen_modules.add(module)
        # a stage's own packages count whole; an imported package counts by its __init__ (and
        # whatever that imports), an imported submodule by its file
        candidates = _module_files(module, root, whole_package=module in STAGE_MODULES[stage])
        for path in candidates:
            if path in files:
                continue
            files.add(path)
            for imported in _imports(path, root):
                todo.extend(m for m in _with_parents(imported) if m not in seen_modules)
    return sorted(files)


@cache
def _code_version(stage: str, root: Path) -> str:
    digest = hashlib.sha256(stage.encode())
    for path in stage_files(stage, root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def code_version(stage: str, root: Path | str = PACKAGE_DIR) -> str:
    """A 12-hex-digit hash of the source files ``stage`` runs (see the module docstring)."""
    return _code_version(stage, Path(root).resolve())
