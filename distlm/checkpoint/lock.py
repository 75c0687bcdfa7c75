"""One owner per save dir: a lock file naming the run, its host and its process.

Rank 0 creates ``.distlm-lock`` in the save dir atomically (written aside, then hard
linked into place, which fails if the file exists) and refreshes its time while the run
lives. Another run on the same save dir is refused, naming the owner, unless the lock
is stale: its process is gone (on this host), or it has not been refreshed for
``STALE_AFTER`` seconds (any host). The restarted workers of one torchrun or Slurm job
are the same owner as the first ones, and so is a second Trainer in one process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from distlm.errors import UsageError

logger = logging.getLogger("distlm")

LOCK_FILE = ".distlm-lock"
REFRESH_EVERY = 30.0
STALE_AFTER = 300.0
"""Seconds without a refresh after which a lock from another host is taken over."""


def run_id() -> str:
    """Who this run is, the same for every restart of one launcher job."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job and job != "none":
        return f"torchrun {job}"
    if job:  # torchrun without --rdzv-id: its agent, the workers' parent, outlives restarts
        return f"torchrun agent {socket.gethostname()}:{os.getppid()}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    return f"process {socket.gethostname()}:{os.getpid()}"


class SaveDirLock:
    """The lock of one save dir, held by rank 0 from ``acquire`` to ``release``."""

    def __init__(self, save_dir: Path):
        self.path = save_dir / LOCK_FILE
        self.owner = {"run": run_id(), "host": socket.gethostname(), "pid": os.getpid(),
                      "since": time.strftime("%Y-%m-%d %H:%M:%S"), "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise ``UsageError`` naming the run that holds it."""
        for _ in range(3):
            if self._create():
                break
            holder = _read(self.path)
            if holder is None:
                continue  # removed meanwhile: try again
            if holder.get("run") == self.owner["run"]:
                self._replace()  # a restart of this job, or a second Trainer in this process
                break
            why = _stale(holder, self.path)
            if why is None:
                raise UsageError(
                    f"--save-dir {self.path.parent} belongs to another run ({holder.get('run')}, host "
                    f"{holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}; lock {self.path}): "
                    "name another --save-dir, or stop that run")
            logger.info("--save-dir %s: took over the lock of run %s (%s)", self.path.parent, holder.get("run"), why)
            try:
                os.rename(self.path, self.path.with_name(f"{LOCK_FILE}.stale-{self.owner['token']}"))
                os.unlink(self.path.with_name(f"{LOCK_FILE}.stale-{self.owner['token']}"))
            except FileNotFoundError:
                pass  # another run took it over first: the next try finds its lock
        else:
            raise UsageError(f"--save-dir {self.path.parent}: cannot take its lock {self.path}; remove it if no run uses the directory")
        self._thread = threading.Thread(target=self._refresh, name="distlm-save-dir-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        holder = _read(self.path)
        if holder is not None and holder.get("token") == self.owner["token"]:
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        staged = self._write_aside()
        try:
            os.link(staged, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            staged.unlink(missing_ok=True)

    def _replace(self) -> None:
        os.replace(self._write_aside(), self.path)

    def _write_aside(self) -> Path:
        staged = self.path.with_name(f"{LOCK_FILE}.{self.owner['token']}")
        staged.write_text(json.dumps(self.owner))
        return staged

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_EVERY):
            holder = _read(self.path)
            if holder is None or holder.get("token") != self.owner["token"]:
                return
            try:
                os.utime(self.path)
            except OSError:
                return


def _read(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"run": "unknown (unreadable lock)", "host": None, "pid": None}
    return holder if isinstance(holder, dict) else {"run": "unknown (unreadable lock)", "host": None, "pid": None}


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _stale(holder: dict[str, Any], path: Path) -> str | None:
    """Why the lock ``holder`` no longer stands for a live run, or None."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if not process_exists(holder["pid"]):
            return f"its process {holder['pid']} is gone"
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return "its lock is gone"
    if age > STALE_AFTER:
        return f"not refreshed for {age:.0f} s"
    return None
