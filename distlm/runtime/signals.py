"""Stop a run cleanly on SIGTERM, SIGINT or SIGUSR1: every rank at one update, with a checkpoint.

Slurm sends SIGTERM at preemption and at the time limit (and SIGUSR1 before it, with
``--signal=USR1@SECONDS``), torchrun forwards the signals it receives to its workers,
and Ctrl-C is SIGINT. A signal only records itself here. The trainer adds the record to
an all-reduce every update already makes (the global target count), so every rank
learns at the same update boundary that some rank was signalled; all save one
checkpoint and exit. A second signal exits at once, without a checkpoint.

The signals are read through ``signal.set_wakeup_fd`` by a thread of this module, not by
Python-level handlers: those run only when the main thread returns to the interpreter,
so a second signal during a long collective would wait for it, and the wake-up byte is
written by the C-level handler at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Mapping

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

# The same signal again within this many seconds is the same request delivered twice: Slurm
# signals every process of a step, and torchrun then forwards the same signal to its workers.
REPEAT_WINDOW_SEC = 1.0


def exit_status(signum: int) -> int:
    """The status a shell reports for a process ended by ``signum``: launchers and job
    scripts still see the run as interrupted, not finished."""
    return 128 + signum


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """For data-loading worker processes (a DataLoader's ``worker_init_fn``): the training
    process decides when to stop, and the loader ends its workers itself. A terminal's
    Ctrl-C reaches every process of the foreground group, workers included."""
    signal.set_wakeup_fd(-1)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


# prctl(2)'s option: the signal this process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


def die_with_torchrun_agent(environ: Mapping[str, str] | None = None) -> bool:
    """Under torchrun, end this worker with SIGKILL when its agent, its parent, dies; True
    where that was arranged.

    An agent killed with SIGKILL cannot stop its workers: they went on training with the
    other nodes, and the other nodes' agents, seeing healthy workers, neither restarted nor
    failed. Dying with the agent turns a lost agent into a lost rank, which the others name
    within --timeout-sec and their agents act on. SIGKILL, not a stop signal: the agent
    would have killed its workers itself, and a worker that has lost its agent cannot be
    restarted anyway. Linux only (prctl); a worker started through a shell that torchrun
    runs (``--no-python bash -c``) has the shell as parent and is not covered.
    """
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class StoppedBeforeTraining(Exception):
    """A stop signal arrived while the run was still starting (a tracker's start-up): the run
    ends at once, as there is nothing to save yet."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"{self.name} before training started; nothing saved")


class StopSignals:
    """Records the stop signals this process receives while installed."""

    def __init__(self) -> None:
        self.received: dict[int, float] = {}
        """Signal number -> when it first arrived (monotonic seconds)."""
        self.agreed: list[int] = []
        """The signals some rank received, as all ranks agreed at an update boundary; [] to go on."""
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None

    def install(self) -> bool:
        """Take over the stop signals; False where that is impossible (not the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        self._previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            # A handler that does nothing keeps the default action (exit, KeyboardInterrupt)
            # away; the wake-up byte carries the signal to the watcher.
            self._previous[signum] = signal.signal(signum, lambda *_: None)
        self._pipe = (read_end, write_end)
        threading.Thread(target=self._watch, args=(read_end,), name="distlm-signals", daemon=True).start()
        return True

    def restore(self) -> None:
        """Give the signals back to whoever had them before ``install``."""
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self._pipe[1])  # the watcher reads end-of-file and ends
        self._pipe = None

    def _watch(self, read_end: int) -> None:
        try:
            while data := os.read(read_end, 64):
                for signum in data:
                    if signum in STOP_SIGNALS:
                        self._record(signum)
        finally:
            os.close(read_end)

    def _record(self, signum: int) -> None:
        now = time.monotonic()
        if not self.received:
            self.received[signum] = now
            return
        if signum in self.received and now - self.received[signum] < REPEAT_WINDOW_SEC:
            return
        name = signal.Signals(signum).name
        sys.stderr.write(f"distlm: {name} again: exiting now, without a checkpoint "
                         "(the newest complete checkpoint is intact)\n")
        sys.stderr.flush()
        os._exit(exit_status(signum))

    def local_flags(self) -> list[float]:
        """One entry per stop signal: 1 if this process received it (summed over ranks)."""
        return [1.0 if signum in self.received else 0.0 for signum in STOP_SIGNALS]

    def agree(self, summed_flags: list[float]) -> bool:
        """Record what ``local_flags`` summed over every rank says; True to stop now."""
        self.agreed = [signum for signum, count in zip(STOP_SIGNALS, summed_flags) if count > 0]
        return bool(self.agreed)

    def describe_stop(self, update: int, save_dir: Path, saved: list[str] | None) -> str:
        """The line a stopped run ends with; ``saved``: the checkpoint names written (None: --no-save)."""
        where = f"{self.describe()}: stopped at update {update}"
        if saved is None:
            return f"{where}; nothing saved (--no-save)"
        if not saved:
            return (f"{where}; no new checkpoint (one of this update is in {save_dir} already, "
                    "or --no-last-checkpoints)")
        return f"{where} and saved {', '.join(str(save_dir / name) for name in saved)}; the same command resumes from it"

    def describe(self) -> str:
        """The agreed signals' names, e.g. ``SIGTERM``."""
        return " and ".join(signal.Signals(signum).name for signum in self.agreed)
