"""Entry point: ``torchrun -m distlm.train``, ``srun``/``mpiexec python -m distlm.train``, or plain ``python``.

Bad input ends the run with one line on stderr and exit status 2, before anything
distributed starts where possible; everything else is the Trainer's.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import NoReturn, Sequence

from distlm.backends.base import DistributedInitError
from distlm.config import parse_args
from distlm.distributed import CollectiveFailure, shutdown
from distlm.parallel.replicas import ReplicaDrift
from distlm.divergence import DivergenceError
from distlm.errors import UsageError
from distlm.trainer import Trainer


def _rank_from_environment() -> int:
    # Cheap guess for "who prints", before (or without) launcher detection.
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ and os.environ[name].isdigit():
            return int(os.environ[name])
    return 0


# How long a rank other than 0 waits before it reports a usage error itself. Bad input is
# usually met by every rank alike: rank 0 reports it and exits, and the launcher (torchrun,
# mpiexec, srun --kill-on-bad-exit) stops the others within this time, so one line is
# printed. Without the wait, a rank that exited first got rank 0 killed before it printed
# (seen under torchrun with a bad --tp-degree: exit 2 and no message). Input that only some
# ranks meet (a file missing on one node) is still reported, by those ranks, named.
_SECOND_REPORTER_DELAY_SEC = 5.0


def main(argv: Sequence[str] | None = None) -> int:
    rank = _rank_from_environment()
    is_main = rank == 0
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING,
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        stream=sys.stderr,
    )
    try:
        config = parse_args(argv)
        trainer = Trainer(config)
        trainer.precompile() if config.compile.precompile else trainer.fit()
    except UsageError as exc:
        if not is_main:
            time.sleep(_SECOND_REPORTER_DELAY_SEC)
        print(f"distlm: error: {'' if is_main else f'rank {rank}: '}{exc}", file=sys.stderr, flush=True)
        return UsageError.exit_code
    except DivergenceError as exc:
        # Every rank meets it at the same update; rank 0's line is enough.
        if is_main:
            print(f"distlm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (DistributedInitError, CollectiveFailure, ReplicaDrift) as exc:
        # Start-up and collective failures already carry a one-line explanation naming
        # the ranks; every rank prints its own, since each may see a different peer fail.
        print(f"distlm: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown()
    return 0


def run() -> None:
    """``python -m distlm.train`` and the ``distlm-train`` command."""
    exit_without_teardown(main())


def exit_without_teardown(status: int) -> NoReturn:
    """End the process with ``status``, skipping the interpreter's own teardown.

    gloo's worker threads can still be releasing the tensors of a finished collective,
    which takes the GIL, and a thread that asks for the GIL while the interpreter
    finalises is killed inside a C++ destructor: the process aborts ("terminate called
    without an active exception") and the launcher reports a failed rank for a run that
    finished. The atexit handlers still run (the MPI transport's thread, logging), and
    then MPI_Finalize where mpi4py started MPI, since mpi4py finalises from the C-level
    teardown this skips. Checkpoints are on disk already, fsynced and renamed into place.
    """
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run()
