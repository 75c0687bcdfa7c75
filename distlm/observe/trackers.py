"""Experiment trackers as fairseq names them: TensorBoard, Weights & Biases, MLflow.

Rank 0 alone writes. Each log record becomes numbers tagged as fairseq names them:
``train/<key>``, ``valid/<key>`` for the first subset of ``--valid-subset`` (the one the
best checkpoint follows) and ``valid/<subset>/<key>`` for each other subset, with the
update number as the step and the values of the JSON line unchanged. TensorBoard, W&B and
MLflow get the same names. A resumed run continues the same TensorBoard directory (events after
the checkpoint's update are purged, so no update appears twice) and the same W&B and
MLflow runs, whose ids the checkpoint keeps.

A tracker is a guest of the training loop: every call into one runs on a thread of its
own, and the training thread waits for it a bounded time (``START_FINISH_SEC`` to start
or finish, ``LOG_SEC`` to log a line), so a server that refuses, or accepts and never
answers, cannot hold the run. MLflow's requests time out after ``MLFLOW_REQUEST_SEC``,
without its retries (its defaults, 7 retries and 120 s per try, held a call for many
minutes). A tracker that cannot start is one line and exit status 2, or with
``--tracker-best-effort`` one warning and the run goes on without it; a stop signal while
one starts ends the run at once. A tracker that fails during the run, on its call or on a
thread of its own, is one warning and dropped; training goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

from distlm.config import LoggingConfig, TrainConfig, valid_subsets
from distlm.errors import UsageError, first_line
from distlm.runtime.signals import StoppedBeforeTraining, StopSignals

logger = logging.getLogger("distlm")

START_FINISH_SEC = 60.0
"""The longest the training thread waits for one tracker to start or to finish: W&B starts a
service process, MLflow makes a few requests (at most MLFLOW_REQUEST_SEC each)."""
LOG_SEC = 10.0
"""The longest the training thread waits for one tracker to take one log line."""
MLFLOW_REQUEST_SEC = 5
"""MLflow's HTTP timeout per request, with no retries (MLflow's environment variables set
so, unless the user set them)."""
_POLL_SEC = 0.1
"""How often a wait looks for a stop signal."""

# flag -> (config field, module it imports)
_PACKAGES = {
    "--tensorboard-logdir": ("tensorboard_logdir", "tensorboard"),
    "--wandb-project": ("wandb_project", "wandb"),
    "--mlflow-tracking-uri": ("mlflow_tracking_uri", "mlflow"),
}


def check_tracker_packages(settings: LoggingConfig) -> None:
    """Each tracker flag given needs its package: one line naming the extra otherwise."""
    for flag, (name, module) in _PACKAGES.items():
        if getattr(settings, name) is not None and not _importable(module):
            raise UsageError(f"{flag} needs the {module} package: pip install 'distlm[trackers]'")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def record_tags(record: dict[str, Any], kind: str, main_subset: str = "valid") -> dict[str, float]:
    """The numbers of one log record under their tracker tags; None and text are left out.
    ``main_subset``: the first of --valid-subset, whose tags have no subset part (fairseq's
    ``valid/loss``); an extra subset's are ``valid/<subset>/<key>``, and a mixture's source of
    the main subset (validated as ``<main_subset>/<source>``) is ``valid/<source>/<key>``."""
    if kind == "train":
        prefix = "train/"
    elif kind == "valid":
        subset = record.get("subset", main_subset)
        part = "" if subset == main_subset else subset.removeprefix(f"{main_subset}/")
        prefix = f"valid/{part}/" if part else "valid/"
    else:
        return {}
    return {prefix + key: float(value) for key, value in record.items()
            if key not in ("update", "subset") and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, logdir: str, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events a killed run logged after the checkpoint it resumes from.
        self.writer = SummaryWriter(logdir, purge_step=None if resumed_at is None else resumed_at + 1)
        self.run_id = None

    def log(self, tags: dict[str, float], step: int) -> None:
        for tag, value in tags.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, run_name: str | None, run_id: str | None, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow" if run_id else None,
                              config=config)
        self.run_id = self.run.id

    def log(self, tags: dict[str, float], step: int) -> None:
        self.run.log(tags, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    name = "mlflow"
    EXPERIMENT = "distlm"
    _BATCH = 100  # MLflow's limit of params per log_batch

    def __init__(self, uri: str, run_name: str | None, run_id: str | None, config: dict[str, Any]):
        if uri.startswith("file:") and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
            # MLflow 3 refuses its file store unless asked; the database stores need the full
            # mlflow package, which the trackers extra does not bring.
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            logger.info("mlflow: using the file store %s (MLFLOW_ALLOW_FILE_STORE=true)", uri)
        if uri.startswith(("http:", "https:")):
            for name, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0"),
                                ("MLFLOW_HTTP_REQUEST_TIMEOUT", str(MLFLOW_REQUEST_SEC))):
                os.environ.setdefault(name, value)
            logger.info("mlflow: %s, requests time out after %s s, %s retries (MLFLOW_HTTP_REQUEST_TIMEOUT, "
                        "MLFLOW_HTTP_REQUEST_MAX_RETRIES)", uri, os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"],
                        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"])
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.logged_up_to = 0
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            # A run killed after its last checkpoint logged updates that the resumed run does
            # again; MLflow cannot delete points, so those updates are not logged twice.
            self.logged_up_to = max((m.step for key in self.client.get_run(run_id).data.metrics
                                     for m in self.client.get_metric_history(run_id, key)), default=0)
            return
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", self.EXPERIMENT)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(key, str(value)) for key, value in _flatten(config).items()]
        for start in range(0, len(params), self._BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + self._BATCH])

    def log(self, tags: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_up_to:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, value, now, step) for tag, value in tags.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


class _TimedOut(Exception):
    pass


def _deepest_cause(err: BaseException) -> str:
    """``Type: first line`` of the innermost library error under ``err``: an HTTP client's
    wrappers hide what happened ("Max retries exceeded" over "Connection refused" or "Read
    timed out"), and the OS error under it has lost the address."""
    seen, found = {id(err)}, err
    while True:
        inner = getattr(err, "reason", None)
        inner = inner if isinstance(inner, BaseException) else err.__cause__ or err.__context__
        if inner is None or id(inner) in seen:
            return f"{type(found).__name__}: {first_line(found)}"
        seen.add(id(inner))
        err = inner
        if type(err).__module__ != "builtins":
            found = err


class Trackers:
    """The trackers of one run (rank 0); each failure is one warning and drops that tracker."""

    def __init__(self, trackers: list | None = None, stop: StopSignals | None = None, main_subset: str = "valid"):
        self.trackers = list(trackers or [])
        self.stop = stop
        self.main_subset = main_subset
        """The first subset of --valid-subset: its tags are ``valid/<key>``."""
        self._threads: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()
        """Threads the trackers started (during a call into them) -> the tracker's name."""
        self._in_flight: tuple[str, set[threading.Thread]] | None = None
        """The tracker being called now, and the threads that ran before the call."""
        self._thread_errors: dict[str, BaseException] = {}
        self._previous_hook: Callable | None = None

    @classmethod
    def open(cls, config: TrainConfig, saved_ids: dict[str, str], resumed_at: int | None,
             stop: StopSignals | None = None) -> Trackers:
        """Start the trackers asked for, each within START_FINISH_SEC. One that cannot start is
        a UsageError (a warning with --tracker-best-effort); a stop signal meanwhile is
        StoppedBeforeTraining."""
        settings, whole = config.logging, config.to_dict()
        wanted = []
        if settings.tensorboard_logdir is not None:
            wanted.append(("--tensorboard-logdir", lambda: TensorBoardTracker(settings.tensorboard_logdir, resumed_at)))
        if settings.wandb_project is not None:
            wanted.append(("--wandb-project", lambda: WandbTracker(
                settings.wandb_project, settings.wandb_run_name, saved_ids.get("wandb"), whole)))
        if settings.mlflow_tracking_uri is not None:
            wanted.append(("--mlflow-tracking-uri", lambda: MlflowTracker(
                settings.mlflow_tracking_uri, settings.wandb_run_name, saved_ids.get("mlflow"), whole)))
        opened = cls(stop=stop, main_subset=next(iter(valid_subsets(config.data)), "valid"))
        if wanted:
            opened._catch_thread_errors()
        for flag, start in wanted:
            field, name = _PACKAGES[flag]  # the package's name is the tracker's
            try:
                tracker = opened._call(name, start, timeout=START_FINISH_SEC)
            except StoppedBeforeTraining:
                opened._release_thread_errors()  # and no waiting for the others to finish: the run ends now
                raise
            except Exception as err:  # noqa: BLE001 - whatever the package raises, the user gets one line
                reason = (f"no answer within {START_FINISH_SEC:g} s" if isinstance(err, _TimedOut)
                          else _deepest_cause(err))
                where = f"{flag} {getattr(settings, field)}"
                if settings.tracker_best_effort:
                    logger.warning("%s: %s could not start (%s); training goes on without it (--tracker-best-effort)",
                                   where, name, reason)
                    continue
                opened.close()
                raise UsageError(f"{where}: {name} could not start ({reason}); check it, or add --tracker-best-effort "
                                 "to train without it") from None
            opened.trackers.append(tracker)
            opened._drop_failed_threads()
        return opened

    def run_ids(self) -> dict[str, str]:
        """What a resumed run needs to continue the same runs (saved in the checkpoint)."""
        return {t.name: t.run_id for t in self.trackers if t.run_id is not None}

    def log(self, record: dict[str, Any], kind: str) -> None:
        tags = record_tags(record, kind, self.main_subset)
        if tags and "update" in record:
            self._each("log", LOG_SEC, tags, int(record["update"]))

    def close(self) -> None:
        self._each("close", START_FINISH_SEC)
        self.trackers = []
        self._release_thread_errors()

    def _each(self, method: str, timeout: float, *args: Any) -> None:
        self._drop_failed_threads()
        for tracker in list(self.trackers):
            try:
                self._call(tracker.name, getattr(tracker, method), *args, timeout=timeout)
            except StoppedBeforeTraining as stopped:
                self.trackers.remove(tracker)
                logger.warning("%s: not waited for after %s; the run stops without it", tracker.name, stopped.name)
            except _TimedOut:
                self._drop(tracker, f"no answer within {timeout:g} s")
            except Exception as err:  # noqa: BLE001 - a dashboard must never stop training
                self._drop(tracker, f"{type(err).__name__}: {first_line(err)}")
        self._drop_failed_threads()

    def _drop(self, tracker: Any, reason: str) -> None:
        if tracker in self.trackers:
            self.trackers.remove(tracker)
            logger.warning("%s failed (%s); training goes on without it", tracker.name, reason)

    def _call(self, name: str, function: Callable, *args: Any, timeout: float) -> Any:
        """``function(*args)`` on a thread of its own; the caller waits at most ``timeout``
        seconds (_TimedOut), and no longer than a stop signal that arrives meanwhile
        (StoppedBeforeTraining; one that had arrived before is waited through: the run is
        stopping, and a tracker may still take its last lines)."""
        stopping_already = self.stop is None or bool(self.stop.received)
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = function(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                outcome["error"] = err
            finally:
                done.set()

        caller = threading.Thread(target=run, name=f"distlm-{name}", daemon=True)
        self._in_flight = (name, set(threading.enumerate()) | {caller})
        deadline = time.monotonic() + timeout
        caller.start()
        try:
            while not done.wait(_POLL_SEC):
                if not stopping_already and self.stop.received:
                    raise StoppedBeforeTraining(next(iter(self.stop.received)))
                if time.monotonic() >= deadline:
                    raise _TimedOut()
        finally:
            for thread in set(threading.enumerate()) - self._in_flight[1]:
                self._threads[thread] = name
            self._in_flight = None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    # ------------------------------------------------------------ the trackers' own threads

    def _catch_thread_errors(self) -> None:
        """An exception that ends a thread a tracker started becomes that tracker's one
        warning instead of a traceback on stderr (threading.excepthook, for those threads only)."""
        self._previous_hook = threading.excepthook
        threading.excepthook = self._hook

    def _release_thread_errors(self) -> None:
        if self._previous_hook is not None and threading.excepthook == self._hook:
            threading.excepthook = self._previous_hook

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        name = self._threads.get(args.thread) if args.thread is not None else None
        in_flight = self._in_flight
        if name is None and in_flight is not None and args.thread not in in_flight[1]:
            name = in_flight[0]
        if name is None:
            self._previous_hook(args)
        else:
            self._thread_errors.setdefault(name, args.exc_value)

    def _drop_failed_threads(self) -> None:
        for tracker in list(self.trackers):
            err = self._thread_errors.get(tracker.name)
            if err is not None:
                self._drop(tracker, f"{type(err).__name__}: {first_line(err)}")
