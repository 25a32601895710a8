"""Run a few local worker processes that talk over gloo on loopback (benchmarks on this machine).

Fresh interpreters (``python -m MODULE RANK SPEC``) rather than multiprocessing's spawn: spawn
re-imports the caller's ``__main__``, which breaks callers such as Snakemake scripts. Each rank
logs to ``log_dir/rank{r}.log``; a failure or a timeout stops the others and says why.
"""

from __future__ import annotations

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


def launch(module: str, spec: dict, ranks: int, log_dir: Path, threads: int = 1) -> list[subprocess.Popen]:
    """Start ``ranks`` workers of ``module``, each given its rank and the JSON ``spec``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(threads),  # loopback only
               PYTHONPATH=os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    procs = []
    for rank in range(ranks):
        with open(Path(log_dir) / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", module, str(rank), json.dumps(spec)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
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
