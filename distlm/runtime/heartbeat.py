"""A side channel that names the ranks a hung collective is waiting for.

Every rank publishes, from a daemon thread, a beat counter and how far it got (the
update it entered and the last it completed) into the rendezvous store, under a prefix
of its own. A thread keeps beating while the main thread waits in a collective (which
releases the GIL), so when a collective times out the ranks that are still alive say
where they are. A rank that was stopped (SIGSTOP), died, or hangs with the GIL held
stops beating. Counters rather than clock times, so hosts need no common clock. Every
rank's host, gathered at start, names the host a rank lost, even once the store is out of
reach.

The store lives where the process group's rendezvous store lives: in torchrun's agent,
or (srun, mpiexec, a Kubeflow PyTorchJob, fairseq's flags) in rank 0's own process. Then
a stopped rank 0 takes the store with it, and the waiting ranks name rank 0 for that.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

_PREFIX = "distlm/heartbeat"

# The side channel of the default process group, of which a process has one: runs that
# reuse the group (several Trainers in one process) share its heartbeat.
_running: "Heartbeat | None" = None


@dataclass(frozen=True)
class RankState:
    rank: int
    entered: int
    """The update this rank started last (0: none)."""
    completed: int
    """The update this rank finished last."""
    beating: bool
    """Its beat counter moved while we watched: the process runs."""


class Heartbeat:
    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, interval: float,
                 restart: str = "0", store_host: int | None = None):
        self.rank, self.world_size, self.interval = rank, world_size, interval
        self.store_host = store_host
        """The rank whose process serves the store; None when the launcher's agent does."""
        store = dist.TCPStore(master_addr, master_port, is_master=False,
                              timeout=datetime.timedelta(seconds=max(10.0, 4 * interval)))
        self.store = dist.PrefixStore(f"{_PREFIX}/restart{restart}", store)
        self.hosts: list[str] | None = None
        """Every rank's host name, as gathered at start (distlm/runtime/context.py)."""
        self._entered = 0
        self._completed = 0
        self._beats = 0
        self._stopped = threading.Event()
        self._moved = threading.Event()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="distlm-heartbeat", daemon=True)
        self._thread.start()

    @property
    def entered(self) -> int:
        """The update this rank started last (0: none)."""
        return self._entered

    @entered.setter
    def entered(self, update: int) -> None:
        self._entered = update
        self._moved.set()

    @property
    def completed(self) -> int:
        """The update this rank finished last."""
        return self._completed

    @completed.setter
    def completed(self, update: int) -> None:
        self._completed = update
        self._moved.set()

    def _publish(self) -> None:
        self._beats += 1
        self.store.set(str(self.rank), f"{self._beats} {self.entered} {self.completed}")

    def _run(self) -> None:
        # Progress is published as soon as it moves, not at the next beat: a rank stopped
        # a moment after finishing an update must not be reported as still before it (with
        # beats 2 s apart and updates of a few ms, it was reported at update 0 after 3).
        # The training thread only sets an event; the store round trip is made here.
        while not self._stopped.is_set():
            self._moved.wait(self.interval)
            self._moved.clear()
            if self._stopped.is_set():
                return
            try:
                self._publish()
            except (RuntimeError, dist.DistStoreError):  # the store's host is gone: nothing to tell
                return

    def _read(self) -> dict[int, tuple[int, int, int]]:
        keys = [str(rank) for rank in range(self.world_size)]
        # One round trip when every rank has beaten at least once, as they do on start.
        present = keys if self.store.check(keys) else [key for key in keys if self.store.check([key])]
        values = self.store.multi_get(present) if present else []
        return {int(key): tuple(int(x) for x in value.decode().split()) for key, value in zip(present, values)}

    def ranks(self) -> list[RankState] | None:
        """Every rank's state, watched for a few beats; None if the store does not answer
        (its host, rank 0 or the launcher's agent, stopped or died)."""
        first = self._read_within(self._answer_within)
        if first is None:
            return None
        time.sleep(3 * self.interval)
        second = self._read_within(self._answer_within)
        if second is None:
            return None
        states = []
        for rank in range(self.world_size):
            beats, entered, completed = second.get(rank, (0, 0, 0))
            states.append(RankState(rank, entered, completed, beating=beats != first.get(rank, (0,))[0]))
        return states

    @property
    def _answer_within(self) -> float:
        # Asked once a collective has timed out, of a store that answered every beat until
        # then: a few beats without an answer mean its host is gone.
        return max(2.0, 5 * self.interval)

    def _read_within(self, seconds: float) -> dict[int, tuple[int, int, int]] | None:
        """``_read()``, or None if the store fails or does not answer within ``seconds``.

        A store whose host is stopped (SIGSTOP) keeps its connection open and never
        replies, and the client waits for the reply without a timeout, so the read runs
        on a thread of its own that is abandoned if it does not return in time.
        """
        answer: list[dict[int, tuple[int, int, int]]] = []

        def read() -> None:
            try:
                answer.append(self._read())
            except (RuntimeError, dist.DistStoreError):  # the host is gone: the connection failed
                pass

        reader = threading.Thread(target=read, name="distlm-heartbeat-read", daemon=True)
        reader.start()
        reader.join(seconds)
        return answer[0] if answer else None

    def describe_missing(self, update: int) -> str:
        """The ranks the collective of ``update`` waits for, in words, asked through the store."""
        return describe_missing(self.ranks(), update, self.rank, self.world_size, self.store_host, self.completed,
                                self.hosts)

    def close(self) -> None:
        self._stopped.set()
        self._moved.set()
        self._thread.join(timeout=2 * self.interval + 1)


def start_heartbeat(master_addr: str, master_port: int, rank: int, world_size: int, interval: float,
                    restart: str = "0", store_host: int | None = None) -> Heartbeat:
    """The heartbeat of a process group just started; it replaces a previous group's.

    ``store_host`` is the rank whose process serves the store at ``master_addr``, None
    when the launcher's agent serves it."""
    global _running
    stop_heartbeat()
    _running = Heartbeat(master_addr, master_port, rank, world_size, interval, restart, store_host)
    return _running


def current_heartbeat() -> Heartbeat | None:
    """The heartbeat of the process group in use, if distlm started it."""
    return _running


def stop_heartbeat() -> None:
    global _running
    if _running is not None:
        _running.close()
        _running = None


def describe_missing(states: list[RankState] | None, update: int, me: int, world_size: int,
                     store_host: int | None, completed: int, hosts: list[str] | None = None) -> str:
    """Which ranks update ``update``'s collective waits for, in words.

    ``states`` None means the store did not answer: ``store_host`` says who serves it (a
    rank, or None for the launcher's agent), ``completed`` the last update rank ``me``
    finished. When a rank serves the store, its silence names that rank. ``hosts``, every
    rank's host, names the hosts too when the ranks run on more than one.
    """
    if hosts is not None and len(set(hosts)) == 1:
        hosts = None  # one host: naming it says nothing
    if states is None:
        if store_host is None:
            # torchrun's agent on rank 0's host serves the store: from another host, its
            # silence means that host is out of reach.
            if hosts is not None and hosts[me] != hosts[0]:
                lost = [rank for rank in range(world_size) if hosts[rank] == hosts[0]]
                return (f"lost host {hosts[0]}: ranks {lost} there and torchrun's agent store there, which holds "
                        f"every rank's progress, do not answer (a cut link, or the host stopped); rank {me} on host "
                        f"{hosts[me]} still waits in update {update} (it last completed update {completed})")
            return ("the ranks cannot be asked: the store of the launcher's agent, which holds their progress, "
                    "does not answer")
        if store_host == me:
            return "the ranks cannot be asked: the store this rank serves does not answer"
        others = world_size - 2
        rest = f"; the other {others} ranks' progress is kept in that store" if others > 0 else ""
        return (f"ranks [{store_host}] stopped responding (rank {store_host} serves the rendezvous store, "
                f"which does not answer either){_on_hosts([store_host], hosts)}; ranks [{me}] still wait in update "
                f"{update} (rank {me} last completed update {completed}){rest}")
    silent = [s for s in states if not s.beating and s.rank != me]
    behind = [s for s in states if s.beating and s.entered < update and s.rank != me]
    parts = []
    if silent:
        parts.append(f"ranks {[s.rank for s in silent]} stopped responding ("
                     + ", ".join(f"rank {s.rank} last completed update {s.completed}" for s in silent) + ")"
                     + _on_hosts([s.rank for s in silent], hosts))
    if behind:
        parts.append(f"ranks {[s.rank for s in behind]} have not started update {update} ("
                     + ", ".join(f"rank {s.rank} last completed update {s.completed}" for s in behind) + ")"
                     + _on_hosts([s.rank for s in behind], hosts))
    if not parts:
        return f"every rank is alive and in update {update}; a link between them failed"
    return "; ".join(parts)


def _on_hosts(ranks: list[int], hosts: list[str] | None) -> str:
    """`` on host node1`` (``on hosts a, b``) for ``ranks``; empty without ``hosts``."""
    if hosts is None:
        return ""
    names = list(dict.fromkeys(hosts[rank] for rank in ranks))
    return f" on host{'s' if len(names) > 1 else ''} {', '.join(names)}"
