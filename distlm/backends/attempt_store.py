"""The process group's store under torchrun: rank 0's own, found through the agent's store.

torchrun's agent serves a TCPStore at MASTER_ADDR:MASTER_PORT that outlives its workers,
so after a restart it still holds the previous attempt's keys, gloo's addresses among
them; workers that read those fail ("connectFullMesh ... Connection refused") or hang.
A prefix keyed by ``TORCHELASTIC_RESTART_COUNT`` kept the attempts apart on one node, but
across nodes the agents count differently: the agent whose worker failed counts a
restart, while the agent that restarts its healthy workers because the other node came
back to the rendezvous does not (torch's "membership change"). Rank 0 then waited in
``restart0``, where the previous attempt's addresses sent gloo to a dead peer until its
connect timeout, and rank 1 in ``restart1``, where nobody came.

So rank 0 of every attempt serves a store of its own on a port the OS picks, as under
srun, mpiexec or fairseq's flags, and announces that port in the agent's store under one
key. The other ranks connect to the announced port. An announcement left by an attempt
that is over names a port nobody listens on any more (its rank 0 was stopped before the
agents met again), and a store that already holds this rank's mark was joined by this
rank's previous process (its rank 0 still runs: a static rendezvous restarts each node on
its own); both are waited past until the new rank 0 announces.

After a restart, a rank waits longer than ``--timeout-sec`` for its peers: long enough
for a peer to notice the failure (``--timeout-sec``) and for that peer's agent to stop it
and start its successor (``RESTART_ALLOWANCE_SEC``), and says so in the log.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import socket
import time
from typing import Mapping

import torch.distributed as dist

logger = logging.getLogger("distlm")

ANNOUNCEMENT_KEY = "distlm/rank0-store"
_JOINED = "distlm/joined/"
_PG_PREFIX = "distlm/pg"
# torchrun's agent gives a worker 30 s to end after SIGTERM before it kills it, and a new
# worker takes seconds to import torch and reach its process group.
RESTART_ALLOWANCE_SEC = 60.0
_POLL_SEC = 0.1

_attempt: str | None = None


class StoreWaitTimeout(RuntimeError):
    """A rank did not find the others in time; the message says who it waited for."""


def current_attempt() -> str | None:
    """The id of the attempt this process joined (rank 0's announcement), None before it
    joined one: the heartbeat keeps each attempt's beats apart with it."""
    return _attempt


def restart_wait_sec(timeout_sec: float) -> float:
    """How long a rank of a restarted attempt waits for its peers."""
    return 2 * timeout_sec + RESTART_ALLOWANCE_SEC


def join_attempt(master_addr: str, agent_port: int, rank: int, world_size: int, timeout: datetime.timedelta,
                 environ: Mapping[str, str]) -> dist.Store:
    """The store of this attempt's process group, every rank joined (rank 0 waits for them)."""
    global _attempt
    agent = dist.TCPStore(master_addr, agent_port, is_master=False, timeout=timeout)
    count = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    restarted = count not in ("", "0")
    if rank == 0:
        restarted = restarted or agent.check([ANNOUNCEMENT_KEY])
        wait = restart_wait_sec(timeout.total_seconds()) if restarted else timeout.total_seconds()
        server = dist.TCPStore(master_addr, 0, None, is_master=True, timeout=timeout, wait_for_workers=False)
        announcement = f"{server.port} {secrets.token_hex(8)}"
        agent.set(ANNOUNCEMENT_KEY, announcement)
        if restarted:
            logger.warning("rank 0: torchrun restarted the job (restart %s here); waiting up to %g s for ranks 1-%d "
                           "(2 x --timeout-sec + %g s for their agents to restart them)", count, wait,
                           world_size - 1, RESTART_ALLOWANCE_SEC)
        _wait_for_marks(server, world_size, wait)
    else:
        server, announcement = _join_rank0(agent, master_addr, rank, timeout, count, restarted)
    _attempt = announcement.split()[1]
    return dist.PrefixStore(_PG_PREFIX, server)


def _wait_for_marks(server: dist.Store, world_size: int, wait: float) -> None:
    keys = [f"{_JOINED}{peer}" for peer in range(1, world_size)]
    deadline = time.monotonic() + wait
    while not server.check(keys):
        if time.monotonic() >= deadline:
            missing = [peer for peer, key in zip(range(1, world_size), keys) if not server.check([key])]
            raise StoreWaitTimeout(
                f"ranks {missing} did not join rank 0's store within {wait:g} s: they did not start, "
                "or cannot reach this host (their own output says why)")
        time.sleep(_POLL_SEC)


def _join_rank0(agent: dist.Store, master_addr: str, rank: int, timeout: datetime.timedelta, count: str,
                restarted: bool) -> tuple[dist.Store, str]:
    """Rank 0's store of this attempt, this rank's mark in it, and its announcement."""
    started = time.monotonic()
    wait = restart_wait_sec(timeout.total_seconds()) if restarted else timeout.total_seconds()
    passed: set[str] = set()
    said = False
    while True:
        announcement = agent.get(ANNOUNCEMENT_KEY).decode() if agent.check([ANNOUNCEMENT_KEY]) else None
        if announcement is not None and announcement not in passed:
            store = _connect(master_addr, int(announcement.split()[0]), timeout)
            if store is not None and store.add(f"{_JOINED}{rank}", 1) == 1:
                return store, announcement
            passed.add(announcement)  # the previous attempt's: its rank 0 is gone, or was joined by this rank before
            if not said:
                wait = max(wait, restart_wait_sec(timeout.total_seconds()))
                logger.warning("rank %d: rank 0's store at %s is the previous attempt's (restart %s here); waiting "
                               "up to %g s for the new rank 0 (2 x --timeout-sec + %g s for its agent to restart it)",
                               rank, f"{master_addr}:{announcement.split()[0]}", count, wait, RESTART_ALLOWANCE_SEC)
                said = True
        if time.monotonic() - started >= wait:
            raise StoreWaitTimeout(
                f"rank 0 did not announce a store in torchrun's agent store at {master_addr} within "
                f"{wait:g} s: rank 0 did not start, or died before it got there (its own output says why)")
        time.sleep(_POLL_SEC)


def _connect(host: str, port: int, timeout: datetime.timedelta) -> dist.Store | None:
    """A client of the store at ``host:port``, or None when nothing listens there."""
    try:
        socket.create_connection((host, port), timeout=5.0).close()
    except OSError:
        return None
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except (dist.DistError, RuntimeError):  # it went away between the two
        return None
