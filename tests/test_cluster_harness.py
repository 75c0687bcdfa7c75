"""The simulated cluster of tests/cluster.py does what the cluster tests rely on.

Each node has its own hostname, hosts file, address and local disk; the nodes reach one
another and nothing else; a cut link and dropped packets stop traffic and restoring it
brings it back; and the teardown leaves no namespace, hosts file or process behind, a
process orphaned inside a node included. About 2 s.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import ETC_NETNS, Cluster, require_cluster

pytestmark = pytest.mark.cluster

PORT = 4000
# A server that accepts and closes connections forever, inside node 0.
SERVER = ("import socket\ns = socket.socket()\ns.bind(('0.0.0.0', %d))\ns.listen()\n"
          "while True:\n    s.accept()[0].close()\n" % PORT)


def connects(c: Cluster, node: int, host: str) -> bool:
    """Whether a TCP connection from ``node`` to ``host``:PORT succeeds within a second."""
    probe = f"import socket; socket.create_connection(({host!r}, {PORT}), timeout=1)"
    return c.run(node, [sys.executable, "-c", probe], timeout=30).returncode == 0


def host_links() -> list[str]:
    return [line.split("@")[0] for line in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                                                          check=True).stdout.splitlines()]


def alive(pid: int) -> bool:
    """Running, or stopped: a zombie waiting for its reaper is dead."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for_server(c: Cluster) -> None:
    deadline = time.monotonic() + 20
    while not connects(c, 0, "127.0.0.1"):
        assert time.monotonic() < deadline, "the server in node 0 did not start"


def test_nodes_are_hosts_of_their_own_and_the_teardown_leaves_nothing(tmp_path):
    require_cluster(nft=True)
    local = tmp_path / "local"
    links_before = host_links()
    with Cluster(nodes=2, local_disk=local) as c:
        names = [c.netns(i) for i in range(2)] + [c.bridge_netns]
        probe = "import socket, os; print(socket.gethostname(), socket.gethostbyname('node0'), os.listdir(%r))" % str(local)
        for i in range(2):
            (Path(str(c.disk(i))) / f"only-on-{i}").touch()
            out = c.run(i, [sys.executable, "-c", probe], check=True).stdout.strip().split(maxsplit=2)
            assert out == [f"node{i}", c.address(0), f"['only-on-{i}']"]
        assert list(local.iterdir()) == []  # this host's own directory is untouched

        server = c.popen(0, [sys.executable, "-c", SERVER])
        wait_for_server(c)
        assert connects(c, 1, "node0")
        # Nothing attached to this host's network namespace, and no way out of the nodes'.
        assert host_links() == links_before
        for i in range(2):
            assert c.run(i, ["ip", "route", "show", "default"], check=True).stdout == ""

        c.cut(1)
        assert not connects(c, 1, "node0")
        c.restore(1)
        assert connects(c, 1, "node0")
        c.drop(1, 1.0)  # every packet: deterministic
        assert not connects(c, 1, "node0")
        c.drop(1, 0)
        assert connects(c, 1, "node0")

        # A process whose parent is gone still dies with the cluster: found inside the node.
        parent = c.popen(1, ["sh", "-c", "sleep 600 & echo $!"])
        orphan = int(parent.stdout.readline())
        parent.wait(timeout=30)
        assert orphan in c.pids(1)
    assert server.poll() is not None
    assert not alive(orphan)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed
    assert not any((ETC_NETNS / name).exists() for name in names)
