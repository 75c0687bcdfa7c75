"""``Observer``: everything that watches a run, behind the few calls the trainer makes.

Rank 0 sends every log record to stdout (the ``Printer``), ``--log-file`` and the
trackers; ``--log-file`` also holds rank 0's log lines from the start of the run (launcher,
data, model, where training starts), as fairseq's log file does. Every rank times its
updates for the straggler fields and runs the profiler window. The trainer calls ``next_batch``, ``update`` (around an update), ``computing``
and ``waiting_for_peers`` (inside it), ``interval_fields`` (when a train line is due)
and logs through the observer as it would through the printer.

Observers never end a run: a write that fails (--log-file, run.json, a trace; a full disk
included) is one warning and that output is off; the paths are checked before anything
starts instead, where a refusal costs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import tempfile
from pathlib import Path
from typing import Any, Iterator

from distlm.config import TrainConfig
from distlm.errors import UsageError, rank_from_environment
from distlm.observe.log_lines import LOG_FORMAT
from distlm.observe.printer import Printer
from distlm.observe.profiler import ProfileWindow, parse_profile_steps
from distlm.observe.run_record import RUN_JSON, run_json, write_run_json
from distlm.observe.stragglers import StepTiming
from distlm.observe.trackers import Trackers, check_tracker_packages
from distlm.runtime.context import DistContext
from distlm.runtime.signals import StoppedBeforeTraining, StopSignals

logger = logging.getLogger("distlm")

PROFILE_DIR = "profiles"


def check_observe_settings(config: TrainConfig) -> None:
    """Before anything starts: tracker packages installed, --profile-steps well formed, --log-file
    and --profile-dir writable."""
    check_tracker_packages(config.logging)
    if config.logging.profile_steps is not None:
        parse_profile_steps(config.logging.profile_steps)
    if config.logging.log_file is not None and rank_from_environment() == 0:  # rank 0 writes it
        path = Path(config.logging.log_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.open("a").close()
        except OSError as err:
            raise UsageError(f"--log-file {path}: cannot append to it ({err.strerror})") from None
    if config.logging.profile_dir is not None:  # every rank writes its own trace there
        directory = Path(config.logging.profile_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".distlm-probe-"):
                pass
        except OSError as err:
            raise UsageError(f"--profile-dir {directory}: cannot write there ({err.strerror or err}); "
                             "give a writable directory") from None


class LogFile(logging.Handler):
    """``--log-file`` on rank 0: distlm's log lines as stderr shows them, and the records the
    observer writes. Opened per line: lines come after the observer closes (the summary, the
    last checkpoint), and a crash loses no line. A write that fails is one warning, and the
    file takes no more lines."""

    def __init__(self, path: Path):
        super().__init__(logging.INFO)
        self.path = path
        self.setFormatter(logging.Formatter(LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        self.write(self.format(record))

    def write(self, line: str) -> bool:
        """Append ``line``; False (after the one warning) if it cannot be written."""
        if self.path is None:
            return False
        try:
            with self.path.open("a") as file:
                file.write(line + "\n")
        except OSError as err:
            # Off before the warning, which comes back here; the handler stays on the logger
            # (taking it off inside a handler would skip the next handler for this line).
            path, self.path = self.path, None
            logger.warning("--log-file %s: cannot write (%s); training goes on without it", path, err.strerror or err)
            return False
        return True


_log_file: LogFile | None = None
"""The one --log-file handler of this process on distlm's logger (a logger is one per process)."""


def start_log_file(config: TrainConfig) -> None:
    """Rank 0 appends distlm's log lines to --log-file from now on (a previous run's file in
    this process takes no more); call after check_observe_settings, before anything is logged."""
    global _log_file
    stop_log_file()
    if config.logging.log_file is not None and rank_from_environment() == 0:
        _log_file = LogFile(Path(config.logging.log_file))
        logger.addHandler(_log_file)


def stop_log_file() -> None:
    """distlm's log lines no longer go to --log-file (the end of a run)."""
    global _log_file
    if _log_file is not None:
        logger.removeHandler(_log_file)
        _log_file = None


class Observer:
    def __init__(self, config: TrainConfig, ctx: DistContext, resume_meta: dict[str, Any] | None):
        self.config, self.ctx = config, ctx
        settings = config.logging
        self.saved_ids: dict[str, str] = dict((resume_meta or {}).get("trackers") or {})
        self.timing = StepTiming(ctx.rank, ctx.world_size, ctx.world_group, config.data.num_workers)
        window = parse_profile_steps(settings.profile_steps) if settings.profile_steps else None
        directory = Path(settings.profile_dir) if settings.profile_dir else Path(config.checkpoint.save_dir) / PROFILE_DIR
        self.profile = ProfileWindow(window, directory, ctx.rank, ctx.device.type, settings.memory_snapshot)
        self.printer: Printer | None = None
        self.trackers = Trackers()
        self.log_file: LogFile | None = None

    def start(self, resumed_at: int | None, stop: StopSignals | None = None) -> Observer:
        """Open the outlets (stdout; on rank 0 also run.json, trackers, --log-file); the observer then
        logs as the ``Printer`` does. ``stop``: the run's stop signals, which end a tracker's start-up."""
        settings = self.config.logging
        self.printer = Printer(settings.log_format, self.config.optim.max_update or None, self.ctx.is_main)
        if self.ctx.is_main and not self.config.checkpoint.no_save:
            directory = Path(self.config.checkpoint.save_dir)
            try:
                write_run_json(directory, run_json(self.config.to_dict(), {
                    "launcher": self.ctx.env.launcher, "world_size": self.ctx.world_size,
                    "nodes": self.ctx.env.num_nodes, "ranks_per_node": self.ctx.env.local_world_size,
                    "layout": self.ctx.layout, "strategy": self.config.distributed.strategy,
                    "resumed_at": resumed_at}, self.ctx.device))
            except OSError as err:
                logger.warning("%s: not written (%s); training goes on without it", directory / RUN_JSON,
                               err.strerror or err)
        self._open_trackers(resumed_at, stop)
        if self.ctx.is_main:
            self.log_file = _log_file  # start_log_file's, unless a write has failed already
        return self

    def _open_trackers(self, resumed_at: int | None, stop: StopSignals | None) -> None:
        """Rank 0 starts the trackers, and every rank learns whether they started: a refusal is
        rank 0's one line on every rank, not a failed collective on the others."""
        settings = self.config.logging
        if not any((settings.tensorboard_logdir, settings.wandb_project, settings.mlflow_tracking_uri)):
            return
        refusal = None
        if self.ctx.is_main:
            try:
                self.trackers = Trackers.open(self.config, self.saved_ids, resumed_at, stop)
                self.saved_ids.update(self.trackers.run_ids())
            except UsageError as err:
                refusal = str(err)
        if self.ctx.is_distributed:
            try:
                refusal = self.ctx.all_gather_object(refusal)[0]
            except RuntimeError:
                # Rank 0 left while its trackers started, after the stop signal every rank got.
                if stop is not None and stop.received:
                    raise StoppedBeforeTraining(next(iter(stop.received))) from None
                raise
        if refusal is not None:
            raise UsageError(refusal)

    # ------------------------------------------------------------ the printer's calls

    def progress(self, n: int = 1) -> None:
        self.printer.progress(n)

    def log(self, record: dict, kind: str = "train") -> None:
        self.printer.log(record, kind)
        if not self.ctx.is_main:
            return
        self.trackers.log(record, kind)
        if self.log_file is not None:
            path = self.log_file.path
            if not self.log_file.write(self.printer.line(record, kind)):
                self.log_file = None
                return
            if kind == "summary" and self.printer.format != "simple":  # distlm.report reads JSON lines
                logger.info("pictures of this run: python -m distlm.report %s --out %s", shlex.quote(str(path)),
                            shlex.quote(str(path.parent / "report")))

    def close(self) -> None:
        """End the profiler window, the progress bar and the trackers; lines may still follow."""
        self.profile.stop()
        if self.printer is not None:
            self.printer.close()
        self.trackers.close()
        self.trackers = Trackers()

    # ------------------------------------------------------------ the update's calls

    def next_batch(self, batches: Iterator):
        return self.timing.next_batch(batches)

    @contextlib.contextmanager
    def update(self, number: int) -> Iterator[None]:
        with self.profile.update(number):
            yield

    def computing(self):
        return self.timing.computing()

    def waiting_for_peers(self):
        return self.timing.waiting_for_peers()

    def interval_fields(self) -> dict[str, Any]:
        return self.timing.interval_fields()

    def run_ids(self) -> dict[str, str]:
        """The trackers' run ids, for the checkpoint: a resumed run continues these runs."""
        return dict(self.saved_ids)
