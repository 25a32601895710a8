"""What every rule script shares: the echo package on sys.path, output to the rule's log.

Rule scripts stay thin: rebuild the validated config from params, call the stage's entry
function (docs/DESIGN.md, "Stage entry points"), and leave the logging here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# workflow/scripts/ -> the repository root, where the echo package lives next to the Snakefile
# (ahead of any installed copy, so a workflow run uses the code it hashed for its params).
ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "echo" / "__init__.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# The terminal's stdout while a stage runs (fd 1 then points at the log): for what a rule
# prints on purpose, like the report's table.
terminal_out = sys.stdout


# A stage that runs longer than this shows progress on the terminal (for SLURM jobs: in the job's
# log): the time so far and the latest line of the rule's log (traced ranks, kernels timed, ...).
PROGRESS_EVERY_S = float(os.environ.get("ECHO_PROGRESS_S", "20"))


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    if not lines:
        return ""
    # without the logging prefix ("2026-01-01 10:00:00,000 INFO echo.trace.runner: ")
    return re.sub(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ [\w.]+: ", "", lines[-1])[-160:]


def _progress(label: str, log_path: Path, out, done: threading.Event) -> None:
    """Every PROGRESS_EVERY_S while the stage runs: elapsed time and what the log said last
    (repeated at most once a minute when nothing new was logged)."""
    start = last_print = time.monotonic()
    last = None
    while not done.wait(PROGRESS_EVERY_S):
        line, now = _last_line(log_path), time.monotonic()
        if line != last or now - last_print >= 60:
            print(f"echo: {label}: {now - start:.0f} s: {line or 'running'}", file=out, flush=True)
            last, last_print = line, now


def run(snakemake, stage: Callable[[], object]) -> None:
    """Run ``stage()`` with stdout, stderr (file descriptors 1 and 2, so child processes too)
    and logging going to the rule's log; on failure, the traceback goes to the log and one line
    naming the log to the terminal, and the job fails."""
    log_path = Path(snakemake.log[0])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    global terminal_out
    terminal = os.fdopen(os.dup(2), "w")
    terminal_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
            force=True,
        )
        logging.captureWarnings(True)
        logger = logging.getLogger(f"echo.rule.{snakemake.rule}")
        logger.info("rule %s, wildcards %s, threads %s", snakemake.rule, dict(snakemake.wildcards), snakemake.threads)
        start = time.perf_counter()
        done = threading.Event()
        label = " ".join([snakemake.rule, *map(str, dict(snakemake.wildcards).values())])
        if PROGRESS_EVERY_S > 0:
            threading.Thread(target=_progress, args=(label, log_path, terminal, done), daemon=True).start()
        try:
            stage()
        except BaseException as exc:
            traceback.print_exc()
            sys.stderr.flush()
            print(f"echo: rule {snakemake.rule} {dict(snakemake.wildcards)} failed: "
                  f"{type(exc).__name__}: {exc}\n  (traceback in {log_path})", file=terminal, flush=True)
            raise SystemExit(1) from None
        finally:
            done.set()
        logger.info("done in %.2f s", time.perf_counter() - start)
        sys.stdout.flush()
        sys.stderr.flush()
