"""Which ranks share a host: the hosts themselves (name, boot, network namespace), node
numbering from any per-rank key, and this host's reachable address and free ports."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Hashable, NamedTuple, Sequence

from distlm.errors import UsageError, describe_ranks
from distlm.launch.cluster_env import ClusterEnv


class NodeLayout(NamedTuple):
    """Which ranks share a host, as every rank of the job sees it."""

    node_rank: int
    num_nodes: int
    local_rank: int
    """Position among the ranks of this node, in world-rank order."""
    local_world_size: int
    node_of_rank: tuple[int, ...]
    """Node index of every world rank; nodes are numbered in the order of their lowest world rank."""


def node_layout(rank: int, node_keys: Sequence[Hashable]) -> NodeLayout:
    """The layout of rank ``rank`` given ``node_keys[r]``, any value naming the node of each rank ``r``.

    Nodes are numbered by their lowest world rank (node 0 holds rank 0, node 1 the lowest
    rank not on node 0, ...), so every rank that sees the same keys computes the same
    numbering, whatever the keys are.
    """
    numbering: dict[Hashable, int] = {}
    for key in node_keys:
        numbering.setdefault(key, len(numbering))
    node_of_rank = tuple(numbering[key] for key in node_keys)
    node = node_of_rank[rank]
    return NodeLayout(
        node_rank=node,
        num_nodes=len(numbering),
        local_rank=node_of_rank[:rank].count(node),
        local_world_size=node_of_rank.count(node),
        node_of_rank=node_of_rank,
    )


def ranks_by_node(node_of_rank: Sequence[int]) -> list[list[int]]:
    """World ranks on each node, node by node, each list ascending: (0, 1, 0, 1) -> [[0, 2], [1, 3]].

    With equal ranks per node this is the (nodes, ranks per node) rank grid of a
    hierarchical all-reduce: rows are the intra-node groups, columns the inter-node ones
    (``DeviceMesh(device, torch.tensor(ranks_by_node(...)), mesh_dim_names=("node", "local"))``).
    """
    nodes: list[list[int]] = [[] for _ in range(max(node_of_rank, default=-1) + 1)]
    for rank, node in enumerate(node_of_rank):
        nodes[node].append(rank)
    return nodes


def nodes_of_ranks(placed: ClusterEnv, launcher_nodes: Sequence[int]) -> tuple[int, ...]:
    """The node every rank runs on, numbered by each node's lowest rank, from what the start
    gathers anyway: where the hosts (or MPI) placed the ranks, ``placed.node_of_rank``; else the
    launcher's node of every rank, ``launcher_nodes`` (each rank's ``node_rank``, all-gathered)."""
    if placed.node_of_rank is not None:
        return tuple(placed.node_of_rank)
    return node_layout(placed.rank, launcher_nodes).node_of_rank


class Host(NamedTuple):
    """The host a process runs on, as every rank can compare it."""

    name: str
    boot_id: str
    """This boot of this machine; a host name alone repeats across containers and images."""
    netns: int
    """The network namespace's inode: processes of one machine that reach each other only over
    the network (containers, pods, simulated nodes) are separate hosts."""


def boot_id() -> str | None:
    """This boot of this machine (Linux), None elsewhere."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def this_host() -> Host:
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return Host(socket.gethostname(), boot_id() or "", netns)


def place_by_hosts(env: ClusterEnv, hosts: Sequence[Host], launcher_nodes: Sequence[int]) -> tuple[ClusterEnv, str]:
    """``env`` with its node checked against, or taken from, the host of every rank; and a log line.

    ``hosts[r]`` and ``launcher_nodes[r]`` are rank r's ``this_host()`` and ``node_rank`` as
    its launcher gave it, all-gathered at start. Where the launcher does not say which
    ranks share a node (``env.nodes_assumed``: fairseq's flags and ``env://`` assume one
    process per host, torchrun variables without ``GROUP_RANK`` consecutive ranks), the
    hosts decide: node, local rank and ``node_of_rank`` become theirs, nodes numbered by
    their lowest rank. Where the launcher does say, the ranks it puts on one node must run
    on one host, else a one-line ``UsageError`` (every rank raises it alike): grouping them
    would send a hierarchical hook's intra-node leg over the network. Several of its nodes
    on one host are accepted: that is how several agents on one machine (and the tests'
    stand-ins) simulate nodes, and it only forgoes shared memory, never correctness.
    """
    if len(hosts) != env.world_size or len(launcher_nodes) != env.world_size:
        raise ValueError(f"one host and node per rank: {len(hosts)}, {len(launcher_nodes)} for {env.world_size} ranks")

    def listing(ranks: Sequence[int], most: int = 3) -> str:
        groups: dict[Host, list[int]] = {}
        for rank in ranks:
            groups.setdefault(hosts[rank], []).append(rank)
        shown = [f"{host.name}: {describe_ranks(members)}" for host, members in list(groups.items())[:most]]
        more = f" and {len(groups) - most} more" if len(groups) > most else ""
        return "; ".join(shown) + more

    found = node_layout(env.rank, hosts)
    if env.nodes_assumed is not None:
        placed = replace(env, node_rank=found.node_rank, num_nodes=found.num_nodes, local_rank=found.local_rank,
                         local_world_size=found.local_world_size, node_of_rank=found.node_of_rank,
                         nodes_assumed=None)
        return placed, (f"{found.num_nodes} node{'s' if found.num_nodes > 1 else ''} found from the hosts "
                        f"({listing(range(env.world_size))}); launcher {env.launcher} does not say which ranks "
                        "share a node")
    claimed: dict[int, list[int]] = {}
    for rank, node in enumerate(launcher_nodes):
        claimed.setdefault(node, []).append(rank)
    for node, ranks in claimed.items():
        if len({hosts[rank] for rank in ranks}) > 1:
            raise UsageError(
                f"launcher {env.launcher} puts {describe_ranks(ranks)} on node {node}, but they run on "
                f"{len({hosts[rank] for rank in ranks})} hosts ({listing(ranks)}); the ranks of a node must share "
                "a host: start one launcher per host (torchrun --node-rank, srun --ntasks-per-node) or correct "
                "the node variables exported by hand"
            )
    return env, (f"{len(claimed)} node{'s' if len(claimed) > 1 else ''} from launcher {env.launcher}, on "
                 f"{found.num_nodes} host{'s' if found.num_nodes > 1 else ''} ({listing(range(env.world_size))})")


def find_free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Another process can take it before we bind again; callers that can should pass
    port 0 to the server itself instead (TCPStore does, for a single process).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def routable_address() -> str:
    """An address of this host that other nodes can reach, best effort.

    The hostname's address unless it resolves to loopback (Debian maps the hostname to
    127.0.1.1); then the address of the interface holding the default route (a UDP
    connect sends no packet); the bare hostname as a last resort.
    """
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
            if not address.startswith("127.") and address != "0.0.0.0":
                return address
    except OSError:
        pass
    return hostname
