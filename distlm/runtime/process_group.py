"""The process group of a run: the backend's presets, the group itself, the heartbeat beside it
and every rank's host and node, in that order, once the launch and the settings are known good."""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from distlm.backends.attempt_store import current_attempt
from distlm.backends.base import Backend, uses_agent_store
from distlm.launch.cluster_env import ClusterEnv
from distlm.launch.hosts import nodes_of_ranks, place_by_hosts, this_host
from distlm.runtime.heartbeat import Heartbeat, current_heartbeat, start_heartbeat

logger = logging.getLogger("distlm")


class ProcessGroupStart(NamedTuple):
    """What starting the process group found."""

    env: ClusterEnv
    """The launch as the hosts place it."""
    device: torch.device
    heartbeat: Heartbeat | None
    hosts_line: str | None
    """Where the ranks run, for the log; None in one process."""
    node_of_rank: tuple[int, ...]
    """The node every rank runs on, numbered by each node's lowest rank."""


def start_process_group(env: ClusterEnv, backend: Backend, timeout: datetime.timedelta, trace_dir: Path
                        ) -> ProcessGroupStart:
    """The process group (where more than one rank runs and none exists yet), its heartbeat,
    this rank's device and every rank's host and node. An existing process group (the
    caller's own, or an earlier run's in the same process) is reused."""
    heartbeat = current_heartbeat()
    if env.is_distributed and not dist.is_initialized():
        # Before the process group starts: NCCL reads these when its communicators are made
        # (a single process has none, so nothing to record and no directory to make).
        backend.record_collectives(str(trace_dir))
        backend.init_process_group(env, timeout)
        heartbeat = start_beating(env, timeout)
    # After the process group: a PJRT device learns its place in the job from it. From the
    # launcher's local rank, as setup() chose it: the hosts are known only after a collective.
    device = backend.device(env)
    if not env.is_distributed:
        return ProcessGroupStart(env, device, heartbeat, None, (0,))
    env, node_of_rank, hosts_line = place_ranks_by_hosts(env, heartbeat)
    return ProcessGroupStart(env, device, heartbeat, hosts_line, node_of_rank)


def place_ranks_by_hosts(env: ClusterEnv, heartbeat: Heartbeat | None = None
                         ) -> tuple[ClusterEnv, tuple[int, ...], str]:
    """Every rank's host and launcher node, all-gathered once at start: the nodes where the
    launcher does not say them, a one-line refusal where it says something the hosts
    contradict (``place_by_hosts``), the node of every rank (``nodes_of_ranks``) and the line
    saying what was found. The heartbeat keeps the hosts' names, to name the hosts of ranks
    lost later."""
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, (this_host(), env.node_rank))
    if heartbeat is not None:
        heartbeat.hosts = [host.name for host, _ in gathered]
    launcher_nodes = [node for _, node in gathered]
    placed, line = place_by_hosts(env, [host for host, _ in gathered], launcher_nodes)
    return placed, nodes_of_ranks(placed, launcher_nodes), line


def start_beating(env: ClusterEnv, timeout: datetime.timedelta) -> Heartbeat | None:
    """A beat a tenth of the timeout apart (0.1-2 s): a failed collective names its
    missing ranks within a few beats of the timeout."""
    if not env.is_distributed or env.master_addr is None or env.master_port is None:
        return None
    interval = min(2.0, max(0.1, timeout.total_seconds() / 10))
    agent_store = uses_agent_store(env, os.environ)
    # In torchrun's store, which outlives restarts, each attempt's beats are kept apart by
    # the attempt's id (the restart count differs between nodes: distlm/backends/attempt_store.py).
    attempt = current_attempt() if agent_store else None
    try:
        return start_heartbeat(env.master_addr, env.master_port, env.rank, env.world_size, interval,
                               restart=attempt or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                               store_host=None if agent_store else 0)
    except (RuntimeError, dist.DistStoreError) as err:
        logger.warning("rank %d: no heartbeat side channel (%s); a hung collective will not name its ranks",
                       env.rank, err)
        return None
