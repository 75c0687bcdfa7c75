"""One owner per save dir: a lock file naming the run, its host and its process.

Rank 0 holds ``.distlm-lock`` in the save dir and refreshes its time while the run lives.
Another run on the same save dir is refused, naming the owner, unless the lock is stale:
its process is gone (on this host; a pid now used by another process counts as gone), or,
for a lock from another host, it has not been refreshed for ``STALE_AFTER`` seconds. A
same-host lock whose process lives is never stale, however old: a suspended job or a hung
mount leaves a live owner behind.

Every change of the lock (taking it, taking it over, giving it up) happens under an
exclusive ``flock`` of ``.distlm-lock.guard`` beside it, and re-reads the lock there. So
of many runs that judge one stale lock at once, exactly one replaces it; the others then
find its fresh lock and are refused. A run whose lock was taken over anyway (its host
went quiet for longer than ``STALE_AFTER``) finds out before its next save (``lost``)
and stops instead of writing into a directory another run owns.

The owner is the launcher's job: the restarted workers of one torchrun job, a requeued
Slurm job step, and a second Trainer in one process are the same owner as the first;
two steps of one Slurm job, or two processes of one job alive on one host, are not.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from distlm.errors import UsageError
from distlm.launch.hosts import boot_id as _boot_id  # this boot of this machine, shared with the hosts check

logger = logging.getLogger("distlm")

LOCK_FILE = ".distlm-lock"
GUARD_FILE = ".distlm-lock.guard"
REFRESH_EVERY = 30.0
STALE_AFTER = 300.0
"""Seconds without a refresh after which a lock from another host is taken over."""
GUARD_WAIT = 30.0
"""Seconds to wait for the guard: it is held for the microseconds of one read and one
rename, so a longer wait means its holder is stuck (a hung file system)."""
_READ_LIMIT = 1 << 16


def run_id() -> str:
    """Who this run is, the same for every restart of one launcher job."""
    parts = []
    if os.environ.get("SLURM_JOB_ID"):
        step = os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID") or "batch"
        parts.append(f"slurm job {os.environ['SLURM_JOB_ID']} step {step}")
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job and job != "none":
        parts.append(f"torchrun {job}")
    elif job:  # torchrun without --rdzv-id: its agent, the workers' parent, outlives restarts
        parts.append(f"torchrun agent {socket.gethostname()}:{os.getppid()}")
    return ", ".join(parts) or f"process {socket.gethostname()}:{os.getpid()}"


class SaveDirLock:
    """The lock of one save dir, held by rank 0 from ``acquire`` to ``release``."""

    def __init__(self, save_dir: Path):
        self.path = save_dir / LOCK_FILE
        self.guard = save_dir / GUARD_FILE
        pid = os.getpid()
        self.owner = {"run": run_id(), "host": socket.gethostname(), "boot": _boot_id(), "pid": pid,
                      "start": _process_start(pid), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``UsageError`` naming the run that holds it."""
        with self._guarded():
            holder = self._read()
            if holder is not None:
                why = _taken_over_because(holder, self.owner, self.path)
                if why is None:
                    other = ("another process of this job" if holder.get("run") == self.owner["run"]
                             else "another run")
                    raise UsageError(
                        f"--save-dir {self.path.parent} belongs to {other} ({_describe(holder)}; lock "
                        f"{self.path}): name another --save-dir, or stop that run")
                if holder.get("run") != self.owner["run"]:
                    logger.info("--save-dir %s: took over the lock of run %s (%s)", self.path.parent,
                                holder.get("run"), why)
            staged = self.path.with_name(f"{LOCK_FILE}.{self.owner['token']}")
            staged.write_text(json.dumps(self.owner))
            os.replace(staged, self.path)
        self._thread = threading.Thread(target=self._refresh, name="distlm-save-dir-lock", daemon=True)
        self._thread.start()

    def lost(self) -> str | None:
        """Why the lock is no longer this run's (one line naming the run that holds it now), or None."""
        try:
            holder = self._read()
        except UsageError as err:
            return str(err)
        if holder is not None and holder.get("token") == self.owner["token"]:
            return None
        now = f"run {_describe(holder)} holds it now" if holder is not None else "it was removed"
        return (f"--save-dir {self.path.parent} is no longer this run's: its lock {self.path} was taken over "
                f"({now}); this run stops without saving, so that two runs never write one directory")

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError, UsageError), self._guarded():
            holder = self._read()
            if holder is not None and holder.get("token") == self.owner["token"]:
                self.path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """Hold the guard's exclusive flock: the lock changes only here."""
        try:
            fd = os.open(self.guard, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as err:
            raise UsageError(f"--save-dir {self.path.parent}: cannot open its lock guard {self.guard} "
                             f"({_reason(err)}); remove it if it is not a plain file") from None
        try:
            deadline = time.monotonic() + GUARD_WAIT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise UsageError(f"--save-dir {self.path.parent}: its lock guard {self.guard} has been held "
                                         f"for over {GUARD_WAIT:.0f} s; is the file system hung?") from None
                    time.sleep(0.01)
                except OSError as err:
                    raise UsageError(
                        f"--save-dir {self.path.parent}: its file system does not support file locks "
                        f"({_reason(err)}), which keep two runs from sharing it; name a save dir on a file system "
                        "that does (NFSv4, Lustre mounted with -o flock, a local disk)") from None
            yield
        finally:
            os.close(fd)  # also releases the flock

    def _read(self) -> dict[str, Any] | None:
        """The lock's owner record, None if there is none; a lock that is not a plain file is refused."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR):
                raise UsageError(self._not_a_lock("a symbolic link" if err.errno == errno.ELOOP else "a directory"))
            return {"run": f"unknown (unreadable lock: {_reason(err)})"}
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise UsageError(self._not_a_lock("a directory" if stat.S_ISDIR(mode) else "not a plain file"))
        with os.fdopen(fd, "rb") as f:
            text = f.read(_READ_LIMIT)
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        return holder if isinstance(holder, dict) else {"run": "unknown (unreadable lock)"}

    def _not_a_lock(self, what: str) -> str:
        return (f"--save-dir {self.path.parent}: its lock {self.path} is {what}, not a lock distlm wrote; "
                "remove it if no run uses the directory")

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_EVERY):
            if self.lost() is not None:
                return
            try:
                os.utime(self.path)
            except OSError:
                return


def _taken_over_because(holder: dict[str, Any], owner: dict[str, Any], path: Path) -> str | None:
    """Why ``owner`` may replace the lock of ``holder`` (a reason; "" for its own job), or None."""
    same_host = holder.get("host") == owner["host"] and holder.get("boot", owner["boot"]) == owner["boot"]
    pid = holder.get("pid")
    if same_host and isinstance(pid, int) and pid != owner["pid"]:
        if not process_exists(pid):
            return f"its process {pid} is gone"
        start = holder.get("start")
        if start is not None and start != _process_start(pid):
            return f"its process {pid} is gone (the pid now names another process)"
        return None  # alive on this host: never stale by age, and not a restart of this job
    if holder.get("run") == owner["run"]:
        return ""  # a restart of this job (elsewhere, or in this process)
    if same_host:
        return None
    try:
        age = time.time() - os.stat(path, follow_symlinks=False).st_mtime
    except OSError:
        return "its lock is gone"
    return f"not refreshed for {age:.0f} s" if age > STALE_AFTER else None


def _describe(holder: dict[str, Any]) -> str:
    return (f"{holder.get('run')}, host {holder.get('host', 'unknown')}, pid {holder.get('pid', 'unknown')}, "
            f"since {holder.get('since', 'unknown')}")


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None where /proc does not say):
    with the pid, it names one process, so a pid reused after a crash is not taken for the owner."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _reason(err: OSError) -> str:
    return err.strerror or str(err)
