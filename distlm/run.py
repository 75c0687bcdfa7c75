"""``python -m distlm.run`` and ``distlm-run``: torchrun, ending in distlm's one line.

It takes torchrun's own arguments and launches through torchrun's own code
(``torch.distributed.run``'s ``parse_args`` and ``run``), so rendezvous, restarts and
multi-node launches behave exactly as under ``torchrun``::

    distlm-run --standalone --nproc_per_node 2 -m distlm.train --max-update 100

Only the end differs. When a worker fails, torchrun prints its ``ChildFailedError``
banner and a traceback of its own, and exits with status 1, so a worker's one-line
error sits in the middle of thirty lines. Here each distlm worker leaves the line it
ends with (and its exit status) in a directory of this run's (``errors.LAST_LINE_DIR``),
and the launcher prints the first failing rank's line last, once, and exits with that
rank's status: 2 for bad input. On SIGTERM or SIGINT torchrun stops the workers, which
save a checkpoint, and the launcher prints rank 0's stop line and exits with 128 + the
signal's number, as ``python -m distlm.train`` does. A worker that ends without a distlm
line (a crash, a script of the user's) is named with its exit status in one line.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from typing import Any, Sequence

from distlm.errors import LAST_LINE_DIR
from distlm.runtime.signals import exit_status

# torchrun's log records of workers ending, which the launcher's own line replaces (a
# record torch words differently in another version is printed as before, nothing worse).
WORKER_END_RECORDS = {
    "torch.distributed.elastic.agent.server.api": ("Received %s death signal, shutting down workers",),
    "torch.distributed.elastic.multiprocessing.api": (
        "Sending process %s closing signal %s",
        "Closing process %s via signal %s",
        "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
    ),
}


class _Stopped(BaseException):
    """A stop signal before the workers started: a BaseException, as KeyboardInterrupt is, since
    code under torch's imports catches Exception and would go on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Launch as torchrun with ``argv`` (torchrun's arguments); the exit status."""
    # Until torchrun's agent takes SIGTERM and SIGINT over, just before it starts the workers,
    # they end the launcher with a line, not with a traceback from inside torch's imports.
    previous = {signum: signal.signal(signum, _stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _launch(list(sys.argv[1:] if argv is None else argv))
    except _Stopped as stopped:
        line = f"distlm: {signal.Signals(stopped.signum).name} before the workers started; nothing saved"
        print(line, file=sys.stderr, flush=True)
        return exit_status(stopped.signum)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _launch(argv: list[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="distlm-run-")
    os.environ[LAST_LINE_DIR] = directory  # the agent hands its environment to the workers
    filters = _quiet_worker_ends()
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as failed:
        line, status = describe_failure(failed.failures, read_last_lines(directory))
    except SignalException as stopped:
        line, status = describe_stop(stopped.sigval, read_last_lines(directory))
    finally:
        for logger, quiet in filters:
            logger.removeFilter(quiet)
        os.environ.pop(LAST_LINE_DIR, None)
        shutil.rmtree(directory, ignore_errors=True)
    print(line, file=sys.stderr, flush=True)
    return status


def read_last_lines(directory: str) -> list[dict[str, Any]]:
    """The lines the workers left (``errors.print_last_line``)."""
    records = []
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as f:
            records.append(json.load(f))
    return records


def describe_failure(failures: dict[int, Any], records: list[dict[str, Any]]) -> tuple[str, int]:
    """The line and exit status for workers that failed: the first failing rank's own line and
    status, or, where no failed worker left one, the first failure as torchrun saw it.

    ``failures``: torchrun's, global rank -> ``ProcessFailure``; ``records``: ``read_last_lines``.
    Records are matched by process id, so a line of an earlier attempt (``--max-restarts``)
    is never taken for the last one's; a worker started by a wrapper script is its child.
    """
    pids = {failure.pid for failure in failures.values()}
    own = [record for record in records if record["pid"] in pids or record["ppid"] in pids]
    if own:
        first = min(own, key=lambda record: record["time"])
        return first["line"], first["status"]
    # The workers torchrun ended itself, with SIGTERM, after the first failure come last.
    rank, failure = min(failures.items(),
                        key=lambda item: (item[1].exitcode == -signal.SIGTERM, item[1].timestamp, item[0]))
    if failure.exitcode < 0:
        how, status = f"was killed by {failure.signal_name()}", exit_status(-failure.exitcode)
    else:
        how, status = f"exited with status {failure.exitcode}", failure.exitcode
    return (f"distlm: error: rank {rank} (pid {failure.pid}) {how} without a distlm line; "
            "its own output above says why"), status


def describe_stop(signum: int, records: list[dict[str, Any]]) -> tuple[str, int]:
    """The line and exit status after torchrun stopped the workers on ``signum``: the workers'
    own line (rank 0's stop line names the checkpoint saved), of the newest attempt."""
    if records:
        newest = max(record["attempt"] for record in records)
        first = min((record for record in records if record["attempt"] == newest), key=lambda record: record["time"])
        return first["line"], exit_status(signum)
    return (f"distlm: {signal.Signals(signum).name}: the workers ended before training began or were stopped "
            "before they could save; nothing new saved"), exit_status(signum)


def _quiet_worker_ends() -> list[tuple[logging.Logger, logging.Filter]]:
    """Drop torchrun's log records of workers ending (``WORKER_END_RECORDS``) while it runs."""
    installed = []
    for name, messages in WORKER_END_RECORDS.items():
        logger = logging.getLogger(name)
        quiet = _DropMessages(messages)
        logger.addFilter(quiet)
        installed.append((logger, quiet))
    return installed


class _DropMessages(logging.Filter):
    def __init__(self, messages: Sequence[str]) -> None:
        super().__init__()
        self.messages = frozenset(messages)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.messages


if __name__ == "__main__":
    sys.exit(main())
