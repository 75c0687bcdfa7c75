"""A simulated cluster for tests: N "nodes" on this machine, each a Linux network namespace.

Every node has its own address, hostname, hosts file and, on request, its own local disk,
and the nodes reach one another only through a bridge of their own, so traffic between
them crosses a real (virtual) network that a test can cut or make lossy::

    from cluster import Cluster, require_cluster

    pytestmark = pytest.mark.cluster    # the suite's marker for these tests

    def test_two_nodes(tmp_path):
        require_cluster()               # a skip with one line saying why, where no cluster can be built
        with Cluster(nodes=2, local_disk=tmp_path / "local") as c:
            c.address(1)                # "10.213.0.2": node 1's address, reachable from every node
            c.hostname(1)               # "node1": its hostname, in every node's hosts file
            c.run(1, ["hostname"])      # CompletedProcess; stdout "node1\\n"
            p = c.popen(0, [sys.executable, "-m", "distlm.train", ...], env=env)   # a tracked Popen
            c.cut(1); c.restore(1)      # node 1's link down / up
            c.drop(1, 0.01)             # drop 1 % of node 1's packets (0 stops dropping)
            c.disk(1)                   # where node 1's local disk lives, seen from this host

API (``i`` is a node index, 0 .. nodes-1):

``Cluster(nodes=2, local_disk=None, workdir=None)``
    A context manager; entering builds the cluster (about a second), leaving tears it
    down. ``local_disk`` is a path of this machine (created if missing) that every node
    sees as a directory of its own, ``disk(i)`` here: a private mount namespace per
    command with a bind mount over it, as a cluster without a shared file system has.
    Every other path is shared by all nodes, as on a cluster with NFS or FSx.
``address(i)``, ``hostname(i)``, ``disk(i)``
    Node i's IPv4 address (``SUBNET``.i+1), hostname (``node{i}``) and local disk (None
    without ``local_disk``).
``enter(i)``
    The argv prefix that runs a command inside node i: its network namespace, hostname,
    hosts file (``/etc/netns/NAME/hosts``, bind-mounted by ``ip netns exec``) and disk.
``popen(i, argv, env=None, cwd=None, **popen_kwargs)``
    ``subprocess.Popen`` of ``argv`` inside node i, text mode, stdout and stderr piped
    unless given, in a session of its own. The cluster kills it at teardown.
``run(i, argv, env=None, cwd=None, timeout=120, check=False)``
    ``popen`` and wait: a ``CompletedProcess``; past ``timeout`` its process group is
    killed and ``subprocess.TimeoutExpired`` raised with the output so far.
``cut(i)``, ``restore(i)``
    Take node i's link down / up (a pulled cable: packets vanish, nothing is refused).
``drop(i, share)``
    Drop ``share`` (0-1, in steps of 0.001) of the packets node i sends or receives over
    its link, at random (nftables: this kernel has no ``sch_netem``); ``share=0`` stops.
``pids(i)``
    The processes now running inside node i (whoever started them).
``rsh_agent()``, ``hostfile(slots)``
    For OpenMPI across the nodes without ssh: ``mpiexec --hostfile HOSTFILE --mca
    plm_rsh_agent AGENT`` from inside node 0; the agent starts each remote daemon inside
    its node with ``enter``.
``kill_session(proc)``
    SIGKILL a command ``popen`` started, with everything in its session, if it still runs.
``close()``
    The teardown, also run on leaving the ``with`` block (a failed or timed-out test
    included) and at interpreter exit: kill every process it started and every process
    inside its nodes (by pid, SIGKILL), delete the namespaces (their nft tables with them)
    and the bridge's, the ``/etc/netns`` directories and ``workdir``. A cluster whose test
    process was killed outright is swept (processes, namespaces, hosts files) by the next
    cluster built on this machine.

Names are ``distlm-PID-SEQ-...`` (this process's pid, a counter), so two test runs, or two
clusters of one run, never collide. Nothing is attached to this host's own network
namespace (the bridge lives in a namespace of its own, and no node has a default route),
so nothing the nodes do can reach this host's network or another machine.

Needs root, ``ip`` (iproute2), ``unshare`` (util-linux) and, for ``drop``, ``nft``
(nftables): README command (b) installs them. ``cluster_unavailable()`` says why a
cluster cannot be built here, and ``require_cluster()`` turns that into a skip.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Sequence

import pytest

# A private /24 of our own; the nodes are alone on it, in namespaces of their own.
SUBNET = "10.213.0"
PREFIX = "distlm"
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+-")
_sequence = itertools.count()
_live: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


def cluster_unavailable(need_nft: bool = False) -> str | None:
    """Why no cluster can be built here (one line), or None when one can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces); CI runs the suite as root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")) + ((("nft", "nftables"),) if need_nft else ()):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install {package})"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns is unavailable here: {(made.stderr.strip().splitlines() or ['no reason given'])[-1]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_cluster(nft: bool = False) -> None:
    """Skip the calling test or fixture, saying why in one line, where no cluster can be built
    here; ``nft=True`` where it drops packets. Called where the cluster is needed (a module
    fixture), not at import: ranks that import a test module for its functions probe nothing."""
    reason = cluster_unavailable(need_nft=nft)
    if reason is not None:
        pytest.skip(reason)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _pids_in(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove_namespaces(names: Sequence[str]) -> None:
    """Kill every process inside ``names`` (by pid, until none is left), then delete them."""
    for _ in range(20):
        pids = [pid for name in names for pid in _pids_in(name)]
        if not pids:
            break
        for pid in pids:
            _kill(pid)
        time.sleep(0.05)
    for name in names:
        _ip("netns", "del", name, check=False)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def _sweep_dead_owners() -> None:
    """Clusters left by a test process that died without its teardown (SIGKILL, power)."""
    if not NETNS_DIR.is_dir():
        return
    stale: list[str] = []
    for path in NETNS_DIR.iterdir():
        match = _NAME.match(path.name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            stale.append(path.name)
    _remove_namespaces(stale)


class Cluster:
    """N simulated nodes joined by a bridge; see the module docstring."""

    def __init__(self, nodes: int = 2, local_disk: str | os.PathLike | None = None,
                 workdir: str | os.PathLike | None = None):
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be 1-250, got {nodes}")
        self.nodes = nodes
        self.name = f"{PREFIX}-{os.getpid()}-{next(_sequence)}"
        self.local_disk = Path(local_disk).resolve() if local_disk is not None else None
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-") if workdir is None else workdir)
        self._procs: list[subprocess.Popen] = []
        self._dropping: set[int] = set()
        self._closed = False
        self._built = False

    # ------------------------------------------------------------------ names

    def netns(self, i: int) -> str:
        return f"{self.name}-n{self._index(i)}"

    @property
    def bridge_netns(self) -> str:
        return f"{self.name}-br"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{self._index(i) + 1}"

    def hostname(self, i: int) -> str:
        return f"node{self._index(i)}"

    def disk(self, i: int) -> Path | None:
        return None if self.local_disk is None else self.workdir / f"disk{self._index(i)}"

    def _index(self, i: int) -> int:
        if not 0 <= i < self.nodes:
            raise IndexError(f"node {i} is not one of the cluster's {self.nodes}")
        return i

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> None:
        reason = cluster_unavailable()
        if reason is not None:
            raise RuntimeError(f"cannot build a cluster: {reason}")
        _sweep_dead_owners()
        _live.add(self)
        self._built = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        bridge = self.bridge_netns
        _ip("netns", "add", bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(i)} {self.hostname(i)}\n" for i in range(self.nodes))
        if self.local_disk is not None:
            self.local_disk.mkdir(parents=True, exist_ok=True)
        for i in range(self.nodes):
            netns = self.netns(i)
            _ip("netns", "add", netns)
            # The veth pair is made inside the bridge's namespace with its peer moved straight
            # into the node's: no end of it ever exists in this host's namespace.
            _ip("-n", bridge, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("-n", bridge, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", netns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            (ETC_NETNS / netns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / netns / "hosts").write_text(hosts)
            if self.local_disk is not None:
                self.disk(i).mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Tear everything down; safe to call more than once, and after a failed start."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        if self._built:
            for proc in self._procs:
                # Alive (not yet reaped), so its pid is still its own: kill its whole session.
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        _kill(proc.pid)
            # Then whatever runs inside the nodes: workers a killed agent orphaned, MPI daemons.
            _remove_namespaces([self.netns(i) for i in range(self.nodes)] + [self.bridge_netns])
            for proc in self._procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ commands

    def enter(self, i: int) -> list[str]:
        """argv prefix: run the rest inside node i (namespace, hostname, hosts file, local disk)."""
        setup = f"hostname {shlex.quote(self.hostname(i))}"
        if self.local_disk is not None:
            setup += f" && mount --bind {shlex.quote(str(self.disk(i)))} {shlex.quote(str(self.local_disk))}"
        # A mount namespace of our own (private, so the bind mount never reaches this host),
        # and a UTS namespace for the hostname; `exec` keeps the command's pid the one we started.
        return ["ip", "netns", "exec", self.netns(i), "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", setup + ' && exec "$@"', "-"]

    def popen(self, i: int, argv: Sequence[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
              **kwargs) -> subprocess.Popen:
        if self._closed or not self._built:
            raise RuntimeError("the cluster is not running (use it inside its with block)")
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        proc = subprocess.Popen([*self.enter(i), *map(str, argv)], env=env, cwd=cwd, start_new_session=True,
                                **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
            timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        proc = self.popen(i, argv, env=env, cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def pids(self, i: int) -> list[int]:
        return _pids_in(self.netns(i))

    # ------------------------------------------------------------------ faults

    def cut(self, i: int) -> None:
        _ip("-n", self.netns(i), "link", "set", "eth0", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.netns(i), "link", "set", "eth0", "up")

    def drop(self, i: int, share: float) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"share must be within 0-1, got {share}")
        per_mille = round(share * 1000)
        nft = ["ip", "netns", "exec", self.netns(i), "nft"]
        if i in self._dropping:
            subprocess.run([*nft, "delete", "table", "inet", "distlm_drop"], capture_output=True, check=True)
            self._dropping.discard(i)
        if per_mille == 0:
            return
        # Only the link: traffic between the ranks of one node (loopback) is not the network's.
        chance = "" if per_mille == 1000 else f"numgen random mod 1000 < {per_mille} "  # nft's range: 0-999
        rules = (
            "table inet distlm_drop {\n"
            f"  chain in {{ type filter hook input priority 0; iifname \"eth0\" {chance}drop; }}\n"
            f"  chain out {{ type filter hook output priority 0; oifname \"eth0\" {chance}drop; }}\n"
            "}\n"
        )
        done = subprocess.run([*nft, "-f", "-"], input=rules, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft in {self.hostname(i)}: {done.stderr.strip()}")
        self._dropping.add(i)

    # ------------------------------------------------------------------ MPI

    def rsh_agent(self) -> Path:
        """A script for OpenMPI's ``--mca plm_rsh_agent``: ``AGENT HOST COMMAND...`` runs
        COMMAND with a shell inside HOST's node, as ssh would on a real cluster."""
        path = self.workdir / "rsh-agent"
        cases = "".join(f"  {self.hostname(i)}) set -- {shlex.join(self.enter(i))} sh -c \"$*\" ;;\n"
                        for i in range(self.nodes))
        path.write_text(
            "#!/bin/sh\n"
            "host=$1; shift\n"
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "rsh-agent: no node $host" >&2; exit 255 ;;\n'
            "esac\n"
            'exec "$@"\n'
        )
        path.chmod(0o755)
        return path

    def hostfile(self, slots: int) -> Path:
        path = self.workdir / f"hostfile-{slots}"
        path.write_text("".join(f"{self.hostname(i)} slots={slots}\n" for i in range(self.nodes)))
        return path


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session (a command the cluster started: it leads its own) if it still runs."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@atexit.register
def _close_all() -> None:
    # pytest normally tears clusters down with their fixtures; this covers an interpreter
    # that exits with a cluster still up (an error while building a fixture, ^C).
    for cluster in list(_live):
        cluster.close()
