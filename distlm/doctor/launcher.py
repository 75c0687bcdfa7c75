"""Check: every rank detected the same launch (launcher, world size, master, nodes, torch)."""

from __future__ import annotations

import platform
import socket
from typing import Any, Sequence

import torch

from distlm.doctor.channel import RankChannel
from distlm.doctor.report import FAIL, PASS, Row, count, format_ranks, ranks_by_value, who
from distlm.launch.cluster_env import ClusterEnv

NAME = "launcher"

# What every rank must see alike, and how a disagreement reads.
_SHARED_FIELDS = (
    ("launcher", "launcher"),
    ("world_size", "world size"),
    ("master", "master"),
    ("num_nodes", "node count"),
    ("torch", "torch"),
)


def probe_launch(env: ClusterEnv) -> dict[str, Any]:
    """What this rank detected, as plain values every rank can compare."""
    master = f"{env.master_addr}:{env.master_port}" if env.master_port is not None else str(env.master_addr)
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "launcher": env.launcher,
        "master": master,
        "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "node_rank": env.node_rank,
        "num_nodes": env.num_nodes,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def judge_launch(reports: Sequence[dict[str, Any]], description: str) -> Row:
    """FAIL naming the ranks that disagree on the launch or on their node; PASS with rank 0's view."""
    hosts = [report["host"] for report in reports]
    problems: list[str] = []
    for position, report in enumerate(reports):
        if report["rank"] != position:
            problems.append(f"process {position} of the group detected rank {report['rank']}")
    for key, label in _SHARED_FIELDS:
        groups = ranks_by_value([report[key] for report in reports])
        if len(groups) > 1:
            problems.append(
                f"ranks disagree on the {label}: "
                + "; ".join(f"{value} on {who(ranks, hosts)}" for value, ranks in groups.items())
            )
    problems += _node_problems(reports)
    nodes = len(set(hosts))
    data = {"ranks": list(reports)}
    if problems:
        return Row(NAME, FAIL, "; ".join(problems), data)
    first = reports[0]
    return Row(
        NAME,
        PASS,
        f"{description}; every rank agrees ({count(len(reports), 'rank')} on {count(nodes, 'host')}, "
        f"torch {first['torch']}, Python {first['python']})",
        data,
    )


def _node_problems(reports: Sequence[dict[str, Any]]) -> list[str]:
    """A node index must mean one host, and its ranks must number 0..k-1 with k = local world size."""
    hosts = [report["host"] for report in reports]
    problems = []
    for node, ranks in ranks_by_value([report["node_rank"] for report in reports]).items():
        node_hosts = sorted({hosts[rank] for rank in ranks})
        if len(node_hosts) > 1:
            problems.append(f"node {node} spans hosts {', '.join(node_hosts)} ({who(ranks, hosts)})")
        local_ranks = sorted(reports[rank]["local_rank"] for rank in ranks)
        sizes = {reports[rank]["local_world_size"] for rank in ranks}
        if local_ranks != list(range(len(ranks))) or sizes != {len(ranks)}:
            problems.append(
                f"node {node} runs ranks {format_ranks(ranks)} with local ranks {local_ranks} and local world "
                f"size {'/'.join(str(size) for size in sorted(sizes))}; the launcher's per-node counts are wrong"
            )
    return problems


def check_launcher(channel: RankChannel, env: ClusterEnv) -> list[Row]:
    """Gather every rank's launch and judge it (collective)."""
    reports = channel.gather(probe_launch(env), NAME)
    return [judge_launch(reports, env.describe())]
