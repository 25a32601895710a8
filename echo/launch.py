"""The one launcher of local ``python -m echo...`` processes: tracing ranks, kernel timing, the
eager and host-overhead calibrations, and worker ranks that talk over gloo on loopback (the
measure stage's training ranks, the gloo benchmark, the overlap measurement).

Fresh interpreters rather than multiprocessing's spawn: spawn re-imports the caller's
``__main__``, which breaks callers such as Snakemake scripts. Every process gets the same
environment (``environment``): its thread count, loopback-only gloo, warnings off and this very
package first on its path. Worker ranks (``launch``: ``python -m MODULE RANK SPEC_JSON``) log to
``log_dir/rank{r}.log``; a failure or a timeout stops the others and says why (``wait``).

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


def environment(threads: int = 1) -> dict[str, str]:
    """The environment of every process started here: ``threads`` math threads, gloo on loopback
    only, no warnings noise (funcol's "not awaited" under fake tensors), this package first."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore",
                PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))


def _check(priority: str) -> None:
    if priority not in PRIORITIES:
        raise ValueError(f"priority {priority!r}: one of {', '.join(PRIORITIES)}")


def start(module: str, *args: str, threads: int = 1, priority: str = "none", **popen) -> subprocess.Popen:
    """``python -m module *args`` in the background, scheduled as ``priority`` says."""
    _check(priority)
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], env=environment(threads),
                            preexec_fn=functools.partial(prioritize, priority), **popen)


def run(module: str, *args: str, threads: int = 1, priority: str = "none") -> subprocess.CompletedProcess:
    """``python -m module *args`` to completion, its output captured as text."""
    _check(priority)
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], env=environment(threads),
                          capture_output=True, text=True, preexec_fn=functools.partial(prioritize, priority))


def launch(module: str, spec: dict, ranks: int, log_dir: Path, threads: int = 1,
           priority: str = "none") -> list[subprocess.Popen]:
    """Start ``ranks`` workers of ``module``, each given its rank and the JSON ``spec``."""
    procs = []
    for rank in range(ranks):
        with open(Path(log_dir) / f"rank{rank}.log", "w") as log:
            procs.append(start(module, str(rank), json.dumps(spec), threads=threads, priority=priority,
                               stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen], log_dir: Path, timeout_s: float, what: str) -> None:
    """Wait for every rank; as soon as one fails, or when time runs out, stop the others and
    raise naming ``what``."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                tail = (Path(log_dir) / f"rank{rank}.log").read_text()[-3000:]
                raise RuntimeError(f"{what}: rank {rank} exited with {code}:\n{tail}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: the run did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
