"""Run a few local worker processes that talk over gloo on loopback (benchmarks on this machine).

Fresh interpreters (``python -m MODULE RANK SPEC``) rather than multiprocessing's spawn: spawn
re-imports the caller's ``__main__``, which breaks callers such as Snakemake scripts. Each rank
logs to ``log_dir/rank{r}.log``; a failure or a timeout stops the others and says why.

``priority`` (``prioritize``) runs the ranks ahead of other work on a shared machine; the measure
stage runs its training ranks that way (config ``measure.priority``), and a benchmark whose
figures are used to predict those runs (the local gloo calibration) should run the same way.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # so workers import this very package


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PRIORITIES = ("rt", "nice", "none")


def prioritize(mode: str) -> None:
    """In the child before exec, best effort: run the process ahead of other work on a shared machine.

    ``rt``: the SCHED_RR real-time class at the lowest real-time priority, which preempts ordinary
    processes at once (the kernel's real-time throttling still leaves them 5% of each core).
    ``nice``: a session of its own at niceness -20 (Linux's autogroup scheduling shares the CPU
    fairly between sessions, so a process's niceness alone does nothing against other
    sessions); on the EEVDF scheduler this still delays wake-ups after blocking collectives by
    milliseconds, which ``rt`` does not. ``none``: as started."""
    if mode == "rt":
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
            return
        except (OSError, AttributeError):
            mode = "nice"
    if mode == "nice":
        try:
            os.setsid()
            Path("/proc/self/autogroup").write_text("-20")
            os.setpriority(os.PRIO_PROCESS, 0, -20)
        except OSError:
            pass


def launch(module: str, spec: dict, ranks: int, log_dir: Path, threads: int = 1,
           priority: str = "none") -> list[subprocess.Popen]:
    """Start ``ranks`` workers of ``module``, each given its rank and the JSON ``spec``, scheduled
    as ``priority`` says (``prioritize``)."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority {priority!r}: one of {', '.join(PRIORITIES)}")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(threads),  # loopback only
               PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    procs = []
    for rank in range(ranks):
        with open(Path(log_dir) / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", module, str(rank), json.dumps(spec)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=functools.partial(prioritize, priority)))
    return procs


def wait(procs: list[subprocess.Popen], log_dir: Path, timeout_s: float, what: str) -> None:
    """Wait for every rank; on a failure or a timeout stop the others and raise naming ``what``."""
    deadline = time.monotonic() + timeout_s
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            if code != 0:
                tail = (Path(log_dir) / f"rank{rank}.log").read_text()[-2000:]
                raise RuntimeError(f"{what} rank {rank} exited with {code}:\n{tail}")
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} did not finish within {timeout_s:.0f} s") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
