"""A real Slurm (Debian's slurm-wlm) on the simulated nodes of tests/cluster.py.

slurmctld runs on node 0, one slurmd on every node (``-N nodeI``, its own spool, pid and
log file), one munged on every node with one shared key; no accounting, no database::

    from slurm_cluster import require_slurm, slurm_cluster

    require_slurm()                                     # a one-line skip where it cannot run here
    with slurm_cluster(nodes=3) as slurm:               # a Cluster (slurm.cluster) with Slurm up
        job = slurm.sbatch(["--nodes=2", "kit.sbatch"], env=env, cwd=repo)   # the job id
        slurm.wait(job, lambda info: info["JobState"] == "COMPLETED", timeout=120)
        slurm.job(job)                                  # scontrol show job, as a dict
        slurm.command(["scontrol", "requeue", job])     # any client command, inside node 0

``SlurmCluster(cluster)`` alone needs a Cluster made with ``local_disk`` in a directory
that others may enter: each node's munged puts its socket there, so every process of a
node (daemons, job steps) talks to its own node's munged at the one path slurm.conf names.

The settings slurmd needs inside a network namespace, where ``ip netns exec`` remounts
``/sys`` without the cgroup file system: ``CgroupPlugin=cgroup/v1`` (slurmd otherwise
stops with "No filesystem mounted on /sys/fs/cgroup"; 22.05 has no ``disabled``, and
``cgroup/v2`` refuses this host), ``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``, and ``SlurmdParameters=config_overrides`` so the nodes'
declared sockets and cores count, not what slurmd finds. A requeued job waits for its
old credential to expire and for the next scheduling pass (about 141 s by default):
``cred_expire=5`` and ``sched_interval=2`` bring that to about 7 s (a step is launched
within a second of its credential here).

Client commands work only inside a node's namespace (the node names resolve there) and
retry for a minute when something is wrong, and a job that asks for more than the
cluster has can pend forever: every command here runs under ``timeout`` and every wait
has a deadline. The daemons run in the foreground (``-D``, ``-F``), so the process started
is the daemon; leaving the ``with`` block kills each by pid, and the cluster's own
teardown then kills whatever else runs inside the nodes (job steps included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from cluster import Cluster, require_cluster

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
# A client command here answers in well under a second; past this it is retrying something.
COMMAND_TIMEOUT = 20
# The cluster comes up in 2-3 s.
START_TIMEOUT = 60
CPUS_PER_NODE = 2
# GPUs in name only (device files that are /dev/null): the kits ask for them
# (--gpus-per-node=8), and the jobs train on the CPU.
GPUS_PER_NODE = 8
# Seconds between a job's SIGTERM and its SIGKILL (Slurm's default): a save on SIGTERM must end within it.
KILL_WAIT = 30


def slurm_unavailable() -> str | None:
    """Why no Slurm can run here (one line), or None."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install slurm-wlm munge)"
    return None


def require_slurm() -> None:
    """Skip, saying why in one line, where no cluster or no Slurm can run here."""
    require_cluster()
    reason = slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def slurm_cluster(nodes: int) -> Iterator["SlurmCluster"]:
    """A cluster of ``nodes`` simulated nodes with Slurm up, torn down on leaving."""
    local = Path(tempfile.mkdtemp(prefix="distlm-slurm-local-"))
    local.chmod(0o755)  # munged refuses a socket under a directory that others cannot enter
    try:
        with Cluster(nodes=nodes, local_disk=local) as cluster, SlurmCluster(cluster) as slurm:
            yield slurm
    finally:
        shutil.rmtree(local, ignore_errors=True)


class SlurmCluster:
    """slurmctld, slurmd and munged on the nodes of ``cluster``; see the module docstring."""

    def __init__(self, cluster: Cluster):
        if cluster.local_disk is None:
            raise ValueError("SlurmCluster needs a Cluster made with local_disk (each node's munge socket lives there)")
        self.cluster = cluster
        self.root = cluster.workdir / "slurm"
        self.conf = self.root / "slurm.conf"
        self.munge_socket = cluster.local_disk / "munge.socket"
        self._daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """What a client command needs beside the environment: where slurm.conf is."""
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> None:
        c = self.cluster
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)  # munged refuses a key others can read
        for i in range(c.nodes):
            (self.root / f"spool-{c.hostname(i)}").mkdir(exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        self.conf.write_text(self._slurm_conf())
        # Both read from slurm.conf's directory.
        (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        for g in range(GPUS_PER_NODE):
            # Slurm takes only device files; these are /dev/null's twins (major 1, minor 3).
            os.mknod(self.root / f"gpu{g}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        (self.root / "gres.conf").write_text(f"Name=gpu File={self.root}/gpu[0-{GPUS_PER_NODE - 1}]\n")
        env = {**os.environ, **self.env}

        for i in range(c.nodes):
            self._start(i, ["munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
                            f"--pid-file={self.munge_socket}.pid", f"--seed-file={self.munge_socket}.seed",
                            f"--log-file={self.root / f'munged-{c.hostname(i)}.log'}"], env)
        for i in range(c.nodes):
            self._until(lambda: (c.disk(i) / self.munge_socket.name).exists(), START_TIMEOUT,
                        f"munged on {c.hostname(i)} made no socket")
        self._start(0, ["slurmctld", "-D", "-f", str(self.conf)], env)
        for i in range(c.nodes):
            self._start(i, ["slurmd", "-D", "-N", c.hostname(i), "-f", str(self.conf)], env)
        self._until(lambda: self.command(["sinfo", "--noheader", "--format=%T %D"], check=False).stdout.split()
                    == ["idle", str(c.nodes)], START_TIMEOUT, f"the {c.nodes} nodes did not all become idle")

    def _slurm_conf(self) -> str:
        c, root = self.cluster, self.root
        nodes = "".join(
            f"NodeName={c.hostname(i)} NodeAddr={c.address(i)} CPUs={CPUS_PER_NODE} Sockets=1 "
            f"CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN\n"
            for i in range(c.nodes))
        return (
            "ClusterName=distlm\n"
            f"SlurmctldHost={c.hostname(0)}({c.address(0)})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={self.munge_socket},cred_expire=5\n"
            f"StateSaveLocation={root / 'state'}\n"
            f"SlurmdSpoolDir={root}/spool-%n\n"
            f"SlurmctldPidFile={root}/slurmctld.pid\nSlurmdPidFile={root}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={root}/slurmctld.log\nSlurmdLogFile={root}/slurmd-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SlurmdParameters=config_overrides\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            "JobCompType=jobcomp/none\n"
            "SchedulerType=sched/backfill\nSchedulerParameters=sched_interval=2\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "MpiDefault=none\nReturnToService=2\nGresTypes=gpu\n"
            "MinJobAge=3600\n"  # scontrol still shows a job that ended this long ago
            f"KillWait={KILL_WAIT}\n"
            f"{nodes}"
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _start(self, node: int, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.root / f"{argv[0]}-{self.cluster.hostname(node)}.out", "w")
        try:
            self._daemons.append(self.cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        finally:
            log.close()  # the daemon holds its own copy
        # A daemon that refuses its settings exits at once; say so with its own words.
        time.sleep(0.05)
        if self._daemons[-1].poll() is not None:
            raise RuntimeError(f"{argv[0]} on {self.cluster.hostname(node)} exited "
                               f"{self._daemons[-1].returncode}: {self.diagnostics()}")

    def _until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout} s: {self.diagnostics()}")
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{' '.join(daemon.args[-4:])} exited {daemon.returncode}: {self.diagnostics()}")
            time.sleep(0.2)

    def close(self) -> None:
        """Kill every daemon by its pid; the cluster's teardown ends the rest (job steps)."""
        for daemon in self._daemons:
            if daemon.poll() is None:
                try:
                    os.kill(daemon.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._daemons.clear()

    def diagnostics(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for a failure message."""
        parts = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            if tail:
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # ------------------------------------------------------------------ clients

    def command(self, argv: Sequence[str], node: int = 0, env: dict[str, str] | None = None,
                cwd: str | os.PathLike | None = None, check: bool = True) -> subprocess.CompletedProcess:
        """A client command inside ``node`` under ``timeout``; ``check`` fails on a non-zero exit."""
        full_env = {**(os.environ if env is None else env), **self.env}
        done = self.cluster.run(node, ["timeout", str(COMMAND_TIMEOUT), *argv], env=full_env, cwd=cwd,
                                timeout=COMMAND_TIMEOUT + 10)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, argv: Sequence[str], env: dict[str, str], cwd: str | os.PathLike) -> str:
        """Submit a batch job from node 0 with ``env`` (sbatch passes it to the job); its id."""
        return self.command(["sbatch", "--parsable", *argv], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, NodeList...)."""
        text = self.command(["scontrol", "show", "job", "--oneliner", job_id]).stdout
        return dict(word.split("=", 1) for word in text.split() if "=" in word)

    def wait(self, job_id: str, done: Callable[[dict[str, str]], bool], timeout: float, poll: float = 0.5) -> dict:
        """Poll the job until ``done(fields)``; past ``timeout`` cancel it and fail with its state."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if done(info):
                return info
            if time.monotonic() > deadline:
                self.command(["scancel", job_id], check=False)
                raise AssertionError(f"job {job_id} not done within {timeout} s: JobState={info.get('JobState')} "
                                     f"Reason={info.get('Reason')}\n{self.diagnostics()}")
            time.sleep(poll)
