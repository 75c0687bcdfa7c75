"""Why checkpoint I/O failed, in one line: the error a failed save ends with, and the
reasons it and the save dir's checks give (an OSError, a full disk)."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

from distlm.checkpoint import storage
from distlm.errors import UsageError

# A failed write that leaves less free space than this is taken for a full disk.
_LOW_SPACE_BYTES = 64 * 1024


class CheckpointError(UsageError, RuntimeError):
    """Saving failed (a full disk, a write error); the message names the path, and the previous checkpoint is intact.

    A ``UsageError``, so the command line ends with that one line and exit status 2: what
    fixes it (space, permissions, the file system) is the user's.
    """


def os_reason(err: OSError) -> str:
    """An OSError as its cause and the file it concerns."""
    return f"{err.strerror}: {err.filename}" if err.strerror and err.filename else err.strerror or str(err)


def save_failure(err: BaseException, save_dir: Path) -> str:
    """One line for a failed write. torch's tensor writer reports a full disk as a
    RuntimeError about file positions ("unexpected pos 704 vs 598"), so a failed write with
    almost no space left on the save dir's file system is named for what it is."""
    if _is_enospc(err):
        return os.strerror(errno.ENOSPC)
    with contextlib.suppress(OSError):
        stats = os.statvfs(save_dir)
        if stats.f_bavail * stats.f_frsize < _LOW_SPACE_BYTES:
            return f"{os.strerror(errno.ENOSPC)} ({stats.f_bavail * stats.f_frsize} bytes free)"
    return storage.cause_line(err)


def _is_enospc(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return err.errno == errno.ENOSPC
    return "No space left on device" in str(err) or f"Errno {errno.ENOSPC}" in str(err)
