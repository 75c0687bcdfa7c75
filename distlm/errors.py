"""The one exception type for bad input, and how an entry point reports it.

Anything the user can fix (a flag, a file, a degree) raises ``UsageError`` with a
one-line message that names the setting and the fix. The entry points
(``distlm.train``, ``distlm.doctor``, ``distlm.bench``) turn it into that line on
stderr and exit status 2 with ``report_usage_error``, so users never see a torch
traceback for their own mistakes. Under ``distlm-run`` the line goes to the launcher,
which prints the first failing rank's (``print_last_line``). Messages that name ranks and
hosts word them with the helpers below (``format_ranks``, ``who``), as the doctor's checks do.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import json
import os
import sys
import time
from collections import defaultdict
from typing import Callable, Hashable, Iterable, NoReturn, Sequence


class UsageError(Exception):
    """Bad input: a one-line message naming the setting or file and how to fix it."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none: torch's
    errors carry C++ stack traces after the line that says what happened."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def did_you_mean(given: str, known: Sequence[str]) -> str:
    """`` (did you mean X?)`` with the known name nearest to ``given``; empty when none is near."""
    nearest = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
    return f" (did you mean {nearest[0]}?)" if nearest else ""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus a message; distlm promises one line and exit status 2,
    and names the nearest known flag for a mistyped one."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse's own parse_args is parse_known_args plus this refusal, without the suggestion.
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flags = [option for option in self._option_string_actions if option.startswith("--")]
            named = [word + (did_you_mean(word.split("=", 1)[0], flags) if word.startswith("-") else "")
                     for word in unknown]
            raise UsageError(f"unrecognized arguments: {' '.join(named)}")
        return parsed


def whole_number_list(flag: str) -> Callable[[str], list[int]]:
    """An argparse ``type`` for ``flag``'s comma-separated whole numbers (``1,2,4``)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise UsageError(f"{flag} takes comma-separated whole numbers, e.g. 1,2,4; got {text!r}") from None
        if not values:
            raise UsageError(f"{flag} needs at least one number")
        return values

    return parse


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
    print_last_line(f"{prefix}{'' if rank == 0 else f'rank {rank}: '}{exc}", UsageError.exit_code, rank)
    return UsageError.exit_code


LAST_LINE_DIR = "DISTLM_LAST_LINE_DIR"
"""Set by ``distlm-run`` (distlm/run.py) for its workers: a directory of its own where each
worker leaves the line it ends with, so that the launcher prints the first failing rank's
line once, after torchrun's output, instead of each worker printing it among torchrun's."""


def print_last_line(line: str, status: int, rank: int) -> None:
    """Print the one line a process ends with (an error, a stop) on stderr; under ``distlm-run``,
    hand it and the process's exit ``status`` to the launcher instead (see ``LAST_LINE_DIR``)."""
    directory = os.environ.get(LAST_LINE_DIR)
    if directory:
        record = {"line": line, "status": status, "rank": rank, "pid": os.getpid(), "ppid": os.getppid(),
                  "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0), "time": time.time()}
        path = os.path.join(directory, f"{record['attempt']}-{rank}-{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)  # the launcher never reads half a record
            return
        except OSError:
            pass  # the launcher's directory is gone or full: the line is printed here instead, not lost
    print(line, file=sys.stderr, flush=True)


def exit_without_teardown(status: int) -> NoReturn:
    """End the process with ``status``, skipping the interpreter's own teardown.

    A gloo worker thread that still releases a finished collective's tensors asks for the
    GIL while the interpreter finalises and is killed inside a C++ destructor, so the
    process aborts ("terminate called without an active exception") after a run that
    finished. The atexit handlers still run, then MPI_Finalize where mpi4py started MPI
    (mpi4py finalises from the C-level teardown this skips).
    """
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ----------------------------------------------------------------- ranks and hosts in words


def count(number: int, noun: str) -> str:
    """``count(1, "rank")`` -> ``"1 rank"``, ``count(2, "host")`` -> ``"2 hosts"``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = previous = None
    for rank in ordered + [None]:
        if start is not None and (rank is None or rank != previous + 1):
            spans.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if rank is not None and start is None:
            start = rank
        previous = rank
    return ", ".join(spans)


def who(ranks: Iterable[int], hosts: Sequence[str], most: int = 3) -> str:
    """``"rank 1 (host b)"`` or ``"ranks 8-15 (hosts b, c)"``: ranks and the hosts they run on."""
    ordered = sorted(set(ranks))
    names = list(dict.fromkeys(hosts[rank] for rank in ordered))
    shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
    noun = "rank" if len(ordered) == 1 else "ranks"
    return f"{noun} {format_ranks(ordered)} (host{'s' if len(names) > 1 else ''} {shown})"


def ranks_by_value(values: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """The ranks holding each value, values in the order of their first rank."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for rank, value in enumerate(values):
        groups[value].append(rank)
    return dict(groups)


def describe_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``ranks 0-2, 5``; ``[3]`` -> ``rank 3``."""
    ordered = sorted(set(ranks))
    return f"{'rank' if len(ordered) == 1 else 'ranks'} {format_ranks(ordered)}"
