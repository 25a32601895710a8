"""What every rule script shares: the echo package on sys.path, output to the rule's log.

Rule scripts stay thin: rebuild the validated config from params, call the stage's entry
function (docs/CONTRIBUTING-STAGES.md), and leave the logging here.
"""

from __future__ import annotations

import logging
import os
import sys
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
        try:
            stage()
        except BaseException as exc:
            traceback.print_exc()
            sys.stderr.flush()
            print(f"echo: rule {snakemake.rule} {dict(snakemake.wildcards)} failed: "
                  f"{type(exc).__name__}: {exc}\n  (traceback in {log_path})", file=terminal, flush=True)
            raise SystemExit(1) from None
        logger.info("done in %.2f s", time.perf_counter() - start)
        sys.stdout.flush()
        sys.stderr.flush()
