"""A real single-node SLURM on this machine, for the tests: Debian's packages (munge, slurmctld,
slurmd, slurmdbd with MariaDB for accounting), brought up as root from nothing and stopped again.

Everything lives under one temporary folder (configs, state, spool, logs, the munge key and
socket, the database) on free ports, and each daemon runs in the foreground as a child of this
process, so stopping it stops exactly the processes started here, by process id. The one file
outside that folder is /etc/slurm/slurm.conf, which must exist because the executor plugin's job
step strips SLURM_* variables before its inner srun (docs/DESIGN.md, "Running on SLURM"); it is a symlink
made here and removed (and any earlier file put back) on stop.

    python tests/slurm_local.py        # bring up, print the status, wait for Enter, stop

See docs/DESIGN.md, "Running on SLURM", for what this relies on.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client", "slurmdbd", "mariadb-server")
BINARIES = ("munged", "slurmctld", "slurmd", "slurmdbd", "sbatch", "srun", "sacct", "sinfo", "sacctmgr",
            "mariadbd", "mariadb-install-db")
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
CLUSTER = "echo"
PARTITION = "echo"


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be brought up here (the message says why)."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if not shutil.which(b)]


def install(timeout: float = 900) -> float:
    """apt-get install what is missing (root only); returns the seconds it took (0 if nothing)."""
    if not missing_binaries():
        return 0.0
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"not root, cannot apt-get install {' '.join(PACKAGES)}")
    if not shutil.which("apt-get"):  # a failure, not a skip: CI runs on Debian
        raise RuntimeError(f"no apt-get to install {' '.join(PACKAGES)}; missing: {missing_binaries()}")
    t0 = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if missing_binaries():
        raise RuntimeError(f"installed {PACKAGES} but still missing {missing_binaries()}")
    return time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory_mb() -> int:
    """About 90% of what slurmd detects (more drains the node)."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60).stdout
    for tok in out.split():
        if tok.startswith("RealMemory="):
            return int(int(tok.split("=", 1)[1]) * 0.9)
    return 1024


def _dead(proc: subprocess.Popen) -> bool:
    """Exited (and reaped), or a zombie (PID 1 here may not reap orphans)."""
    if proc.poll() is not None:
        return True
    try:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state in ("Z", "X")


@dataclass
class LocalSlurm:
    """A single-node SLURM whose every file is under ``root``."""

    root: Path
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    _backup: Path | None = None
    _linked: bool = False

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.etc, self.log, self.run = self.root / "etc", self.root / "log", self.root / "run"
        self.munge_dir = self.root / "munge"
        self.ports = {name: free_port() for name in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
        self.conf = self.etc / "slurm.conf"

    # --- environment for clients -----------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def cmd(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}\n{self.logs()}")
        return proc

    # --- bring up ------------------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> float:
        """Write the configs and start munged, mariadbd, slurmdbd, slurmctld and slurmd; return the
        seconds until the node accepts jobs."""
        if os.geteuid() != 0:
            raise SlurmUnavailable("not root: the daemons need root (slurmd runs jobs as their user)")
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged (as munge) must reach its folder inside
        for d in (self.etc, self.log, self.run, self.root / "state", self.root / "spool", self.root / "mysql"):
            d.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._start_mariadb(deadline=t0 + timeout)
        self._write_configs()
        self._link_system_conf()
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait(lambda: self._port_open("slurmdbd"), "slurmdbd to listen", t0 + timeout)
        # the cluster must exist in accounting before slurmctld registers with it
        self.cmd("sacctmgr", "-i", "add", "cluster", CLUSTER, check=False)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost"])
        self._wait(self._node_ready, "the node to be idle", t0 + timeout)
        self.timings["bring_up_s"] = time.monotonic() - t0
        return self.timings["bring_up_s"]

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        for p in (self.munge_dir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        os.chmod(self.munge_dir, 0o755)
        os.chmod(key, 0o400)
        self.socket = self.munge_dir / "munge.socket"
        self._spawn("munged", ["runuser", "-u", "munge", "--", "munged", "-F", "--force",
                               f"--key-file={key}", f"--socket={self.socket}",
                               f"--pid-file={self.munge_dir / 'munged.pid'}",
                               f"--log-file={self.munge_dir / 'munged.log'}",
                               f"--seed-file={self.munge_dir / 'munged.seed'}"])
        self._wait(self.socket.exists, "munged's socket", time.monotonic() + 30)

    def _start_mariadb(self, deadline: float) -> None:
        data = self.root / "mysql"
        proc = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                               "--auth-root-authentication-method=normal", "--skip-test-db"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"mariadb-install-db failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        self._spawn("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
                                 f"--socket={self.run / 'mysqld.sock'}", f"--port={self.ports['mariadb']}",
                                 "--bind-address=127.0.0.1", f"--pid-file={self.run / 'mysqld.pid'}",
                                 f"--log-error={self.log / 'mariadb.log'}", "--skip-grant-tables",
                                 "--innodb-buffer-pool-size=64M", "--skip-log-bin"])
        self._wait(lambda: self._port_open("mariadb"), "mariadbd to listen", deadline)

    def _write_configs(self) -> None:
        host = socket.gethostname().split(".")[0]
        auth = f"socket={self.socket}"
        self.conf.write_text(f"""# written by tests/slurm_local.py: a single-node cluster under {self.root}
ClusterName={CLUSTER}
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={self.ports['slurmctld']}
SlurmdPort={self.ports['slurmd']}
AuthType=auth/munge
AuthInfo={auth}
CredType=cred/munge
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}
SlurmctldPidFile={self.run / 'slurmctld.pid'}
SlurmdPidFile={self.run / 'slurmd.pid'}
SlurmctldLogFile={self.log / 'slurmctld.log'}
SlurmdLogFile={self.log / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.ports['slurmdbd']}
AccountingStoragePass={self.socket}
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={_real_memory_mb()} State=UNKNOWN
PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        dbd = self.etc / "slurmdbd.conf"  # slurmdbd reads it next to $SLURM_CONF
        dbd.write_text(f"""AuthType=auth/munge
AuthInfo={auth}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.ports['slurmdbd']}
SlurmUser=root
PidFile={self.run / 'slurmdbd.pid'}
LogFile={self.log / 'slurmdbd.log'}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.ports['mariadb']}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        os.chmod(dbd, 0o600)

    def _link_system_conf(self) -> None:
        SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
        if SYSTEM_CONF.exists() or SYSTEM_CONF.is_symlink():
            self._backup = SYSTEM_CONF.with_name(f"slurm.conf.echo-test-{os.getpid()}")
            SYSTEM_CONF.rename(self._backup)
        SYSTEM_CONF.symlink_to(self.conf)
        self._linked = True

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.log / f"{name}.out", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()
        self.procs.append((name, proc))

    def _port_open(self, name: str) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", self.ports[name])) == 0

    def _node_ready(self) -> bool:
        proc = self.cmd("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=20)
        return proc.returncode == 0 and proc.stdout.strip() == "idle"

    def _wait(self, ready, what: str, deadline: float) -> None:
        while not ready():
            dead = [n for n, p in self.procs if _dead(p)]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    # --- looking ---------------------------------------------------------------------------------------

    def logs(self, tail: int = 1500) -> str:
        parts = []
        for path in sorted(self.log.glob("*")) + sorted(self.munge_dir.glob("*.log")):
            if path.is_file():
                parts.append(f"== {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def jobs(self) -> list[dict[str, str]]:
        """Every job accounting knows: JobID, JobName, State, ExitCode, Comment (one row per job)."""
        fields = ["JobID", "JobName", "State", "ExitCode", "Comment"]
        out = self.cmd("sacct", "-X", "-n", "-P", "-a", "-S", "now-1days", f"--format={','.join(fields)}").stdout
        return [dict(zip(fields, line.split("|"), strict=False)) for line in out.splitlines() if line.strip()]

    # --- stop --------------------------------------------------------------------------------------------

    def stop(self, timeout: float = 30) -> float:
        """Stop the daemons started here, newest first, by process id; put /etc/slurm back."""
        t0 = time.monotonic()
        for _name, proc in reversed(self.procs):
            if not _dead(proc):
                proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + timeout
            while not _dead(proc) and time.monotonic() < end:
                time.sleep(0.1)
            if not _dead(proc):
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # munged runs under runuser: its own pid is the child's; runuser forwards SIGTERM to it
        self.procs.clear()
        if self._linked and SYSTEM_CONF.is_symlink():
            SYSTEM_CONF.unlink()
            self._linked = False
        if self._backup is not None and self._backup.exists():
            self._backup.rename(SYSTEM_CONF)
            self._backup = None
        self.timings["stop_s"] = time.monotonic() - t0
        return self.timings["stop_s"]


if __name__ == "__main__":
    print(f"installed in {install():.1f} s")
    with tempfile.TemporaryDirectory(prefix="echo-slurm-") as tmp:
        cluster = LocalSlurm(Path(tmp))
        try:
            print(f"up in {cluster.start():.1f} s; SLURM_CONF={cluster.conf}")
            print(cluster.cmd("sinfo").stdout)
            if sys.stdin.isatty():
                input("Enter stops the cluster ")
        finally:
            print(f"stopped in {cluster.stop():.1f} s")
