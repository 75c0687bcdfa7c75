"""The save dir a run writes its checkpoints into, made ready before the first update.

Before training starts every rank proves it can write there (a probe file: permission bits
say nothing for root, a read-only mount or a full quota), rank 0 takes the save dir's lock
(lock.py) and puts back or removes what an interrupted save left (``directory.recover``),
and the ranks check that the directory is one file system for all of them (shared_dir.py).
A problem on any rank refuses the run on every rank, in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

from distlm.checkpoint import directory, shared_dir
from distlm.checkpoint.failures import os_reason
from distlm.checkpoint.lock import SaveDirLock
from distlm.errors import UsageError
from distlm.runtime.context import DistContext

logger = logging.getLogger("distlm")


class SaveDir:
    """The run's save dir: checked and locked by ``prepare``, given up by ``release``."""

    def __init__(self, path: Path, ctx: DistContext):
        self.path = path
        self.ctx = ctx
        self._lock: SaveDirLock | None = None

    def prepare(self) -> None:
        """Check the save dir before training and clean up after a killed save (collective)."""
        problem = unusable_save_dir(self.path)
        if problem is None and self.ctx.is_main:
            # The lock first: the clean-up below removes what another run's save is writing.
            try:
                self._lock = SaveDirLock(self.path)
                self._lock.acquire()
            except UsageError as err:
                self._lock, problem = None, str(err)
        if problem is None and self.ctx.is_main:
            # Before the collective below, so no rank looks for checkpoint_last while rank 0
            # may still be moving it back into place.
            try:
                for action in directory.recover(self.path):
                    logger.info("--save-dir %s: %s", self.path, action)
            except OSError as err:
                problem = f"--save-dir {self.path}: cannot clean up after an interrupted save ({os_reason(err)})"
        problems = self.ctx.all_gather_object(problem)
        if problems[self.ctx.rank] is not None:
            raise UsageError(problems[self.ctx.rank])
        refused = [rank for rank, problem in enumerate(problems) if problem is not None]
        if refused:
            raise UsageError(f"--save-dir {self.path} is not usable on ranks {refused} (their errors say why)")
        self._check_shared()

    def _check_shared(self) -> None:
        """Refuse, before the first update, a save dir that is not one file system for every
        rank (collective): its checkpoints would lie in pieces on several disks."""
        if not self.ctx.is_distributed:
            return
        reports = shared_dir.probe_save_dir(self.ctx.rank, self.ctx.world_size, str(self.path),
                                            self.ctx.all_gather_object)
        problem = reports if isinstance(reports, str) else shared_dir.sharing_problem(reports)
        if problem is not None:
            self.release()  # a refused run leaves no lock behind
            raise UsageError(f"--save-dir {problem}")

    def lost(self) -> str | None:
        """Rank 0: why the save dir is no longer this run's, or None (it is, or nothing is saved there)."""
        return self._lock.lost() if self._lock is not None else None

    def release(self) -> None:
        """Give up the save dir (rank 0 removes its lock); the run is over."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def unusable_save_dir(save_dir: Path) -> str | None:
    """Why checkpoints cannot be written into ``save_dir``, found by writing a file there
    (permission bits say nothing for root, a read-only mount or a full quota); None if they can."""
    if save_dir.exists() and not save_dir.is_dir():
        return f"--save-dir {save_dir} is a file; name a directory"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"--save-dir {save_dir} cannot be created ({os_reason(err)}); name a writable directory"
    probe = save_dir / f".distlm-write-test-{os.getpid()}-{socket.gethostname()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
    except OSError as err:
        return (f"--save-dir {save_dir} is not writable ({err.strerror or err}); "
                "fix its permissions or name another directory")
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None
