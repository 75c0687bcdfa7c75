"""The one exception type for bad input, and how an entry point reports it.

Anything the user can fix (a flag, a file, a degree) raises ``UsageError`` with a
one-line message that names the setting and the fix. The entry points
(``distlm.train``, ``distlm.doctor``, ``distlm.bench``) turn it into that line on
stderr and exit status 2 with ``report_usage_error``, so users never see a torch
traceback for their own mistakes.
"""

from __future__ import annotations

import os
import sys
import time


class UsageError(Exception):
    """Bad input: a one-line message naming the setting or file and how to fix it."""

    exit_code = 2


# How long a rank other than 0 waits before it reports a usage error itself. Bad input is
# usually met by every rank alike: rank 0 reports it and exits, and the launcher (torchrun,
# mpiexec, srun --kill-on-bad-exit) stops the others within this time, so one line is
# printed. Without the wait, a rank that exited first got rank 0 killed before it printed
# (seen under torchrun with a bad --tp-degree: exit 2 and no message). Input that only some
# ranks meet (a file missing on one node) is still reported, by those ranks, named.
SECOND_REPORTER_DELAY_SEC = 5.0


def rank_from_environment() -> int:
    """This process's global rank as the launcher set it; 0 without a launcher.

    A cheap guess for "who prints", made before (or without) launcher detection.
    """
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def report_usage_error(prefix: str, exc: UsageError, rank: int) -> int:
    """Print ``exc`` as one line after ``prefix`` (rank 0 first, any other rank named and
    later) and return the exit status for bad input."""
    if rank != 0:
        time.sleep(SECOND_REPORTER_DELAY_SEC)
    print(f"{prefix}{'' if rank == 0 else f'rank {rank}: '}{exc}", file=sys.stderr, flush=True)
    return UsageError.exit_code
